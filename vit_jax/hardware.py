"""What the devices can do and how the host serves them.

Peak FLOP/s, for model FLOPs utilisation (MFU): accelerators use their published dense peak for
the compute dtype; CPUs (and devices not in the table) use a peak measured in this process: the
best rate of a large jitted matmul. And, for XLA:CPU, `use_one_device_per_core`, which lets a
sharded step use every core for all of its work, and `keep_freed_host_memory`, which spares its
steps from page-faulting their buffers back in. `Pacer` keeps a loop of computations a few steps
ahead of the devices, no more, and is where every loop over batches can be stopped alike in
every process (`at_each_batch`).
"""
import collections
import contextlib
import ctypes
import functools
import importlib.metadata
import importlib.util
import os
import time
from typing import Callable, TypeVar

import jax
from jax._src import hardware_utils  # The PCI scan JAX runs before it starts libtpu.
import jax.numpy as jnp

from vit_jax import cache

# Published dense peaks per chip in FLOP/s: (bfloat16, float32). float32 on NVIDIA tensor cores
# runs as TF32 under JAX's default matmul precision.
PUBLISHED_PEAKS = {
    'TPU v2': (45e12, 45e12 / 4),
    'TPU v3': (123e12, 123e12 / 4),
    'TPU v4': (275e12, 275e12 / 4),
    'TPU v5 lite': (197e12, 197e12 / 4),
    'TPU v5e': (197e12, 197e12 / 4),
    'TPU v5p': (459e12, 459e12 / 4),
    'TPU v6 lite': (918e12, 918e12 / 4),
    'TPU v6e': (918e12, 918e12 / 4),
    'NVIDIA H200': (989e12, 494e12),
    'NVIDIA H100': (989e12, 494e12),
    'NVIDIA A100': (312e12, 156e12),
    'NVIDIA L4': (121e12, 60e12),
    'NVIDIA A10': (125e12, 62.5e12),
    'Tesla V100': (125e12, 15.7e12),
}


# glibc's mallopt() parameters (<malloc.h>).
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def only_cpu_backend() -> bool:
  """Whether JAX will run on the host CPU, decided without starting a backend.

  True when JAX_PLATFORMS (`jax.config.jax_platforms`) names 'cpu' first, or when it names
  nothing and no accelerator plugin (CUDA, ROCm: `jax_plugins`) is installed and no TPU chip is
  attached. An installed libtpu alone does not count: JAX starts it only where its PCI scan
  finds a TPU chip, and a CPU host may have it installed to compile for TPUs (vit_jax.plan).
  """
  if jax.config.jax_platforms:
    return jax.config.jax_platforms.split(',')[0] == 'cpu'
  return not (importlib.util.find_spec('jax_plugins') or tpu_chips_attached()
              or importlib.metadata.entry_points(group='jax_plugins'))


def tpu_chips_attached() -> int:
  """The TPU chips on this host's PCI bus, found as JAX finds them before it starts libtpu."""
  return hardware_utils.num_available_tpu_chips_and_device_id()[0]


def skip_absent_tpu() -> bool:
  """Keeps JAX from starting libtpu where JAX would run on the CPU anyway (`only_cpu_backend`).

  With libtpu installed (it compiles for TPUs: vit_jax.plan) and JAX_PLATFORMS unset, JAX tries
  its TPU backend in every process, chips or not: it loads libtpu and takes libtpu's lock file of
  the whole host (/tmp/libtpu_lockfile) for the life of the process, so that no other process
  gets the TPU compiler meanwhile. This sets `jax_platforms` to 'cpu' instead. Call it before the
  first JAX computation (the command-line tools call it first thing). Returns whether it did.
  """
  if jax.config.jax_platforms or not only_cpu_backend():
    return False
  jax.config.update('jax_platforms', 'cpu')
  return True


# Beyond it, JAX deletes the programs of vit_jax's compilation cache used longest ago.
COMPILED_PROGRAMS_MAX_BYTES = 4 * 2**30


def use_compilation_cache() -> str | None:
  """Turns JAX's persistent compilation cache on, in the folder `xla` of vit_jax's cache
  (`cache.cache_dir()`), and returns the folder it uses.

  JAX keeps there every program it compiles, keyed by the program, its devices and the
  compiler's version and flags, and reads it back instead of compiling: a resume, a rerun, or
  another command on the same model and batch starts sooner. Programs that compile in under a
  second (JAX's own threshold for keeping one) are kept too: a run compiles dozens of them (its
  initialisation, the few-shot solver's steps, the copies of restored parameters), and together
  they took longer than its largest step. The folder is kept within COMPILED_PROGRAMS_MAX_BYTES:
  past it, JAX deletes the programs used longest ago. The user's own JAX settings win: a folder
  given by JAX_COMPILATION_CACHE_DIR stays (bounded or not as the user chose), as do a bound
  given by JAX_COMPILATION_CACHE_MAX_SIZE and a threshold given by
  JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, and JAX_ENABLE_COMPILATION_CACHE=false keeps the
  cache off (then None). Call it before the first compilation (the command-line tools call it
  first thing).
  """
  if not jax.config.jax_enable_compilation_cache:
    return None
  if not jax.config.jax_compilation_cache_dir:
    folder = os.path.join(cache.cache_dir(), 'xla')
    jax.config.update('jax_compilation_cache_dir', folder)
    if 'JAX_COMPILATION_CACHE_MAX_SIZE' not in os.environ:
      jax.config.update('jax_compilation_cache_max_size', COMPILED_PROGRAMS_MAX_BYTES)
    if jax.config.jax_compilation_cache_max_size != -1:
      stamp_programs_kept_unbounded(folder)
  if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  return jax.config.jax_compilation_cache_dir


def stamp_programs_kept_unbounded(folder: str) -> None:
  """Gives each program that `folder` kept while it had no bound (`KEY-cache` without the
  `KEY-atime` beside it) the last-use time that JAX's eviction reads: its file's modification
  time, in nanoseconds, 8 bytes little-endian. Without it, JAX fails to keep any new program
  there."""
  if not os.path.isdir(folder):
    return
  for name in os.listdir(folder):
    key = name.removesuffix('-cache')
    stamp = os.path.join(folder, f'{key}-atime')
    if key != name and not os.path.exists(stamp):
      used = os.stat(os.path.join(folder, name)).st_mtime_ns
      with open(stamp, 'wb') as f:
        f.write(used.to_bytes(8, 'little'))


def keep_freed_host_memory() -> bool:
  """Makes glibc's malloc keep the memory that XLA:CPU frees, for its next step to reuse.

  XLA:CPU allocates the intermediate buffers of every run of a compiled step afresh (about 2 GB
  for a ViT-S_16 training step at batch 16) and frees them after it. glibc returns blocks that
  large to the kernel at once, so each step faults them back in, page by page: half a million
  page faults and 5-10% of the step's time on 2 cores. With one malloc arena, no
  mmap-allocated blocks and no trimming, freed memory stays in the process and the next step
  reuses it; the process then holds its high-water mark of memory until it exits. (On a loaded
  host a step may still fault where its buffers were freed too late to reuse and the heap grows.)

  Acts only where JAX runs on the CPU (`only_cpu_backend`) and the C library is glibc, and only
  on threads that have not allocated yet: call it before the first JAX computation (the
  command-line tools call it first thing). Returns whether it took effect.
  """
  if not only_cpu_backend():
    return False
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (AttributeError, OSError, TypeError):  # No mallopt (macOS), no CDLL(None) (Windows).
    return False
  # musl has a mallopt() that does nothing and returns 0.
  return all(mallopt(param, value) == 1 for param, value in
             ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1)))  # -1: never trim.


def cpu_cores() -> int:
  """The cores this process may run on (its affinity: taskset, a container's CPU set)."""
  if hasattr(os, 'sched_getaffinity'):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def most_that_fit(available: int, fits: Callable[[int], bool]) -> int:
  """The largest count from 1 to `available` for which `fits(count)`; 1 if none does."""
  return max(n for n in range(1, available + 1) if n == 1 or fits(n))


def use_one_device_per_core(fits: Callable[[int], bool] = lambda count: True) -> int | None:
  """Makes JAX show a CPU host as one device per core, so a step sharded over them runs
  data-parallel on all cores.

  One XLA:CPU device runs a step with a pool of threads, but splits only large operations
  over them: the many small products of attention, for one, run one after another on one
  core. On one device per core, every core runs all of the step for its share of the batch
  (benchmarks/README.md has the figures). The peak of MFU stays the matmul of one device,
  which uses every core.

  Takes the most devices, at most one per core, for which `fits(count)` (say, the batch
  divides). Acts only where JAX runs on the CPU (`only_cpu_backend`) and nobody has set the
  count (XLA_FLAGS' --xla_force_host_platform_device_count, `jax_num_cpu_devices`): set it
  to 1 to keep one device. Call it before the first JAX computation. Returns the count set,
  or None.
  """
  if (not only_cpu_backend() or jax.config.jax_num_cpu_devices != -1
      or 'xla_force_host_platform_device_count' in os.environ.get('XLA_FLAGS', '')):
    return None
  count = most_that_fit(cpu_cores(), fits)
  jax.config.update('jax_num_cpu_devices', count)
  return count


def published_peak_flops(device_kind: str, dtype) -> float | None:
  """Published dense FLOP/s of one chip whose `device_kind` starts with a known name, else None."""
  for name, (bf16, f32) in PUBLISHED_PEAKS.items():
    if device_kind.startswith(name):
      return bf16 if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else f32
  return None


def matmul_flops(size: int) -> int:
  """FLOPs of one (size x size) @ (size x size) product, 2 per multiply-add."""
  return 2 * size**3


def matmul_runner(dtype=jnp.float32, size: int = 2048, device=None) -> Callable[[int], None]:
  """run(n): n back-to-back (size x size) @ (size x size) products on `device`, then waits.

  Compiled before it is returned, so that every call of it can be timed.
  """
  device = device or jax.local_devices()[0]
  a = jax.device_put(jnp.ones((size, size), dtype), device)
  matmul = jax.jit(lambda x: x @ x).lower(a).compile()

  def run(n: int) -> None:
    for _ in range(n):
      product = matmul(a)
    product.block_until_ready()

  return run


def measure_matmul_flops(dtype=jnp.float32, size: int = 1024, repeats: int = 5,
                         device=None) -> float:
  """Best FLOP/s of a (size x size) @ (size x size) matmul on one device, compile excluded.

  Every training run on a device without a published peak measures it at the start; on a CPU,
  products of size 1024 reach the rate of larger ones, in a sixth of the time of size 2048."""
  run = matmul_runner(dtype, size, device)
  run(1)
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    run(1)
    best = min(best, time.perf_counter() - start)
  return matmul_flops(size) / best


@functools.cache
def local_peak_flops(dtype=jnp.float32) -> tuple[float, str]:
  """(FLOP/s of all of this process's devices, 'published' or 'measured') for a compute dtype.

  Simulated CPU devices share the host's cores, so a CPU host counts once, at its measured rate.
  """
  devices = jax.local_devices()
  published = published_peak_flops(devices[0].device_kind, dtype)
  if published is not None:
    return published * len(devices), 'published'
  count = 1 if devices[0].platform == 'cpu' else len(devices)
  return measure_matmul_flops(jnp.dtype(dtype), device=devices[0]) * count, 'measured'


Outputs = TypeVar('Outputs')

# The functions that `Pacer.step` calls at each batch, in the order given (`at_each_batch`).
_BATCH_CALLS: list[Callable[[], None]] = []


@contextlib.contextmanager
def at_each_batch(call: Callable[[], None]):
  """Inside, every `Pacer.step` calls `call()` once the batch is queued; what `call` raises
  stops the loop. Each process of a multi-process run passes the same batches through its
  pacers (their computations are collective), so a `call` that asks the processes' agreement
  (JAX's preemption sync point) gets the same answer at the same batch in each."""
  _BATCH_CALLS.append(call)
  try:
    yield
  finally:
    _BATCH_CALLS.remove(call)


class Pacer:
  """Keeps a loop that queues device computations at most `depth` steps ahead of the devices.

  JAX queues each computation and returns at once. XLA:CPU admits a bounded number of
  computations in flight per device, and starts each device's share of a multi-device computation
  on a pool of max(cores, devices) threads, where a share that finds no free slot blocks its
  thread. A loop that queues hundreds of batches unchecked (an evaluation, few-shot features) can
  so block every thread while another share waits at an all-reduce for a share that can no longer
  start: XLA aborts the process after 40 s. The training loop waits for each step's metrics one
  step late; every other loop over batches passes each step's outputs through `step`.

      pacer = Pacer()
      for batch in batches:
        totals = pacer.step(eval_step(totals, batch))
  """

  def __init__(self, depth: int = 2):
    self._depth = depth
    self._queued = collections.deque()

  def step(self, outputs: Outputs) -> Outputs:
    """Returns `outputs` (any pytree of jax.Arrays) once those of `depth` steps before are ready."""
    self._queued.append(outputs)
    for call in list(_BATCH_CALLS):
      call()
    if len(self._queued) > self._depth:
      jax.block_until_ready(self._queued.popleft())
    return outputs

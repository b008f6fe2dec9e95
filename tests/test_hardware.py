"""Tests of vit_jax/hardware.py: peaks, one device per core, and keeping freed host memory."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import jax
from jax._src import hardware_utils
import jax.numpy as jnp
import pytest

from vit_jax import cache
from vit_jax import hardware

# Runs a jitted step whose 64 MiB output (above glibc's largest mmap threshold, 32 MiB) is
# allocated and freed at every call, and prints the fewest page faults of one call in 12 after a
# warm-up: under load, some calls fault even where freed memory is kept, as the heap grows where
# an output was freed late. With argument 'keep', keeps freed memory first, which it can on the
# CPU backend that conftest.py's JAX_PLATFORMS=cpu chose.
PAGE_FAULTS_PER_STEP = textwrap.dedent('''
    import resource, sys
    from vit_jax import hardware
    if sys.argv[1] == 'keep':
      assert hardware.only_cpu_backend() and hardware.keep_freed_host_memory()
    import jax, jax.numpy as jnp
    step = jax.jit(lambda x: x * 2)
    x = jnp.ones((4096, 4096))
    for _ in range(10):  # Warm up.
      step(x).block_until_ready()
    faults = []
    for _ in range(12):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      step(x).block_until_ready()
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(min(faults))
''')


def run_python(code: str, *args: str, **env: str) -> str:
  """Standard output of `code` run by a fresh Python (one whose JAX has not started yet)."""
  return subprocess.run([sys.executable, '-c', code, *args], env={**os.environ, **env},
                        check=True, capture_output=True, text=True).stdout


def test_kept_host_memory_spares_steps_their_page_faults():
  default = float(run_python(PAGE_FAULTS_PER_STEP, 'default'))
  kept = float(run_python(PAGE_FAULTS_PER_STEP, 'keep'))
  pages_of_output = 64 * 2**20 // 4096
  assert default > pages_of_output / 2  # glibc gave the freed output back to the kernel.
  # Kept, a call can run without faulting; by default none does.
  assert kept < default / 10


def test_host_memory_is_left_alone_for_an_accelerator():
  # As with JAX_PLATFORMS=cuda; nothing starts a backend. (On the CPU it is kept: above.)
  platforms = jax.config.jax_platforms
  jax.config.update('jax_platforms', 'cuda')
  try:
    assert not hardware.only_cpu_backend()
    assert not hardware.keep_freed_host_memory()
  finally:
    jax.config.update('jax_platforms', platforms)


def test_accelerators_use_their_published_peak():
  # The vendors' data sheets: dense bfloat16 of an H100 SXM and of a TPU v4 chip, dense TF32 of
  # an A100 (float32 matmuls run as TF32 under JAX's default precision).
  assert hardware.published_peak_flops('NVIDIA H100 80GB HBM3', jnp.bfloat16) == 989e12
  assert hardware.published_peak_flops('TPU v4', jnp.bfloat16) == 275e12
  assert hardware.published_peak_flops('NVIDIA A100-SXM4-40GB', jnp.float32) == 156e12
  assert hardware.published_peak_flops('cpu', jnp.float32) is None  # Measured instead.


# Prints what use_one_device_per_core returned and the devices JAX then has, in a process
# whose JAX has not started, for a batch of argv[1] that the count must divide, and that may run
# on the cores given as further arguments (all if none).
DEVICES_PER_CORE = textwrap.dedent('''
    import os, sys
    batch = int(sys.argv[1])
    if sys.argv[2:]:
      os.sched_setaffinity(0, {int(core) for core in sys.argv[2:]})
    from vit_jax import hardware
    count = hardware.use_one_device_per_core(lambda n: batch % n == 0)
    import jax
    print(count, jax.local_device_count())
''')


@pytest.mark.parametrize('batch, cores, devices', [
    (6, 2, '2'),  # One device per core that the process may run on (not per core of the host).
    (5, 2, '1'),  # 2 devices do not divide the batch.
])
def test_a_cpu_host_gets_one_device_per_core_that_fits(batch, cores, devices):
  allowed = sorted(os.sched_getaffinity(0))
  if len(allowed) < cores:
    pytest.skip(f'needs {cores} cores, this process may use {len(allowed)}')
  out = run_python(DEVICES_PER_CORE, str(batch), *map(str, allowed[:cores]), XLA_FLAGS='')
  assert out.split() == [devices, devices]


def test_a_cpu_host_with_libtpu_installed_still_gets_one_device_per_core():
  # As a user runs a command: no JAX_PLATFORMS. requirements-test.txt installs libtpu (to compile
  # for TPUs), which JAX leaves unstarted on a host without TPU chips; nor does vit_jax count it.
  assert importlib.util.find_spec('libtpu')
  assert hardware_utils.num_available_tpu_chips_and_device_id()[0] == 0
  allowed = sorted(os.sched_getaffinity(0))[:2]
  run = subprocess.run([sys.executable, '-c', DEVICES_PER_CORE, '6', *map(str, allowed)],
                       env={**os.environ, 'XLA_FLAGS': '', 'JAX_PLATFORMS': ''},
                       check=True, capture_output=True, text=True)
  assert run.stdout.split() == [str(len(allowed))] * 2


# Prints whether skip_absent_tpu acted, JAX's devices, and whether libtpu got loaded.
LIBTPU_LOADED = textwrap.dedent('''
    from vit_jax import hardware
    print(hardware.skip_absent_tpu())
    import jax
    print(jax.devices()[0].platform, 'libtpu' in open('/proc/self/maps').read())
''')


def test_a_cpu_host_leaves_libtpu_unloaded_and_its_lock_file_free():
  # Loaded, libtpu would take /tmp/libtpu_lockfile until the process ends, and keep every other
  # process (vit_jax.plan) from compiling for TPUs meanwhile.
  assert run_python(LIBTPU_LOADED, JAX_PLATFORMS='').split() == ['True', 'cpu', 'False']


@pytest.mark.parametrize('env, devices', [
    ({'XLA_FLAGS': '--xla_force_host_platform_device_count=5'}, '5'),
    ({'XLA_FLAGS': '', 'JAX_NUM_CPU_DEVICES': '3'}, '3'),
])
def test_a_device_count_set_by_the_user_is_kept(env, devices):
  assert run_python(DEVICES_PER_CORE, '6', **env).split() == ['None', devices]


# Compiles x * FACTOR for FACTOR argv[1] with vit_jax's compilation cache; prints the cache's
# bound and the keys of the programs it keeps, with whether each has its last-use time.
COMPILE_ONE_PROGRAM = textwrap.dedent('''
    import os, sys
    from vit_jax import hardware
    import jax, jax.numpy as jnp
    folder = hardware.use_compilation_cache()
    jax.jit(lambda x: x * int(sys.argv[1]))(jnp.ones(4096)).block_until_ready()
    print(jax.config.jax_compilation_cache_max_size)
    print(' '.join(sorted(name for name in os.listdir(folder) if not name.startswith('.'))))
''')


def programs_kept(cache_folder, factor: int, **env: str) -> tuple[int, list[str], str]:
  """(the bound, the names of the files in vit_jax's compilation cache, stderr) after a process
  as a user starts one (no JAX cache settings of the harness) compiled x * `factor`."""
  user_env = {name: value for name, value in os.environ.items() if not name.startswith('JAX_')}
  result = subprocess.run([sys.executable, '-c', COMPILE_ONE_PROGRAM, str(factor)],
                          env={**user_env, 'JAX_PLATFORMS': 'cpu',
                               cache.CACHE_ENV: str(cache_folder), **env},
                          check=True, capture_output=True, text=True)
  bound, names = result.stdout.splitlines()
  return int(bound), names.split(), result.stderr


def test_vit_jaxs_compilation_cache_is_bounded_and_the_programs_used_longest_ago_go_first(
    tmp_path):
  bound, names, _ = programs_kept(tmp_path, 2)
  assert bound == 4 * 2**30
  times = [name for name in names if 'jit__lambda' in name]
  assert len(times) == 2 and times[0].endswith('-atime') and times[1].endswith('-cache'), names
  first = times[1].removesuffix('-cache')
  size = os.path.getsize(tmp_path / 'xla' / times[1])
  # A bound of the user's that holds one such program: the second one compiled replaces it.
  bound, names, _ = programs_kept(tmp_path, 3, JAX_COMPILATION_CACHE_MAX_SIZE=str(size * 3 // 2))
  assert bound == size * 3 // 2
  assert not any(name.startswith(first) for name in names), names
  assert len([name for name in names if name.endswith('-cache')]) == 1, names


def test_a_cache_that_grew_unbounded_is_bounded_from_its_files_times(tmp_path):
  # As an earlier vit_jax, which set no bound, left it: programs without their last-use time.
  _, names, _ = programs_kept(tmp_path, 2, JAX_COMPILATION_CACHE_MAX_SIZE='-1')
  assert names and all(name.endswith('-cache') for name in names), names
  _, after, stderr = programs_kept(tmp_path, 3)
  assert 'Error writing persistent compilation cache' not in stderr, stderr
  kept = [name for name in after if name.endswith('-cache')]
  assert set(names) < set(kept)  # The old ones, and the new program.
  assert sorted(after) == sorted(kept + [name.replace('-cache', '-atime') for name in kept])


def test_a_cache_folder_given_to_jax_is_kept():
  # The harness gives this process its own folder (tests/conftest.py), as a user may.
  assert hardware.use_compilation_cache() == os.environ['JAX_COMPILATION_CACHE_DIR']

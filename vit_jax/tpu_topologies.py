"""Cloud TPU slices as their accelerator types name them ('v5e-16', 'v4-32'): each generation's
chip (HBM, bfloat16 peak, HBM bandwidth), the slice's chip grid and hosts, and its devices to
compile for with libtpu where there is no TPU (jax.experimental.topologies).
"""
import dataclasses
import os
import re
import signal
import threading

import jax
from jax.experimental import topologies

# Sources: Google Cloud TPU documentation, "TPU v4", "TPU v5e", "TPU v5p", "TPU v6e" (system
# architecture and configurations), https://cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}.


@dataclasses.dataclass(frozen=True)
class Generation:
  """A Cloud TPU generation, per chip: HBM bytes, dense bfloat16 FLOP/s, HBM bytes/s."""
  name: str  # As libtpu names it in a topology ('v5e:4x4').
  hbm_bytes: int
  bf16_flops: float
  hbm_bytes_per_second: float
  cores_per_chip_in_name: int  # v4-8 and v5p-8 count TensorCores (2 a chip); v5e and v6e chips.
  shapes: dict  # {chips: the slice's chip grid}, as the documentation lists the slices.
  chip_config: str = 'default'  # libtpu's: v4 runs its two TensorCores as one device.


GRID_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
           128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16), 2048: (8, 16, 16),
           4096: (16, 16, 16), 6144: (16, 16, 24)}
GRID_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16),
           256: (16, 16)}
GENERATIONS = {
    'v4': Generation('v4', 32 * 2**30, 275e12, 1200e9, 2,
                     {c: s for c, s in GRID_3D.items() if c <= 2048}, 'megacore'),
    'v5e': Generation('v5e', 16 * 10**9, 197e12, 819e9, 1, GRID_2D),
    'v5p': Generation('v5p', 95 * 10**9, 459e12, 2765e9, 2, GRID_3D),
    'v6e': Generation('v6e', 32 * 10**9, 918e12, 1640e9, 1, GRID_2D),
}
ALIASES = {'v5litepod': 'v5e'}
# Slices of up to this many chips are one host (one VM); larger ones have 4 chips a host.
SINGLE_HOST_CHIPS = {'v4': 4, 'v5e': 8, 'v5p': 4, 'v6e': 8}
CHIPS_PER_HOST = 4


class TopologyError(ValueError):
  """A name that is not a Cloud TPU accelerator type, or a count of slices below 1 (one
  line)."""


@dataclasses.dataclass(frozen=True)
class Topology:
  """A slice: its generation, chips, chip grid and hosts, and how many such slices."""
  name: str
  generation: Generation
  chips: int
  grid: tuple
  hosts: int
  slices: int = 1

  @property
  def chips_per_host(self) -> int:
    return self.chips // self.hosts

  def host_bounds(self) -> tuple:
    """The chip grid of one host, as libtpu takes it (x, y, z)."""
    if self.hosts == 1:
      return tuple(self.grid) + (1,) * (3 - len(self.grid))
    return (2, 2, 1)


def parse_topology(name: str, slices: int = 1) -> Topology:
  """The Topology of a Cloud TPU accelerator type ('v5e-16', 'v5litepod-16', 'v4-32')."""
  match = re.fullmatch(r'(v\d\w*)-(\d+)', name or '')
  kind = ALIASES.get(match[1], match[1]) if match else None
  if kind not in GENERATIONS:
    raise TopologyError(
        f'--topology={name!r} is not a Cloud TPU accelerator type: use e.g. v5e-16, '
        f'v5litepod-16, v4-32, v5p-8 or v6e-4 ({", ".join(GENERATIONS)}).')
  generation = GENERATIONS[kind]
  count = int(match[2])
  chips, extra = divmod(count, generation.cores_per_chip_in_name)
  if extra or chips not in generation.shapes:
    sizes = ', '.join(f'{kind}-{c * generation.cores_per_chip_in_name}'
                      for c in generation.shapes)
    raise TopologyError(f'--topology={name!r}: {kind} slices are {sizes}.')
  if slices < 1:
    raise TopologyError(f'--slices={slices} must be 1 or more.')
  hosts = 1 if chips <= SINGLE_HOST_CHIPS[kind] else chips // CHIPS_PER_HOST
  return Topology(name, generation, chips, generation.shapes[chips], hosts, slices)


def compile_only_devices(topology: Topology) -> list:
  """The TPU devices of `topology` (all its slices), which compile but do not run.

  libtpu, as it loads, makes SIGTERM (a scheduler's or `timeout`'s stop) print a stack dump of
  every thread. In the main thread, SIGTERM gets back the handler Python had for it before, the
  default one by default, which ends the process quietly."""
  before = signal.getsignal(signal.SIGTERM)
  grid = 'x'.join(map(str, topology.grid))
  description = topologies.get_topology_desc(
      platform='tpu', topology_name=f'{topology.generation.name}:{grid}',
      chip_config_name=topology.generation.chip_config,
      chips_per_host_bounds=topology.host_bounds(), num_slices=topology.slices)
  if before is not None and threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, before)
  return list(description.devices)


def use_tpu_compiler_only(topology: Topology) -> None:
  """Sets this process up to compile for `topology` with libtpu without claiming any TPU: JAX
  runs on the CPU; libtpu takes no host-wide lock (it may share the host with a run on its
  chips, or another plan) and is told the accelerator type and hosts, which it would otherwise
  look up, warn about and fail to find off a TPU VM; JAX's persistent compilation cache stays
  off. Call it before JAX starts."""
  jax.config.update('jax_platforms', 'cpu')
  # Its executables need a TPU client to be read back from JAX's persistent cache.
  jax.config.update('jax_enable_compilation_cache', False)
  os.environ['ALLOW_MULTIPLE_LIBTPU_LOAD'] = '1'
  os.environ.setdefault('TPU_SKIP_MDS_QUERY', '1')
  os.environ.setdefault('TPU_ACCELERATOR_TYPE', topology.name)
  os.environ.setdefault('TPU_WORKER_HOSTNAMES', 'localhost')

"""Whether a training step fits its devices' memory, from the compiler's own figures.

The compiled step's `memory_analysis()` gives, per device, the bytes of its arguments (the train
state and a batch), outputs, temporaries and code; donated arguments that the outputs reuse count
once. `vit_jax.main` compiles the step before the first one and stops with one line where it does
not fit, naming what would (`FitError`); `config.accum_steps='auto'` takes the smallest
accumulation that fits. `vit_jax.plan` runs the same check against a TPU chip's HBM.
"""
import dataclasses
import os
import re
from typing import Callable, Optional

import jax
from jax.sharding import Mesh
import ml_collections

from vit_jax.config.checks import data_parallel_size
from vit_jax.console import readable_bytes
from vit_jax.errors import ConfigError
from vit_jax.training import setup as train_setup
from vit_jax.training import step as train_step

# A compiler that runs out of memory says so in an error with this status.
OUT_OF_MEMORY = 'RESOURCE_EXHAUSTED'


class FitError(ConfigError):
  """The training step needs more memory per device than the device has (one line)."""


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """Bytes per device of a compiled step; `refusal` is the compiler's own out-of-memory message
  where it refused to compile the step at all (the byte counts are then 0)."""
  argument_bytes: int = 0
  output_bytes: int = 0
  alias_bytes: int = 0  # Outputs written into donated arguments (counted in both above).
  temp_bytes: int = 0
  code_bytes: int = 0
  refusal: Optional[str] = None

  @property
  def total_bytes(self) -> int:
    """Everything live at the step's peak: arguments, outputs not in donated arguments,
    temporaries and the program."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
            + self.code_bytes)

  def describe(self) -> str:
    """'12.3 GiB per device', or the compiler's figures where it refused."""
    if self.refusal:
      return refusal_figure(self.refusal)
    return f'{readable_bytes(self.total_bytes)} per device'


def memory_of(compiled) -> StepMemory:
  """The StepMemory of a `jax.stages.Compiled`."""
  analysis = compiled.memory_analysis()
  return StepMemory(analysis.argument_size_in_bytes, analysis.output_size_in_bytes,
                    analysis.alias_size_in_bytes, analysis.temp_size_in_bytes,
                    analysis.generated_code_size_in_bytes)


def refusal_figure(message: str) -> str:
  """The need in a compiler's out-of-memory message, as the compiler put it: '51.40G for HLO
  temporaries (the compiler's figure; 15.75G HBM available)', or the message's first line."""
  match = re.search(r'required for ([\w ]+?) \(([\d.]+\w?)\) exceeds available (\w+) '
                    r'\(([\d.]+\w?)\)', message)
  if match:
    return (f"{match[2]} for {match[1]} per device (the compiler's figure; {match[4]} "
            f'{match[3]} available)')
  match = re.search(r'Used ([\d.]+\w?) of ([\d.]+\w?) (\w+)', message)
  if match:
    return f"{match[1]} per device (the compiler's figure; {match[2]} {match[3]} available)"
  return message.strip().splitlines()[0][:200]


def compile_or_refusal(lower: Callable[[], 'jax.stages.Lowered']):
  """(compiled, None), or (None, the compiler's message) where it ran out of memory."""
  try:
    return lower().compile(), None
  except jax.errors.JaxRuntimeError as e:
    if OUT_OF_MEMORY not in str(e):
      raise
    return None, str(e)


def available_host_memory() -> int:
  """Bytes this process may still take on its host: the kernel's MemAvailable, capped by the
  limit of its cgroup (a container's memory limit) where one is set."""
  with open('/proc/meminfo') as f:
    available = next(int(line.split()[1]) * 1024 for line in f
                     if line.startswith('MemAvailable:'))
  for limit, usage in (('/sys/fs/cgroup/memory.max', '/sys/fs/cgroup/memory.current'),
                       ('/sys/fs/cgroup/memory/memory.limit_in_bytes',
                        '/sys/fs/cgroup/memory/memory.usage_in_bytes')):
    try:
      with open(limit) as f, open(usage) as g:
        available = min(available, int(f.read()) - int(g.read()))
    except (OSError, ValueError):  # No such cgroup file, or 'max' (no limit).
      continue
  return available


def device_memory_limit(device) -> tuple[int, str]:
  """(bytes a step may use on `device`, where that figure comes from): the backend's
  `memory_stats()['bytes_limit']` where it reports one; for CPU devices, the host's available
  memory shared by this process's devices."""
  stats = device.memory_stats() or {}
  if 'bytes_limit' in stats:
    return stats['bytes_limit'], f'{device.device_kind} memory'
  if device.platform == 'cpu' and os.path.exists('/proc/meminfo'):
    count = jax.local_device_count()
    return (available_host_memory() // count,
            f"the host's available memory{f' over {count} devices' if count > 1 else ''}")
  return 0, ''  # Not known: not checked.


def with_field(config: ml_collections.ConfigDict, field: str, value) -> ml_collections.ConfigDict:
  """A copy of `config` with `field` set to `value`."""
  config = config.copy_and_resolve_references()
  with config.ignore_type():  # accum_steps: 'auto' or an int.
    config[field] = value
  return config


def accum_candidates(config: ml_collections.ConfigDict, data_devices: int) -> list[int]:
  """The accumulation steps that split config.batch evenly over `data_devices`, ascending."""
  per_device = config.batch // data_devices
  return [k for k in range(1, per_device + 1) if per_device % k == 0]


def smallest_that_fits(configs: list[ml_collections.ConfigDict],
                       memory: Callable[[ml_collections.ConfigDict], StepMemory], limit: int):
  """The first of `configs` whose step fits in `limit` bytes, by binary search (a larger
  accumulation needs less memory), with its StepMemory; (None, None) if none does."""
  low, high, found = 0, len(configs) - 1, (None, None)
  while low <= high:
    middle = (low + high) // 2
    used = memory(configs[middle])
    if used.refusal is None and used.total_bytes <= limit:
      found, high = (configs[middle], used), middle - 1
    else:
      low = middle + 1
  return found


def alternatives(config: ml_collections.ConfigDict, data_devices: int,
                 memory: Callable[[ml_collections.ConfigDict], StepMemory],
                 limit: int) -> list[str]:
  """'--config.FIELD=VALUE (N GiB)' for each change that makes the step fit in `limit` bytes: the
  smallest larger accum_steps, rematerialisation, fsdp; each with its per-device total."""
  found = []
  larger = [with_field(config, 'accum_steps', k) for k in accum_candidates(config, data_devices)
            if k > config.accum_steps]
  fitting, used = smallest_that_fits(larger, memory, limit)
  if fitting is not None:
    found.append(f'--config.accum_steps={fitting.accum_steps} ({readable_bytes(used.total_bytes)})')
  changes = []
  if config.remat_policy != 'nothing_saveable':
    changes.append(('remat_policy', 'nothing_saveable'))
  if 'fsdp' not in config.sharding:
    changes.append(('sharding', 'fsdp' if config.sharding == 'data' else 'fsdp+tensor'))
  for field, value in changes:
    used = memory(with_field(config, field, value))
    if used.refusal is None and used.total_bytes <= limit:
      found.append(f'--config.{field}={value} ({readable_bytes(used.total_bytes)})')
  return found


def check(config: ml_collections.ConfigDict, data_devices: int,
          memory: Callable[[ml_collections.ConfigDict], StepMemory], limit: int, where: str,
          used: Optional[StepMemory] = None) -> StepMemory:
  """The StepMemory of `config`'s step; raises FitError, naming the need, the limit and what
  would fit, where it exceeds `limit` bytes (`where` names that limit). `used` spares a
  compilation already done."""
  used = used or memory(config)
  if used.refusal is None and (not limit or used.total_bytes <= limit):
    return used
  options = alternatives(config, data_devices, memory, limit)
  raise FitError(
      f'The training step needs {used.describe()}, more than the '
      f'{readable_bytes(limit)} of {where}. '
      + (f'It would fit with {" or ".join(options)}.' if options else
         'No larger config.accum_steps, config.remat_policy=nothing_saveable or '
         'config.sharding=fsdp makes it fit: use more devices or a smaller config.batch.'))


def resolve_accum_steps(config: ml_collections.ConfigDict, data_devices: int,
                        memory: Callable[[ml_collections.ConfigDict], StepMemory],
                        limit: int, where: str) -> ml_collections.ConfigDict:
  """`config` with accum_steps='auto' replaced by the smallest accumulation whose step fits in
  `limit` bytes (1 where the limit is not known); FitError where none does."""
  candidates = [with_field(config, 'accum_steps', k)
                for k in accum_candidates(config, data_devices)]
  if not limit:
    return candidates[0]
  fitting, _ = smallest_that_fits(candidates, memory, limit)
  if fitting is None:
    check(candidates[-1], data_devices, memory, limit, where)  # Raises, with the alternatives.
  return fitting


def lower_train_step(config: ml_collections.ConfigDict, mesh: Mesh, num_classes: int,
                     multi_label: bool = False):
  """The training step of `config` for `mesh`, built as vit_jax.training.trainer builds it (model,
  optimiser, train state and its shardings, `jit_train_step`) and lowered for abstract state and
  batches (jax.stages.Lowered), their labels multi-hot for `multi_label` data: nothing is made
  on the devices."""
  model = train_setup.build_model(config, num_classes, list(mesh.devices.flat))
  optimizer = train_step.make_optimizer(config)
  state, shardings = train_step.abstract_train_state(config, model, optimizer, mesh,
                                                     config.pp.crop)
  return train_step.jit_train_step(model, optimizer, config, mesh, shardings).lower(
      state, train_step.abstract_batch(config, mesh, multi_hot=num_classes * multi_label))


def step_memory(config: ml_collections.ConfigDict, mesh: Mesh, num_classes: int,
                multi_label: bool = False) -> StepMemory:
  """The StepMemory of `config`'s training step on `mesh`, compiled."""
  compiled, refusal = compile_or_refusal(
      lambda: lower_train_step(config, mesh, num_classes, multi_label))
  return StepMemory(refusal=refusal) if compiled is None else memory_of(compiled)


def checked_train_step(config: ml_collections.ConfigDict, model, optimizer, mesh: Mesh,
                       shardings, state, multi_label: bool = False):
  """`jit_train_step` compiled for `state` and the batches of `config` (their labels multi-hot
  for `multi_label` data), before the first step; FitError (one line: need, limit, what would
  fit) where it does not fit the memory of this process's devices of the mesh
  (`device_memory_limit`; only those report their memory)."""
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  compiled, refusal = compile_or_refusal(
      lambda: step.lower(state, train_step.abstract_batch(
          config, mesh, multi_hot=model.num_classes * multi_label)))
  used = StepMemory(refusal=refusal) if compiled is None else memory_of(compiled)
  limit, where = device_memory_limit(mesh.local_devices[0])
  check(config, data_parallel_size(config, mesh.size),
        lambda c: step_memory(c, mesh, model.num_classes, multi_label), limit, where, used)
  return compiled


def fitted_config(config: ml_collections.ConfigDict, mesh: Mesh, num_classes: int, limit: int,
                  where: str, multi_label: bool = False) -> ml_collections.ConfigDict:
  """`config`, its accum_steps='auto' resolved for `limit` bytes a device (resolve_accum_steps)."""
  if config.accum_steps != 'auto':
    return config
  return resolve_accum_steps(config, data_parallel_size(config, mesh.size),
                             lambda c: step_memory(c, mesh, num_classes, multi_label), limit,
                             where)

"""Compiles a config's training step for a Cloud TPU slice, here, without a TPU:
`python -m vit_jax.plan --config=FILE[:ARG] --topology=NAME [--slices=N] [--config.FIELD=...]
[--out=plan.json]`.

It builds the step as `vit_jax.main` would (model, optimiser, train state, shardings, mesh, step
function: vit_jax.fit.lower_train_step), and the evaluation step, and compiles both with libtpu's
compiler for compile-only devices of the slice (jax.experimental.topologies), with no dataset
and no TensorFlow. It prints one short table: per chip, the memory against the chip's HBM, the
FLOPs, a roofline bound on the step time, the TPU kernels the step calls (Pallas custom calls,
such as splash attention's forward and backward), and the compile time. It exits 0 where the
step fits, 1 where it does not (the one line then names what would fit, as main's check does).
NAME is a Cloud TPU accelerator type: v4-8 ... v4-4096, v5e-1 ... v5e-256 (or v5litepod-N),
v5p-8 ..., v6e-1 ... v6e-256.
"""
import importlib.metadata
import json
import math
import os
import re
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import ml_collections

from vit_jax import console
from vit_jax import hardware
from vit_jax import tasks
from vit_jax import tpu_topologies
from vit_jax.config import checks
from vit_jax.config import command_line
from vit_jax.models import attention
from vit_jax.training import fit
from vit_jax.training import setup as train_setup
from vit_jax.training import step as train_step

flags.DEFINE_string('topology', None, 'Cloud TPU accelerator type, e.g. v5e-16, v5litepod-16, '
                    'v4-32, v5p-8, v6e-4.')
flags.DEFINE_integer('slices', 1, 'Slices of that type joined by the data-centre network '
                     '(multi-slice); data parallelism spans them.')
flags.DEFINE_integer('num_classes', None, "Classes of the model's head; default: those of "
                     'config.dataset where DATASET_CLASSES knows it.')
flags.DEFINE_string('out', None, 'Also write the plan as JSON to this file.')
# One --log_all per process: main and plan each define it, and a process may import both.
if 'log_all' not in flags.FLAGS:
  flags.DEFINE_bool('log_all', False, 'Show every library\'s INFO lines in absl\'s format (as '
                    '--verbosity=1 does); by default the console shows vit_jax\'s lines and other '
                    'libraries\' warnings.')

# Classes of the datasets the configs name, for the head (a dataset elsewhere: --num_classes).
DATASET_CLASSES = {'fashion_mnist_embedded': 10, 'cifar10': 10, 'cifar100': 100,
                   'imagenet2012': 1000, 'imagenet21k': 21843, 'oxford_iiit_pet': 37,
                   'oxford_flowers102': 102, 'mnist': 10, 'fashion_mnist': 10}


class PlanError(ValueError):
  """An option that cannot be planned (one line)."""


def num_classes_of(config: ml_collections.ConfigDict, given) -> int:
  """--num_classes, or the classes of config.dataset (DATASET_CLASSES)."""
  if given:
    return given
  if config.dataset not in DATASET_CLASSES:
    raise PlanError(f'The classes of config.dataset={config.dataset!r} are not known here: '
                    'give --num_classes.')
  return DATASET_CLASSES[config.dataset]


def shard_bytes(tree) -> int:
  """Bytes of the first device's shard of each ShapeDtypeStruct in `tree`, summed."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    total += jnp.dtype(leaf.dtype).itemsize * math.prod(leaf.sharding.shard_shape(leaf.shape))
  return total


def roofline(flops: float, bytes_accessed: float, generation: tpu_topologies.Generation) -> float:
  """A lower bound on the seconds of a step: its FLOPs at the chip's bf16 peak, or its HBM
  traffic at the chip's bandwidth, whichever takes longer."""
  return max(flops / generation.bf16_flops, bytes_accessed / generation.hbm_bytes_per_second)


def topology_mesh(config: ml_collections.ConfigDict, topology: tpu_topologies.Topology):
  """The mesh of `config` over the compile-only devices of `topology`, the config first
  validated for them (checks.ConfigError)."""
  devices = tpu_topologies.compile_only_devices(topology)
  checks.validate_config(config, len(devices), devices[0].platform)
  return train_setup.make_mesh(config, devices)


def train_step_plan(config: ml_collections.ConfigDict, mesh, topology: tpu_topologies.Topology,
                    num_classes: int) -> tuple[dict, fit.StepMemory]:
  """The training step of `config` lowered and compiled for `mesh` (over `topology`'s devices):
  (the plan's dict without the evaluation step, the step's StepMemory). The dict's `fits` says
  whether the compiler took the step and its per-chip total is within a chip's HBM; where it
  does, the dict has the FLOPs, the roofline and the TPU kernels."""
  start = time.perf_counter()
  compiled, refusal = fit.compile_or_refusal(
      lambda: fit.lower_train_step(config, mesh, num_classes))
  compile_seconds = time.perf_counter() - start
  used = fit.StepMemory(refusal=refusal) if compiled is None else fit.memory_of(compiled)
  hbm = topology.generation.hbm_bytes
  result = {'topology': {'name': topology.name, 'generation': topology.generation.name,
                         'chips': topology.chips * topology.slices, 'slices': topology.slices,
                         'chips_per_host': topology.chips_per_host,
                         'hosts': topology.hosts * topology.slices,
                         'chip_grid': 'x'.join(map(str, topology.grid))},
            'mesh': dict(mesh.shape), 'config': {
                'model_name': config.model_name, 'batch': config.batch,
                'accum_steps': config.accum_steps, 'pp.crop': config.pp.crop,
                'dtype': config.dtype, 'sharding': config.sharding,
                'remat_policy': config.remat_policy, 'scan_layers': config.scan_layers,
                'attention': attention.resolve_attention(config.attention,
                                                          list(mesh.devices.flat)),
                'optimizer': config.optimizer, 'num_classes': num_classes},
            'versions': {'jax': jax.__version__, 'libtpu': libtpu_version()},
            'compile_seconds': compile_seconds,
            'fits': refusal is None and used.total_bytes <= hbm,
            'per_chip': per_chip(used, hbm, state_bytes(config, mesh, num_classes))}
  if result['fits']:
    cost = compiled.cost_analysis()
    flops, bytes_accessed = cost.get('flops', 0.0), cost.get('bytes accessed', 0.0)
    seconds = roofline(flops, bytes_accessed, topology.generation)
    result.update(
        flops_per_step_per_chip=flops, bytes_accessed_per_step_per_chip=bytes_accessed,
        roofline_step_seconds=seconds,
        roofline_images_per_second_per_chip=config.batch / mesh.size / seconds,
        tpu_custom_calls=custom_calls(compiled.as_text()))
  return result, used


def plan(config: ml_collections.ConfigDict, topology: tpu_topologies.Topology,
         num_classes: int) -> dict:
  """Compiles the training and evaluation steps of `config` for `topology`; the plan as a dict
  (the JSON of --out). Raises checks.ConfigError, or PlannedError (a fit.FitError naming
  what would fit, as main's check does) where the step does not fit a chip's HBM."""
  mesh = topology_mesh(config, topology)
  hbm = topology.generation.hbm_bytes
  where = f'a {topology.generation.name} chip\'s HBM'
  memory = lambda c: fit.step_memory(c, mesh, num_classes)
  config = fit.fitted_config(config, mesh, num_classes, hbm, where)
  result, used = train_step_plan(config, mesh, topology, num_classes)
  if not result['fits']:
    try:
      fit.check(config, checks.data_parallel_size(config, mesh.size), memory, hbm, where,
                used)
    except fit.FitError as e:
      result['error'] = str(e)
      raise PlannedError(str(e), result) from None
  result['eval'] = eval_memory(config, mesh, num_classes, hbm)
  return result


class PlannedError(fit.FitError):
  """FitError with the plan made so far (for --out)."""

  def __init__(self, message: str, result: dict):
    super().__init__(message)
    self.result = result


def state_bytes(config, mesh, num_classes) -> int:
  """Bytes of the train state (params, optimiser state, EMA) that one chip holds."""
  model = train_setup.build_model(config, num_classes, list(mesh.devices.flat))
  state, _ = train_step.abstract_train_state(config, model, train_step.make_optimizer(config),
                                             mesh, config.pp.crop)
  return shard_bytes(state)


def custom_calls(hlo: str) -> dict:
  """{kernel: count} of the TPU custom calls (Pallas/Mosaic kernels) in the optimised HLO text
  `hlo`, each named as its instruction is, less the '.N' suffix: e.g. splash attention's
  'splash_mha_fwd_residuals' (forward) and 'splash_mha_dq_no_residuals' and
  'splash_mha_dkv_no_residuals' (backward). A kernel in a loop's body counts once."""
  names = re.findall(
      r'^\s*(?:ROOT )?%?([\w.-]+?)(?:\.\d+)? = .*custom_call_target="tpu_custom_call"', hlo,
      re.MULTILINE)
  return {name: names.count(name) for name in sorted(set(names))}


def per_chip(used: fit.StepMemory, hbm: int, state: int | None = None) -> dict:
  """The per-chip bytes of the plan's JSON."""
  return {'state_bytes': state, 'argument_bytes': used.argument_bytes,
          'temp_bytes': used.temp_bytes, 'output_bytes': used.output_bytes,
          'alias_bytes': used.alias_bytes, 'code_bytes': used.code_bytes,
          'total_bytes': used.total_bytes, 'hbm_bytes': hbm, 'compiler_refusal': used.refusal}


def eval_memory(config, mesh, num_classes, hbm: int) -> dict:
  """The evaluation step of `config` compiled for `mesh`: its per-chip total bytes, and whether
  it fits `hbm`."""
  model = train_setup.build_model(config, num_classes, list(mesh.devices.flat))
  state, _ = train_step.abstract_train_state(config, model, train_step.make_optimizer(config),
                                             mesh, config.pp.crop)
  step = jax.jit(tasks.for_config(config).eval_step(model, config))
  compiled, refusal = fit.compile_or_refusal(
      lambda: step.lower(state.params, train_step.abstract_batch(config, mesh, evaluation=True)))
  used = fit.StepMemory(refusal=refusal) if compiled is None else fit.memory_of(compiled)
  return {'total_bytes': used.total_bytes, 'fits': refusal is None and used.total_bytes <= hbm,
          'compiler_refusal': refusal}


def libtpu_version() -> str | None:
  """The installed libtpu's version."""
  try:
    return importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    return None


# XLA's cost analysis counts a while loop's body once, whatever its trip count, and nothing of
# a custom call's work.
SCANNED_FLOPS_NOTE = ('Scanned blocks: the FLOPs and the roofline count one block of the loop '
                      "(XLA's cost analysis); --config.scan_layers=False counts them all.")
KERNEL_FLOPS_NOTE = ("TPU kernels: the FLOPs and the roofline leave theirs out (XLA's cost "
                     'analysis cannot see them).')


def table_rows(result: dict) -> list[tuple[str, str]]:
  """(label, value) rows of the plan's table: per chip memory against HBM, FLOPs, roofline,
  kernels, compile time."""
  chip, size, fits = result['per_chip'], console.readable_bytes, result['fits']
  if chip['compiler_refusal']:
    rows = [('compiler', fit.refusal_figure(chip['compiler_refusal']))]
  else:
    state = chip['state_bytes']
    rows = [('params + optimiser state', '-' if state is None else size(state)),
            ('arguments', size(chip['argument_bytes'])),
            ('temporaries', size(chip['temp_bytes'])), ('outputs', size(chip['output_bytes'])),
            ('total', size(chip['total_bytes']))]
  rows += [('HBM', size(chip['hbm_bytes'])), ('fits', 'yes' if fits else 'no')]
  if fits:
    evaluation = result['eval']
    kernels = result['tpu_custom_calls']
    rows += [('evaluation step total', size(evaluation['total_bytes'])
              + ('' if evaluation['fits'] else ', does not fit')),
             ('FLOPs per step', f"{result['flops_per_step_per_chip']:.3g}"),
             ('roofline step', f"{result['roofline_step_seconds'] * 1e3:.3g} ms"),
             ('roofline images/s', f"{result['roofline_images_per_second_per_chip']:.0f}")]
    rows += [(f'kernel {name}', str(count)) for name, count in kernels.items()] or [
        ('TPU kernels', 'none')]
  return rows + [('compile', f"{result['compile_seconds']:.1f} s")]


def summary(result: dict) -> str:
  """The plan as a short table: a line for the run, one for the slice, and per chip its rows
  (`table_rows`): labels aligned, values right-aligned (longer ones, such as a compiler's
  refusal, run on)."""
  config, topology = result['config'], result['topology']
  mesh = ' x '.join(f'{axis} {size}' for axis, size in result['mesh'].items())
  rows = table_rows(result)
  label_width = max(len(label) for label, _ in rows)
  return '\n'.join([
      f"{config['model_name']} at {config['pp.crop']} px, batch {config['batch']} (accum_steps "
      f"{config['accum_steps']}), {config['dtype']}, {config['sharding']} sharding, attention "
      f"{config['attention']}",
      f"{topology['name']} x {topology['slices']} slice(s): {topology['chips']} chip(s), "
      f"{topology['hosts']} host(s), mesh {mesh} (jax {result['versions']['jax']}, libtpu "
      f"{result['versions']['libtpu']})",
      'per chip:'] + [f'  {label:<{label_width}}  {value:>10}' for label, value in rows]
      + flops_notes(result))


def flops_notes(result: dict) -> list[str]:
  """The notes on FLOPs that the cost analysis of a fitting step leaves out: those of all but
  one scanned block, and those of TPU kernels."""
  if not result['fits']:
    return []
  return (([SCANNED_FLOPS_NOTE] if result['config']['scan_layers'] else [])
          + ([KERNEL_FLOPS_NOTE] if result['tpu_custom_calls'] else []))


def write_json(result: dict, path: str) -> None:
  """Writes `result` to `path` (through a temporary file)."""
  with open(path + '.tmp', 'w') as f:
    json.dump(result, f, indent=2)
  os.replace(path + '.tmp', path)


def parse_flags(argv: list[str]) -> list[str]:
  """command_line.parse_flags, called from this module so that --config is its flag in --help."""
  return command_line.parse_flags(argv)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  console.setup(flags.FLAGS.log_all or flags.FLAGS.verbosity >= 1)
  try:
    topology = tpu_topologies.parse_topology(flags.FLAGS.topology, flags.FLAGS.slices)
    num_classes = num_classes_of(flags.FLAGS.config, flags.FLAGS.num_classes)
  except (tpu_topologies.TopologyError, PlanError) as e:
    sys.exit(f'Plan error: {e}')
  tpu_topologies.use_tpu_compiler_only(topology)
  try:
    result = plan(flags.FLAGS.config, topology, num_classes)
  except PlannedError as e:
    if flags.FLAGS.out:
      write_json(e.result, flags.FLAGS.out)
    print(summary(e.result))
    sys.exit(f'Does not fit: {e}')
  except checks.ConfigError as e:
    sys.exit(f'Config error: {e}')
  print(summary(result))
  if flags.FLAGS.out:
    write_json(result, flags.FLAGS.out)


if __name__ == '__main__':
  hardware.skip_absent_tpu()
  app.run(main, flags_parser=parse_flags)

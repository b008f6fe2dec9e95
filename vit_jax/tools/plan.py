"""Compiles a config's training step for a Cloud TPU slice, here, without a TPU:
`python -m vit_jax.plan --config=FILE[:ARG] --topology=NAME [--slices=N] [--config.FIELD=...]
[--out=plan.json]`.

It builds the step as `vit_jax.main` would (model, optimiser, train state, shardings, mesh, step
function: vit_jax.training.tpu_plan), and the evaluation step, and compiles both with libtpu's
compiler for compile-only devices of the slice (jax.experimental.topologies), with no dataset
and no TensorFlow. It prints one short table: per chip, the memory against the chip's HBM, the
FLOPs, a roofline bound on the step time, the TPU kernels the step calls (Pallas custom calls,
such as splash attention's forward and backward), and the compile time. It exits 0 where the
step fits, 1 where it does not (the one line then names what would fit, as main's check does).
NAME is a Cloud TPU accelerator type: v4-8 ... v4-4096, v5e-1 ... v5e-256 (or v5litepod-N),
v5p-8 ..., v6e-1 ... v6e-256.
"""
import json
import os
import sys

from absl import app
from absl import flags

from vit_jax import console
from vit_jax import errors
from vit_jax import hardware
from vit_jax import interrupts
from vit_jax import tpu_topologies
from vit_jax.config import checks
from vit_jax.config import command_line
from vit_jax.training import fit
from vit_jax.training import tpu_plan

flags.DEFINE_string('topology', None, 'Cloud TPU accelerator type, e.g. v5e-16, v5litepod-16, '
                    'v4-32, v5p-8, v6e-4.')
flags.DEFINE_integer('slices', 1, 'Slices of that type joined by the data-centre network '
                     '(multi-slice); data parallelism spans them.')
flags.DEFINE_integer('num_classes', None, "Classes of the model's head; default: those of "
                     'config.dataset, for the datasets the configs name.')
flags.DEFINE_bool('multi_label', False, 'Plan for multi-label data, as main trains an image '
                  'folder with a labels.csv or a tfds dataset whose label is a sequence: labels '
                  'as multi-hot rows of num_classes.')
flags.DEFINE_string('out', None, 'Also write the plan as JSON to this new file.')
# One --log_all per process: main and plan each define it, and a process may import both.
if 'log_all' not in flags.FLAGS:
  flags.DEFINE_bool('log_all', False, 'Show every library\'s INFO lines in absl\'s format (as '
                    '--verbosity=1 does); by default the console shows vit_jax\'s lines and other '
                    'libraries\' warnings.')

# XLA's cost analysis counts a while loop's body once, whatever its trip count, and nothing of
# a custom call's work.
SCANNED_FLOPS_NOTE = ('Scanned blocks: the FLOPs and the roofline count one block of the loop '
                      "(XLA's cost analysis); --config.scan_layers=False counts them all.")
ACCUMULATION_NOTE = ('Accumulation: the FLOPs count the {} micro-batches (XLA\'s cost analysis '
                     'counts the loop once); the bytes accessed, and so a bytes-bound roofline, '
                     'count one.')
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
  """The notes on what the cost analysis of a fitting step counts: one scanned block, all the
  micro-batches of an accumulated step (but their bytes once), and no work of TPU kernels."""
  if not result['fits']:
    return []
  accum_steps = result['config']['accum_steps']
  return (([SCANNED_FLOPS_NOTE] if result['config']['scan_layers'] else [])
          + ([ACCUMULATION_NOTE.format(accum_steps)] if accum_steps > 1 else [])
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
    if flags.FLAGS.out:
      errors.prepare_new_output(flags.FLAGS.out)
    topology = tpu_topologies.parse_topology(flags.FLAGS.topology, flags.FLAGS.slices)
    num_classes = tpu_plan.num_classes_of(flags.FLAGS.config, flags.FLAGS.num_classes)
  except (errors.OutputError, tpu_topologies.TopologyError, tpu_plan.PlanError) as e:
    sys.exit(f'Plan error: {e}')
  tpu_topologies.use_tpu_compiler_only(topology)
  try:
    result = tpu_plan.plan(flags.FLAGS.config, topology, num_classes, flags.FLAGS.multi_label)
  except tpu_plan.PlannedError as e:
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
  with interrupts.stopped_quietly():
    app.run(main, flags_parser=parse_flags)

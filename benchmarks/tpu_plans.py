"""The smallest Cloud TPU slices that the repository's presets fit, from `vit_jax.plan`'s compiles:
the rows of docs/tpu_plan.md's table of presets.

  python benchmarks/tpu_plans.py --out=plans.jsonl [--presets=b16-224,...]
      [--generations=v5e,v5p] [--shardings=data,fsdp,fsdp+tensor] [--on=v4-256,v5p-256]
      [--start=v5e-16] [--machine=TEXT]
  python benchmarks/tpu_plans.py --table=plans.jsonl

For each preset (PRESETS), TPU generation and sharding (SHARDINGS) it compiles the preset's
training step with libtpu's compiler for slices of that generation (`tpu_plan.train_step_plan`, as
`python -m vit_jax.plan` does, without the evaluation step) and finds the smallest slice whose
step fits a chip's HBM: it tries the smallest slice, then slices of 2, 4, 8 ... times its place
in the list of slices until one fits, then halves the gap to the smallest that fits (a step needs
no more memory per chip on more chips of the same generation). Every compile appends a JSON line
to --out: the preset, its `python -m vit_jax.plan` command, the plan (or the config error), the
date and the machine. `--table` prints the smallest fitting slice of each search as a markdown
table row. `--on` compiles on the slices named instead of searching; `--start` begins the search
at a slice known to be near (the next smaller slice that does not fit shows it is the smallest).

All rows train in bfloat16, with the presets' unscanned blocks (scanned ones compile faster, but
need other memory, and `cost_analysis` counts their loop's FLOPs once: docs/tpu_plan.md);
fsdp+tensor puts 4 chips (one host's) on the mesh's 'model' axis.
"""
import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from vit_jax import console  # noqa: E402  (after the repository is on the path)
from vit_jax import tpu_topologies  # noqa: E402
from vit_jax.config import checks  # noqa: E402
from vit_jax.training import tpu_plan  # noqa: E402

# Name: (config file, its argument, overrides of the preset), each at its own batch.
PRESETS = {
    'b16-224': ('configs/vit.py', 'b16,imagenet2012', {'pp.crop': 224}),
    'b16-384': ('configs/vit.py', 'b16,imagenet2012', {}),
    'l16-224': ('configs/vit.py', 'l16,imagenet2012', {'pp.crop': 224}),
    'l16-384': ('configs/vit.py', 'l16,imagenet2012', {}),
    'h14-224': ('configs/vit.py', 'h14,imagenet2012', {'pp.crop': 224}),
    'augreg-b16': ('configs/augreg.py', 'B/16,i1k', {}),
    'augreg-l16': ('configs/augreg.py', 'L/16,i1k', {}),
    'h14-224-b4096': ('configs/vit.py', 'h14,imagenet2012', {'pp.crop': 224, 'batch': 4096}),
}
COMMON = {'dtype': 'bfloat16'}
SHARDINGS = {'data': 1, 'fsdp': 1, 'fsdp+tensor': 4}  # Strategy: chips on the 'model' axis.


def load_config(path: str, argument: str, overrides: dict):
  """`get_config(argument)` of the config file at `path` (relative to the repository), with
  `overrides` ({'pp.crop': 224, ...}) set."""
  spec = importlib.util.spec_from_file_location('preset', os.path.join(ROOT, path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(argument)
  for field, value in overrides.items():
    *parents, name = field.split('.')
    node = config
    for parent in parents:
      node = node[parent]
    node[name] = value
  return config


def command(preset: str, topology: str, sharding: str) -> str:
  """The `python -m vit_jax.plan` command of one compile of the sweep."""
  path, argument, overrides = PRESETS[preset]
  fields = {**overrides, **COMMON, 'sharding': sharding, 'mesh.model': SHARDINGS[sharding]}
  return (f'python -m vit_jax.plan --config={path}:{argument} --topology={topology} '
          + ' '.join(f'--config.{field}={value}' for field, value in fields.items()))


def slice_names(generation: str) -> list[str]:
  """The accelerator types of `generation`, smallest first ('v5e-1', 'v5e-4', ...)."""
  kind = tpu_topologies.GENERATIONS[generation]
  return [f'{generation}-{chips * kind.cores_per_chip_in_name}' for chips in sorted(kind.shapes)]


def compile_on(preset: str, topology_name: str, sharding: str, out, machine: str) -> dict:
  """The plan of `preset`'s training step under `sharding` on `topology_name`, appended to `out`
  as a JSON line with the date and `machine`; 'fits' False with the reason (its 'error') where
  the config cannot run there."""
  path, argument, overrides = PRESETS[preset]
  config = load_config(path, argument, {**overrides, **COMMON, 'sharding': sharding,
                                        'mesh.model': SHARDINGS[sharding]})
  topology = tpu_topologies.parse_topology(topology_name)
  record = {'preset': preset, 'sharding': sharding, 'topology': topology_name,
            'command': command(preset, topology_name, sharding),
            'date': datetime.date.today().isoformat(), 'machine': machine}
  try:
    mesh = tpu_plan.topology_mesh(config, topology)
    record['plan'], _ = tpu_plan.train_step_plan(config, mesh, topology,
                                                 tpu_plan.num_classes_of(config, None))
    record['fits'] = record['plan']['fits']
  except checks.ConfigError as e:
    record.update(fits=False, error=str(e))
  out.write(json.dumps(record) + '\n')
  out.flush()
  print(f"{preset} {sharding} {topology_name}: {'fits' if record['fits'] else 'does not fit'}"
        + (f" ({record['plan']['compile_seconds']:.0f} s)" if 'plan' in record else
           f" ({record['error']})"), flush=True)
  return record


def smallest_fitting(preset: str, generation: str, sharding: str, out, machine: str,
                     start: str | None = None) -> dict | None:
  """The record of the smallest slice of `generation` whose step fits (None if none does).

  From the smallest slice (or `start`), galloping up (1, 3, 7, ... places on) to one that fits,
  then bisection between the last that did not and the first that did. A `start` that fits at
  once is followed by the slices below it, one by one, down to one that does not fit.
  """
  names = slice_names(generation)
  fits = lambda i: compile_on(preset, names[i], sharding, out, machine)
  first = names.index(start) if start else 0
  record = fits(first)
  if record['fits']:
    found = record
    for index in range(first - 1, -1, -1):
      record = fits(index)
      if not record['fits']:
        break
      found = record
    return found
  below, step = first, 1
  while True:
    index = min(below + step, len(names) - 1)
    record = fits(index)
    if record['fits']:
      break
    if index == len(names) - 1:
      return None
    below, step = index, step * 2
  above, found = index, record
  while above - below > 1:
    middle = (above + below) // 2
    record = fits(middle)
    if record['fits']:
      above, found = middle, record
    else:
      below = middle
  return found


def table(path: str) -> str:
  """Markdown rows of the smallest fitting slice of each (preset, generation, sharding) in the
  JSON lines file at `path`; '-' where no slice tried fits."""
  records = [json.loads(line) for line in open(path)]
  best = {}
  for record in records:
    key = (record['preset'], record['topology'].split('-')[0], record['sharding'])
    chips = tpu_topologies.parse_topology(record['topology']).chips
    best.setdefault(key, None)
    if record['fits'] and (best[key] is None or chips < best[key][0]):
      best[key] = (chips, record)
  rows = []
  for (preset, generation, sharding), found in best.items():
    if found is None:
      tried = sorted({r['topology'] for r in records if (r['preset'], r['sharding']) ==
                      (preset, sharding) and r['topology'].startswith(generation + '-')},
                     key=lambda name: tpu_topologies.parse_topology(name).chips)
      rows.append(f'| {preset} | {generation} | {sharding} | none of {", ".join(tried)} | - | - '
                  f'| - | - |')
      continue
    record = found[1]
    result, chip = record['plan'], record['plan']['per_chip']
    rows.append(
        f"| {preset} | {generation} | {sharding} | {record['topology']} | "
        f"{console.readable_bytes(chip['total_bytes'])} | "
        f"{result['roofline_images_per_second_per_chip']:.0f} | "
        f"{result['compile_seconds']:.0f} s | `{record['command']}`; {record['machine']}; "
        f"{record['date']} |")
  return '\n'.join(rows)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--out', help='Append a JSON line per compile to this file.')
  parser.add_argument('--presets', default=','.join(PRESETS))
  parser.add_argument('--generations', default='v5e,v5p')
  parser.add_argument('--shardings', default=','.join(SHARDINGS))
  parser.add_argument('--on', help='Compile on these slices (v4-256,v5p-256) instead of '
                      'searching for the smallest.')
  parser.add_argument('--start', help='Begin the search at this slice (of each generation '
                      'searched) instead of the smallest.')
  parser.add_argument('--machine', default=platform.machine(),
                      help='The machine that compiles, as the records name it.')
  parser.add_argument('--table', help='Print the markdown rows of this JSON lines file.')
  args = parser.parse_args()
  if args.table:
    print(table(args.table))
    return
  tpu_topologies.use_tpu_compiler_only(tpu_topologies.parse_topology(slice_names('v5e')[0]))
  with open(args.out, 'a') as out:
    for preset in args.presets.split(','):
      for sharding in args.shardings.split(','):
        if args.on:
          for name in args.on.split(','):
            compile_on(preset, name, sharding, out, args.machine)
        else:
          for generation in args.generations.split(','):
            start = args.start if args.start and args.start.startswith(generation + '-') else None
            smallest_fitting(preset, generation, sharding, out, args.machine, start)


if __name__ == '__main__':
  main()

"""CPU time of XLA:CPU compiling the tests' tiny train step under the harness's compiler options.

    python benchmarks/compile_options.py [--rounds 3] [--per_round 4]

tests/conftest.py compiles the suite's programs with the options of tests/quick_compile.py: tiny
programs compile for longer than they run. This prints, for XLA's defaults and for each of those
options added in turn, the median over rounds of the process CPU-s per compile, and its ratio to
the defaults'.

Each compile is of a program lowered afresh (the tiny config of tests/tiny_config.py at a learning
rate of its own, so that no cache answers), on 4 CPU devices as the tests have them. The option
sets take turns within each round, so that a drift of the machine's load touches all alike.
"""
import argparse
import os
import runpy
import statistics
import time

import jax

from vit_jax.training import fit
from vit_jax.training import setup as train_setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICK_COMPILE = runpy.run_path(os.path.join(ROOT, 'tests', 'quick_compile.py'))['QUICK_COMPILE']


def compiler_option(flag: str) -> tuple[str, bool | int | str]:
  """('xla_name', value) of the XLA flag '--xla_name=value', its value typed as compile() takes
  it: 'true' and 'false' as bools, digits as an int."""
  name, value = flag.removeprefix('--').split('=', 1)
  if value in ('true', 'false'):
    return name, value == 'true'
  return name, int(value) if value.lstrip('-').isdigit() else value


def option_sets() -> dict[str, dict[str, bool | int | str]]:
  """{name: compiler options}: XLA's defaults, then each flag of QUICK_COMPILE added in turn to
  the ones before it."""
  options = dict(map(compiler_option, QUICK_COMPILE))
  names = list(options)
  return {"XLA's defaults": {}, **{f'+ {name}={options[name]}':
                                   {kept: options[kept] for kept in names[:i + 1]}
                                   for i, name in enumerate(names)}}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--per_round', type=int, default=4, help='compiles of each set a round')
  args = parser.parse_args()
  jax.config.update('jax_platforms', 'cpu')  # Not libtpu, where jax[tpu] is installed.
  jax.config.update('jax_num_cpu_devices', 4)
  config = runpy.run_path(os.path.join(ROOT, 'tests', 'tiny_config.py'))['get_config']()
  config.batch = 8
  mesh = train_setup.make_mesh(config, jax.devices()[:4])
  programs = iter(range(1, 10**6))

  def lowered_afresh():
    config.base_lr = 1e-3 * next(programs)
    return fit.lower_train_step(config, mesh, 10)

  lowered_afresh().compile()  # Warm-up: the first compile also loads XLA's passes.
  sets = option_sets()
  seconds = {name: [] for name in sets}
  for _ in range(args.rounds):
    for name, options in sets.items():
      lowered = [lowered_afresh() for _ in range(args.per_round)]
      start = time.process_time()
      for program in lowered:
        program.compile(compiler_options=options)
      seconds[name].append((time.process_time() - start) / args.per_round)
  baseline = statistics.median(seconds["XLA's defaults"])
  width = max(map(len, sets))
  print(f'{"options":{width}} {"CPU-s per compile":>18} {"of the defaults":>16}')
  for name, values in seconds.items():
    median = statistics.median(values)
    print(f'{name:{width}} {median:18.3f} {median / baseline:16.2f}')


if __name__ == '__main__':
  main()

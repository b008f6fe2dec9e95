"""CPU time of XLA:CPU compiling the tests' tiny train step under the harness's compiler options.

    python benchmarks/compile_options.py [--rounds 3] [--per_round 4]

tests/conftest.py compiles the suite's programs with QUICK_COMPILE's options: tiny programs
compile for longer than they run. This prints, for XLA's defaults and for each option added in
turn, the median over rounds of the process CPU-s per compile, and its ratio to the defaults.

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
QUICK = {'xla_backend_optimization_level': 0, 'xla_cpu_use_fusion_emitters': False}
# In turns, each set adds to the one before: the options of tests/conftest.py's QUICK_COMPILE.
OPTION_SETS = {
    "XLA's defaults": {},
    'LLVM level 0, elemental emitters': QUICK,
    '+ one LLVM module (no parallel codegen)': {**QUICK, 'xla_cpu_parallel_codegen_split_count': 1},
}


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
  seconds = {name: [] for name in OPTION_SETS}
  for _ in range(args.rounds):
    for name, options in OPTION_SETS.items():
      lowered = [lowered_afresh() for _ in range(args.per_round)]
      start = time.process_time()
      for program in lowered:
        program.compile(compiler_options=options)
      seconds[name].append((time.process_time() - start) / args.per_round)
  baseline = statistics.median(seconds["XLA's defaults"])
  print(f'{"options":42} {"CPU-s per compile":>18} {"of the defaults":>16}')
  for name, values in seconds.items():
    median = statistics.median(values)
    print(f'{name:42} {median:18.3f} {median / baseline:16.2f}')


if __name__ == '__main__':
  main()

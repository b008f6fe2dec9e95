"""Step time and memory of a training step under per-parameter learning rates and freezing.

Builds the training step of vit_jax.main (make_optimizer, create_train_state, jit_train_step on
this machine's devices) for one model and times it under each VARIANT: the plain step, the step
with `config.layer_decay` (a multiplier per parameter group) and with `config.lr_mults`, and the
steps with frozen parameters (`config.frozen`): a linear probe (everything but the head frozen)
and the first half of the blocks frozen. The variants run in turns, one step each per round, so
that a change of the machine's load during the run touches all of them alike.

Prints per variant: the median step time (s) and its ratio to the plain step's, and from XLA's
`memory_analysis()` of the compiled step the temporaries and the arguments (train state and
batch) in MiB.

  python benchmarks/param_groups.py                              # ViT-S_16, 224 px, batch 8
  python benchmarks/param_groups.py --model=ViT-B_16 --batch=16 --rounds=10
"""
import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import hardware
from vit_jax.config import defaults
from vit_jax.models import registry
from vit_jax.training import setup as train_setup
from vit_jax.training import step as train_step

MIB = 2**20


def variants(num_layers: int) -> dict[str, dict]:
  """Name -> the config fields it sets, for a model of `num_layers` blocks."""
  first_half = '|'.join(str(i) for i in range(num_layers // 2))
  return {
      'plain': {},
      'layer_decay=0.75': {'layer_decay': 0.75},
      'lr_mults (head x10)': {'lr_mults': (('^head/', 10.0),)},
      'frozen: all but the head': {'frozen': '^(?!head/)'},
      f'frozen: embeddings and blocks 0-{num_layers // 2 - 1}':
          {'frozen': rf'^(embedding|cls|Transformer/posembed_input|'
                     rf'Transformer/encoderblock_({first_half})/)'},
  }


def step_config(model_name: str, batch: int, fields: dict):
  """The training defaults of `model_name` at global batch `batch`, unscanned blocks (so that
  single blocks can be frozen), with `fields` set."""
  config = defaults.with_model(defaults.training_defaults(), model_name)
  config.batch = batch
  config.scan_layers = False
  for name, value in fields.items():
    config[name] = value
  return config


def build(config, image_size: int, num_classes: int):
  """(jitted step, train state, batch on the devices, memory_analysis of the compiled step)."""
  model = registry.get_model(config.model, num_classes=num_classes, scan_layers=False,
                             dtype=jnp.dtype(config.dtype))
  optimizer = train_step.make_optimizer(config)
  mesh = train_setup.make_mesh(config)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh, image_size)
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  rng = np.random.default_rng(0)
  batch = jax.device_put(
      {'image': rng.uniform(-1, 1, (config.batch, image_size, image_size, 3)).astype(np.float32),
       'label': rng.integers(0, num_classes, config.batch).astype(np.int32)},
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data')))
  memory = step.lower(state, batch).compile().memory_analysis()
  return step, state, batch, memory


def main():
  hardware.skip_absent_tpu()  # No libtpu start-up (and its warnings) on a host without TPUs.
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model', default='ViT-S_16')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--image_size', type=int, default=224)
  parser.add_argument('--num_classes', type=int, default=1000)
  parser.add_argument('--rounds', type=int, default=5, help='Timed steps of each variant.')
  args = parser.parse_args()
  hardware.use_one_device_per_core()
  hardware.keep_freed_host_memory()

  num_layers = registry.get_model_config(args.model).transformer.num_layers
  built = {}
  for name, fields in variants(num_layers).items():
    config = step_config(args.model, args.batch, fields)
    built[name] = build(config, args.image_size, args.num_classes)
  times = {name: [] for name in built}
  for _ in range(args.rounds + 1):  # The first round warms up and is not counted.
    for name, (step, state, batch, _) in built.items():
      start = time.perf_counter()
      state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      times[name].append(time.perf_counter() - start)
      built[name] = (step, state, batch, built[name][3])
  devices = jax.devices()
  print(f'{args.model}, batch {args.batch}, {args.image_size} px, float32, {len(devices)} '
        f'{devices[0].device_kind} devices, median of {args.rounds} steps')
  print(f'{"variant":<40} {"step s":>7} {"x plain":>8} {"temp MiB":>9} {"args MiB":>9}')
  plain = statistics.median(times['plain'][1:])
  for name, (_, _, _, memory) in built.items():
    median = statistics.median(times[name][1:])
    print(f'{name:<40} {median:>7.3f} {median / plain:>8.2f} '
          f'{memory.temp_size_in_bytes / MIB:>9.1f} {memory.argument_size_in_bytes / MIB:>9.1f}')


if __name__ == '__main__':
  main()

"""Step time and memory of a training step under per-parameter learning rates and freezing.

Builds the training step of vit_jax.main on this machine's devices (benchmarks/train_steps.py)
for one model and times it under each VARIANT: the plain step, the step
with `config.layer_decay` (a multiplier per parameter group) and with `config.lr_mults`, and the
steps with frozen parameters (`config.frozen`): a linear probe (everything but the head frozen)
and the first half of the blocks frozen. The variants run in turns, one step each per round.

Prints per variant: the median step time (s) and its ratio to the plain step's, and from XLA's
`memory_analysis()` of the compiled step the temporaries and the arguments (train state and
batch) in MiB.

  python benchmarks/param_groups.py                              # ViT-S_16, 224 px, batch 8
  python benchmarks/param_groups.py --model=ViT-B_16 --batch=16 --rounds=10
"""
import argparse

from vit_jax import hardware
from vit_jax.config import defaults
from vit_jax.models import registry

import train_steps  # benchmarks/train_steps.py, beside this file.


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


def step_config(model_name: str, batch: int, image_size: int, fields: dict):
  """The training defaults of `model_name` at global batch `batch` and `image_size` pixels,
  unscanned blocks (so that single blocks can be frozen), with `fields` set."""
  config = defaults.with_model(defaults.training_defaults(), model_name)
  config.batch = batch
  config.pp.crop = image_size
  config.scan_layers = False
  for name, value in fields.items():
    config[name] = value
  return config


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
  built = {name: train_steps.build(
      step_config(args.model, args.batch, args.image_size, fields), args.num_classes)
           for name, fields in variants(num_layers).items()}
  medians = train_steps.median_step_seconds(built, args.rounds)
  print(f'{args.model}, batch {args.batch}, {args.image_size} px, float32, '
        f'{train_steps.devices_line()}, median of {args.rounds} steps')
  print(f'{"variant":<40} {"step s":>7} {"x plain":>8} {"temp MiB":>9} {"args MiB":>9}')
  for name, (_, _, _, memory) in built.items():
    print(f'{name:<40} {medians[name]:>7.3f} {medians[name] / medians["plain"]:>8.2f} '
          f'{memory.temp_size_in_bytes / train_steps.MIB:>9.1f} '
          f'{memory.argument_size_in_bytes / train_steps.MIB:>9.1f}')


if __name__ == '__main__':
  main()

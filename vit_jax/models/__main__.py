"""`python -m vit_jax.models [--image_size 224] [--num_classes 1000]`: the listed models with
their parameter counts and GFLOPs per image, then the default run's model.
"""

import ml_collections

from vit_jax import console
from vit_jax.config import defaults as default_config
from vit_jax.models import flops
from vit_jax.models import registry
from vit_jax.models.registry import MODEL_CONFIGS


def main():
  parser = console.command_parser('models', description=__doc__)
  parser.add_argument('--image_size', type=int, default=224)
  parser.add_argument('--num_classes', type=int, default=1000)
  args = parser.parse_args()
  print(f'{"model":<18} {"params":>13} {"GFLOPs/image":>13}   at {args.image_size} px, '
        f'{args.num_classes} classes')
  for name, config in listed_model_configs():
    model = registry.get_model(config, num_classes=args.num_classes)
    size = args.image_size
    print(f'{name:<18} {registry.count_params(model, size):>13,} '
          f'{flops.gflops_per_image(model, size):>13.2f}', flush=True)
  print(f'The last row, {default_config.get_config().model_name}, is the model of the default '
        'run, python -m vit_jax.main (vit_jax/config/defaults.py; it trains at 28 px).')


def listed_model_configs() -> list[tuple[str, ml_collections.ConfigDict]]:
  """(name, model config) of each of LISTED_MODELS, then of the default run's model (a model of
  its own, not a registry name)."""
  default = default_config.get_config()
  return [(name, MODEL_CONFIGS[name]) for name in registry.LISTED_MODELS] + [
      (default.model_name, default.model)]


if __name__ == '__main__':
  console.run(main)

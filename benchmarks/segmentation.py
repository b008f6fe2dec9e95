"""Step time of segmentation against classification, same model, resolution and batch.

Builds the training step of vit_jax.main on this machine's devices (benchmarks/train_steps.py)
twice: under `config.objective='supervised'` (the
classifier's head on the class token, a label per image) and `'segmentation'` (the linear head on
every patch token, its logits upsampled bilinearly to the pixels, a label per pixel;
vit_jax/tasks/segmentation.py). The two steps run in turns, in the order A B B A each pair of
rounds.

Prints per objective the median step time (s) and its ratio to the classification step's, and
XLA's temporaries of the compiled step in MiB.

  python benchmarks/segmentation.py                       # the default run's ViT, 56 px, batch 32
  python benchmarks/segmentation.py --model=ViT-S_16 --image_size=224 --batch=8
  python benchmarks/segmentation.py --window=28   # segmentation in 28 px tiles (config.seg.window)
  python benchmarks/segmentation.py --classifier=gap   # a classifier that reads every token
"""
import argparse

from vit_jax import hardware
from vit_jax.config import defaults

import train_steps  # benchmarks/train_steps.py, beside this file.

OBJECTIVES = ('supervised', 'segmentation')
DEFAULT_MODEL = 'default'  # --model: the default run's ViT-mini_7 (vit_jax.config.defaults).


def step_config(model_name: str, objective: str, batch: int, image_size: int,
                window: int | None = None, classifier: str | None = None):
  """The default run's config (for DEFAULT_MODEL) or the training defaults of `model_name`,
  with `objective`, global batch `batch`, `image_size` pixels, config.seg.window `window` and
  the model's `classifier` (None: its own)."""
  if model_name == DEFAULT_MODEL:
    config = defaults.get_config()
  else:
    config = defaults.with_model(defaults.training_defaults(), model_name)
  config.update(objective=objective, batch=batch, label_smoothing=0.0)
  config.pp.crop = image_size
  config.seg.window = window
  if classifier:
    config.model.classifier = classifier
  return config


def main():
  hardware.skip_absent_tpu()  # No libtpu start-up (and its warnings) on a host without TPUs.
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model', default=DEFAULT_MODEL,
                      help=f'A registry name, or {DEFAULT_MODEL!r}: the default run\'s ViT.')
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--image_size', type=int, default=56)
  parser.add_argument('--num_classes', type=int, default=11)
  parser.add_argument('--rounds', type=int, default=8, help='Timed steps of each objective.')
  parser.add_argument('--window', type=int, default=None,
                      help='Segmentation: encode tiles of this many pixels apart '
                           '(config.seg.window); default: the whole image.')
  parser.add_argument('--classifier', default=None,
                      help="The model's classifier under both objectives, e.g. 'gap': the "
                           "classification step then computes every token's last block, as "
                           "segmentation does; default: the model's own ('token').")
  args = parser.parse_args()
  hardware.use_one_device_per_core()
  hardware.keep_freed_host_memory()

  built = {objective: train_steps.build(
      step_config(args.model, objective, args.batch, args.image_size, args.window,
                  args.classifier), args.num_classes)
           for objective in OBJECTIVES}
  medians = train_steps.median_step_seconds(built, args.rounds)
  variant = f', segmentation in {args.window} px tiles' if args.window else ''
  variant += f', classifier {args.classifier}' if args.classifier else ''
  print(f'{args.model}, batch {args.batch}, {args.image_size} px{variant}, {args.num_classes} '
        f'classes, float32, {train_steps.devices_line()}, median of {args.rounds} steps')
  print(f'{"objective":<14} {"step s":>8} {"x classification":>17} {"temp MiB":>9}')
  for objective in OBJECTIVES:
    print(f'{objective:<14} {medians[objective]:>8.4f} '
          f'{medians[objective] / medians["supervised"]:>17.3f} '
          f'{built[objective][3].temp_size_in_bytes / train_steps.MIB:>9.1f}')


if __name__ == '__main__':
  main()

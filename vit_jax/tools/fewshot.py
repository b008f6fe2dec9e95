"""Few-shot linear accuracy of a trained or published model (`linear_probe` has the method).

    python -m vit_jax.fewshot --checkpoint WORKDIR_OR_FILE.npz [--model NAME] \\
        [--dataset fashion_mnist_embedded] [--shots 1,5,10,25] [--out results.json]

Without --dataset it evaluates a training workdir on the run's own dataset (its config.json
names it), and any other checkpoint on the embedded Fashion-MNIST; images are framed as the run
that made the model evaluated them (its config.pp.resize, which model.npz records), unless
--resize says otherwise.

The representation of k training images per class is regressed onto the classes by
L2-regularised least squares; each seed draws other shots, and a held-out part of the training
split chooses the L2. It prints the mean accuracy and its spread over the seeds for each k.
"""
import argparse
import json
import sys
from typing import Optional, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import ml_collections

from vit_jax import console
from vit_jax import errors
from vit_jax import hardware
from vit_jax.checkpoints import runs
from vit_jax.config import defaults
from vit_jax.evaluators import linear_probe

DEFAULT_SHOTS = '1,5,10,25'


def dataset_config(args: argparse.Namespace, image_size) -> ml_collections.ConfigDict:
  """The training defaults (the data source reads several) with the dataset, splits and
  preprocessing of the command line and the model's image size."""
  config = defaults.training_defaults()
  config.update(dict(dataset=args.dataset, train_split=args.train_split,
                     test_split=args.test_split, batch_eval=args.batch,
                     tfds_data_dir=args.tfds_data_dir))
  config.pp.update(dict(crop=image_size, resize=args.resize))
  return config


def run_dataset(args: argparse.Namespace) -> tuple[str, Optional[str]]:
  """(dataset, tfds_data_dir) to evaluate on: --dataset and --tfds_data_dir, where given; else
  those of the training run whose workdir --checkpoint names; else the default run's dataset."""
  saved = runs.saved_run_config(args.checkpoint)
  dataset = args.dataset or saved.get('dataset') or defaults.training_defaults().dataset
  another = args.dataset and args.dataset != saved.get('dataset')
  return dataset, args.tfds_data_dir or (None if another else saved.get('tfds_data_dir'))


def default_shots(config: ml_collections.ConfigDict, holdout: int) -> list[int]:
  """The k of DEFAULT_SHOTS for which each class of config.train_split has k shots and `holdout`
  further images, with a line on stderr for the others; a ValueError where none fit."""
  smallest = int(linear_probe.class_sizes(config, config.train_split).min())
  shots, why_not = linear_probe.shots_that_fit(parse_shots(DEFAULT_SHOTS), smallest, holdout,
                                               config.train_split)
  if why_not:
    print(f'Skipping {why_not}', file=sys.stderr)
  if not shots:
    raise ValueError(f'{config.dataset} has too few training images of a class ({smallest}) for '
                     f'1-shot with --holdout={holdout}: give a smaller --holdout.')
  return list(shots)


def table(results: dict, shots: Sequence[int]) -> str:
  """One line per k: mean and spread of the accuracy in percent, and the chosen L2s."""
  lines = [f'{"shots":>5}  {"accuracy %":>16}  L2 chosen per seed']
  for k in shots:
    r = results[k]
    lines.append(f'{k:>5}  {100 * r["mean"]:7.2f} +- {100 * r["std"]:5.2f}  '
                 + ' '.join(f'{l2:g}' for l2 in r['l2']))
  return '\n'.join(lines)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = console.command_parser('fewshot', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoint', required=True, help='A .npz checkpoint, a training workdir, '
                      'or a published name (augreg:B/16; python -m vit_jax.checkpoint --list).')
  parser.add_argument('--model', help='Registry model name; required with an .npz checkpoint.')
  parser.add_argument('--dataset', help='fashion_mnist_embedded, an image folder or a tfds name '
                      "(default: a training workdir's own dataset, else fashion_mnist_embedded).")
  parser.add_argument('--shots', help=f'Comma-separated k of k-shot (default: those of '
                      f'{DEFAULT_SHOTS} for which each class has enough training images).')
  parser.add_argument('--seeds', type=int, default=5, help='Shot choices averaged over.')
  parser.add_argument('--holdout', type=int, default=linear_probe.HOLDOUT,
                      help='Training images per class, not among the shots, that choose the L2.')
  parser.add_argument('--train_split', default='train')
  parser.add_argument('--test_split', default='test')
  parser.add_argument('--resize', type=int,
                      help='Resize the short side to this, then crop the centre (default: the '
                      "config.pp.resize of the run whose model it is, which its model.npz "
                      "records; else resize straight to the model's image size).")
  parser.add_argument('--batch', type=int, default=256,
                      help='Images per feature batch, a multiple of the device count.')
  parser.add_argument('--tfds_data_dir', help='Where tfds datasets are prepared.')
  parser.add_argument('--out', help='Write the results as JSON to this new file.')
  return parser.parse_args(argv)


def parse_shots(text: str) -> list[int]:
  try:
    shots = [int(k) for k in text.split(',')]
  except ValueError:
    shots = []
  if not shots or min(shots) < 1:
    raise ValueError(f'--shots={text!r}: give positive integers separated by commas, e.g. 1,5,10.')
  return shots


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Prints the table (and writes --out); returns the exit status, 1 for bad input."""
  args = parse_args(argv)
  hardware.use_one_device_per_core(lambda count: args.batch % count == 0)
  try:
    if args.out:
      errors.prepare_new_output(args.out)
    shots = parse_shots(args.shots) if args.shots else None
    if args.batch % jax.device_count():
      raise ValueError(f'--batch={args.batch} is not divisible by the {jax.device_count()} '
                       f'devices: make it a multiple of {jax.device_count()}.')
    args.dataset, args.tfds_data_dir = run_dataset(args)
    model, params = runs.load_model(args.checkpoint, args.model)
    image_size = runs.trained_image_size(args.checkpoint, params, model)
    args.resize = args.resize or runs.saved_framing(args.checkpoint, image_size, image_size)
    mesh = linear_probe.default_mesh()
    params = jax.device_put(params, NamedSharding(mesh, P()))
    config = dataset_config(args, image_size)
    shots = shots or default_shots(config, args.holdout)
    results = linear_probe.evaluate(model, params, config, shots, range(args.seeds), args.holdout,
                                    mesh)
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  seeds = f'{args.seeds} seed{"s" if args.seeds > 1 else ""}'
  print(f'{args.dataset} few-shot linear accuracy over {seeds}, '
        f'{results["num_test"]} test images ({args.test_split}):')
  print(table(results, shots))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'checkpoint': args.checkpoint, 'dataset': args.dataset, **results}, f, indent=1)
  return 0


if __name__ == '__main__':
  hardware.keep_freed_host_memory()
  console.run(main)

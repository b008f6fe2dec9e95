"""Few-shot linear evaluation of a frozen model, the ViT paper's yardstick (Section 4.1, "Metrics").

    python -m vit_jax.fewshot --checkpoint WORKDIR_OR_FILE.npz [--model NAME] \\
        --dataset fashion_mnist_embedded --shots 1,5,10,25 [--out results.json]

The representation (`VisionTransformer.features`) of k training images per class is regressed onto
{-1, 1}^K targets by L2-regularised least squares with an unregularised bias, solved in closed
form on the device; a test image's class is the argmax of its K regressed scores.

For each seed the images of every class of the training split are drawn in a seeded random order:
the first k are the k shots (so shots nest, the 1-shot image is among the 5 shots), and the next
`holdout` choose the regularisation from `L2_GRID` by their accuracy: the test split is never
looked at before the final score. Results are the mean and the standard deviation over seeds.

Memory: the training side holds the features of the drawn images only, at most
seeds x classes x (max shots + holdout) rows, never those of the whole split (its labels are read
once); the regression keeps sums of X^T X and X^T Y; the test split streams through the device
and leaves only counts of correct predictions.
"""
import argparse
import json
import sys
import time
from typing import Iterator, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import tensorflow as tf

from vit_jax import checkpoint
from vit_jax import config as defaults
from vit_jax import hardware
from vit_jax import input_pipeline
from vit_jax import input_pipeline_sources as sources

L2_GRID = tuple(2.0**i for i in range(-6, 14, 2))  # Ridge penalties tried per seed and k.
HOLDOUT = 10  # Default held-out training images per class that choose the L2.
HIGHEST = jax.lax.Precision.HIGHEST


# Closed-form regression.


class Statistics(NamedTuple):
  """Sums over the training rows, of features x (D,) shifted by a fixed vector, and targets y (K,).

  count: (); sum_x: (D,); sum_y: (K,); xtx: (D, D), sum of x x^T; xty: (D, K), sum of x y^T.
  """
  count: jax.Array
  sum_x: jax.Array
  sum_y: jax.Array
  xtx: jax.Array
  xty: jax.Array


def targets(labels: jax.Array, num_classes: int) -> jax.Array:
  """int (N,) -> float32 (N, K): +1 at the label, -1 elsewhere."""
  return 2 * jax.nn.one_hot(labels, num_classes) - 1


def zero_statistics(dim: int, num_classes: int) -> Statistics:
  return Statistics(jnp.zeros(()), jnp.zeros(dim), jnp.zeros(num_classes),
                    jnp.zeros((dim, dim)), jnp.zeros((dim, num_classes)))


@jax.jit
def accumulate(stats: Statistics, features: jax.Array, y: jax.Array,
               weights: jax.Array) -> Statistics:
  """Adds the rows of features (B, D) and targets y (B, K) with weight (B,) 1 (or 0: padding)."""
  wx = features * weights[:, None]
  return Statistics(stats.count + weights.sum(), stats.sum_x + wx.sum(0),
                    stats.sum_y + (y * weights[:, None]).sum(0),
                    stats.xtx + jnp.matmul(wx.T, features, precision=HIGHEST),
                    stats.xty + jnp.matmul(wx.T, y, precision=HIGHEST))


@jax.jit
def solve(stats: Statistics, l2: jax.Array) -> tuple[jax.Array, jax.Array]:
  """argmin_{W,b} sum ||x W + b - y||^2 + l2 ||W||_F^2 over the rows summed in `stats`.

  Returns W (D, K) and b (K,) for the shifted features the sums were taken of.
  """
  mean_x, mean_y = stats.sum_x / stats.count, stats.sum_y / stats.count
  covariance = stats.xtx - stats.count * jnp.outer(mean_x, mean_x)
  cross = stats.xty - stats.count * jnp.outer(mean_x, mean_y)
  w = jax.scipy.linalg.solve(covariance + l2 * jnp.eye(len(mean_x)), cross, assume_a='pos')
  return w, mean_y - jnp.matmul(mean_x, w, precision=HIGHEST)


def statistics(features: np.ndarray, labels: np.ndarray, num_classes: int,
               batch: int = 4096) -> Statistics:
  """The sums over features (N, D) and targets(labels), taken `batch` rows at a time."""
  stats = zero_statistics(features.shape[1], num_classes)
  for start in range(0, len(labels), batch):
    rows = slice(start, start + batch)
    stats = accumulate(stats, jnp.asarray(features[rows]),
                       targets(jnp.asarray(labels[rows]), num_classes),
                       jnp.ones(len(labels[rows])))
  return stats


def predict(features: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
  """Classes (B,) of features (B, D) under the regression W (D, K), b (K,)."""
  return jnp.argmax(jnp.matmul(features, w, precision=HIGHEST) + b, axis=-1)


def probe(shots: tuple[np.ndarray, np.ndarray], holdout: tuple[np.ndarray, np.ndarray],
          num_classes: int, l2_grid: Sequence[float] = L2_GRID):
  """The regression of (features, labels) `shots` whose L2 from `l2_grid` is most accurate on
  `holdout` (the smallest such L2 on ties): (W (D, K), b (K,), l2, holdout accuracy)."""
  stats, best = statistics(*shots, num_classes), None
  for l2 in l2_grid:
    w, b = solve(stats, l2)
    accuracy = float(jnp.mean(predict(jnp.asarray(holdout[0]), w, b) == holdout[1]))
    if best is None or accuracy > best[3]:
      best = (w, b, l2, accuracy)
  return best


# Choosing shots.


def choose_shots(labels: np.ndarray, num_classes: int, shots: int, holdout: int,
                 seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Positions in `labels` of `shots` and of `holdout` further images of each class.

  Each class's positions are drawn in an order fixed by (seed, class); the first `shots` are the
  shots (so the first k of them are the k-shot choice), the next `holdout` the held-out images.

  Returns:
    int (num_classes, shots) and int (num_classes, holdout), disjoint.
  """
  counts = np.bincount(labels, minlength=num_classes)
  if counts.min() < shots + holdout:
    short = [c for c in range(num_classes) if counts[c] < shots + holdout]
    raise ValueError(
        f'Classes {short[:10]} have fewer than {shots} shots + {holdout} held-out images in the '
        f'training split (smallest: {counts.min()}): use fewer shots, a smaller --holdout, or a '
        'larger training split.')
  draws = [np.random.default_rng([seed, c]).permutation(np.flatnonzero(labels == c))
           for c in range(num_classes)]
  return (np.stack([d[:shots] for d in draws]),
          np.stack([d[shots:shots + holdout] for d in draws]))


# Features.


def split_labels(config, split: str) -> np.ndarray:
  """int64 (N,): the labels of `split` of config.dataset in stored order, images undecoded."""
  shard = sources.get_source(config).shard(split, 0, 1)

  def label(record):
    return record['label']

  labels = shard.epoch(None).map(label).batch(65536)
  return np.concatenate(list(labels.as_numpy_iterator()))


def selected_batches(config, split: str, positions: np.ndarray) -> Iterator[np.ndarray]:
  """Preprocessed images at the sorted `positions` of `split`, in batches of config.batch_eval:
  float32 (b, crop, crop, 3) with b <= batch_eval."""
  shard = sources.get_source(config).shard(split, 0, 1)
  wanted = np.zeros(shard.num_examples, bool)
  wanted[positions] = True
  wanted = tf.constant(wanted)

  def is_wanted(position, record):
    del record
    return tf.gather(wanted, position)

  def preprocess(position, record):
    del position
    return input_pipeline.preprocess_eval(shard.decode(record['image']), config.pp)

  images = shard.epoch(None).enumerate().filter(is_wanted).map(
      preprocess, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return images.batch(config.batch_eval).prefetch(2).as_numpy_iterator()


def feature_function(model, params, mesh: jax.sharding.Mesh):
  """images (B, H, W, 3) in [-1, 1], B a multiple of the mesh's size -> float32 features (B, D),
  jitted with the batch split along the mesh's `data` axis and `params` replicated."""
  params = jax.device_put(params, NamedSharding(mesh, P()))
  apply = jax.jit(lambda p, x: model.apply({'params': p}, x, method='features'),
                  in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))))
  return lambda images: apply(params, images)


def features_of(features_fn, batches: Iterator[np.ndarray], batch: int) -> np.ndarray:
  """Features (N, D) of all the images of `batches`, each padded to `batch` images (one shape
  to compile)."""
  out = []
  for images in batches:
    pad = batch - len(images)
    padded = np.concatenate([images, np.zeros((pad,) + images.shape[1:], images.dtype)])
    out.append(np.asarray(features_fn(padded))[:len(images)])
  return np.concatenate(out)


def count_correct(features_fn, classifiers: tuple[jax.Array, jax.Array], config,
                 mesh: jax.sharding.Mesh) -> tuple[np.ndarray, int]:
  """Correct predictions on config.test_split of each of C classifiers W (C, D, K), b (C, K)
  of the features, and the number of test images: ((C,), N)."""
  @jax.jit
  def count(correct, features, labels, mask, w, b):
    scores = jnp.einsum('nd,cdk->cnk', features, w, precision=HIGHEST) + b[:, None]
    return correct + jnp.sum((jnp.argmax(scores, -1) == labels) * mask, axis=1)

  correct, total = jnp.zeros(len(classifiers[0])), 0.0
  for batch in input_pipeline.get_eval_iterator(config, mesh):
    correct = count(correct, features_fn(batch['image']), batch['label'], batch['mask'],
                    *classifiers)
    total += batch['mask'].sum()
  return np.asarray(correct), int(total)


# Evaluation.


def check_model(model) -> None:
  """Raises ValueError unless `model` gives one feature vector per image."""
  if model.classifier not in ('token', 'gap'):
    raise ValueError(f'classifier={model.classifier!r} gives features per token; few-shot '
                     "evaluation needs one vector per image: a 'token' or 'gap' model.")


def evaluate(model, params, config, shots: Sequence[int], seeds: Sequence[int],
             holdout: int, mesh: Optional[jax.sharding.Mesh] = None) -> dict:
  """Few-shot linear accuracy of `model` on config.dataset, for each k of `shots`.

  Args:
    model, params: a VisionTransformer and its parameters.
    config: dataset settings: `dataset`, `train_split`, `test_split`, `pp` (the evaluation
      preprocessing), `batch_eval` (a multiple of the device count) and the source options of
      vit_jax.input_pipeline_sources (`tfds_data_dir`, ...).
    shots: the k of k-shot; seeds: one shot choice per seed; holdout: held-out images per class.
    mesh: a mesh with a 'data' axis; default: all devices.
  Returns:
    {k: {'mean': accuracy in [0, 1], 'std': over seeds, 'accuracy': per seed, 'l2': per seed,
    'holdout_accuracy': per seed}}, and 'num_test', 'seconds_train_features',
    'seconds_test' (the test pass: features and scores).
  """
  check_model(model)
  mesh = mesh or jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  features_fn = feature_function(model, params, mesh)
  labels = split_labels(config, config.train_split)
  num_classes = len(sources.get_source(config).label_names)
  draws = [choose_shots(labels, num_classes, max(shots), holdout, seed) for seed in seeds]

  start = time.perf_counter()
  positions = np.unique(np.concatenate([a.ravel() for draw in draws for a in draw]))
  features = features_of(features_fn, selected_batches(config, config.train_split, positions),
                         config.batch_eval)
  shift = features.mean(0)  # Keeps float32 sums of x x^T well conditioned.
  features -= shift
  rows = lambda chosen: np.searchsorted(positions, chosen.ravel())  # Positions -> rows.
  seconds_train_features = time.perf_counter() - start

  results, classifiers = {}, []
  for k in shots:
    results[k] = {'accuracy': [], 'l2': [], 'holdout_accuracy': []}
    for shot_positions, holdout_positions in draws:
      train_rows, holdout_rows = rows(shot_positions[:, :k]), rows(holdout_positions)
      w, b, l2, holdout_accuracy = probe(
          (features[train_rows], labels[positions[train_rows]]),
          (features[holdout_rows], labels[positions[holdout_rows]]), num_classes)
      classifiers.append((w, b - jnp.matmul(shift, w, precision=HIGHEST)))
      results[k]['l2'].append(l2)
      results[k]['holdout_accuracy'].append(holdout_accuracy)

  start = time.perf_counter()
  correct, num_test = count_correct(
      features_fn, tuple(jnp.stack(c) for c in zip(*classifiers)), config, mesh)
  accuracy = iter(correct / num_test)
  for k in shots:
    results[k]['accuracy'] = [float(next(accuracy)) for _ in seeds]
    results[k].update(mean=float(np.mean(results[k]['accuracy'])),
                      std=float(np.std(results[k]['accuracy'])))
  return {**results, 'num_test': num_test, 'seconds_train_features': seconds_train_features,
          'seconds_test': time.perf_counter() - start}


# Command line.


def dataset_config(args: argparse.Namespace, image_size: int) -> ml_collections.ConfigDict:
  """The training defaults (the data source reads several) with the dataset, splits and
  preprocessing of the command line and the model's image size."""
  config = defaults.training_defaults()
  config.update(dict(dataset=args.dataset, train_split=args.train_split,
                     test_split=args.test_split, batch_eval=args.batch,
                     tfds_data_dir=args.tfds_data_dir))
  config.pp.update(dict(crop=image_size, resize=args.resize))
  return config


def table(results: dict, shots: Sequence[int]) -> str:
  """One line per k: mean and spread of the accuracy in percent, and the chosen L2s."""
  lines = [f'{"shots":>5}  {"accuracy %":>16}  L2 chosen per seed']
  for k in shots:
    r = results[k]
    lines.append(f'{k:>5}  {100 * r["mean"]:7.2f} +- {100 * r["std"]:5.2f}  '
                 + ' '.join(f'{l2:g}' for l2 in r['l2']))
  return '\n'.join(lines)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoint', required=True,
                      help='A .npz checkpoint or a training workdir.')
  parser.add_argument('--model', help='Registry model name; required with an .npz checkpoint.')
  parser.add_argument('--dataset', default=input_pipeline.EMBEDDED_DATASET,
                      help='fashion_mnist_embedded, an image folder or a tfds name.')
  parser.add_argument('--shots', default='1,5,10,25', help='Comma-separated k of k-shot.')
  parser.add_argument('--seeds', type=int, default=5, help='Shot choices averaged over.')
  parser.add_argument('--holdout', type=int, default=HOLDOUT,
                      help='Training images per class, not among the shots, that choose the L2.')
  parser.add_argument('--train_split', default='train')
  parser.add_argument('--test_split', default='test')
  parser.add_argument('--resize', type=int,
                      help='Resize the short side to this, then crop the centre (default: '
                      "resize straight to the model's image size).")
  parser.add_argument('--batch', type=int, default=256,
                      help='Images per feature batch, a multiple of the device count.')
  parser.add_argument('--tfds_data_dir', help='Where tfds datasets are prepared.')
  parser.add_argument('--out', help='Write the results as JSON to this file.')
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
  """Prints the table (and writes --out); returns the exit status, 2 for bad input."""
  args = parse_args(argv)
  hardware.use_one_device_per_core(lambda count: args.batch % count == 0)
  try:
    shots = parse_shots(args.shots)
    if args.batch % jax.device_count():
      raise ValueError(f'--batch={args.batch} is not divisible by the {jax.device_count()} '
                       f'devices: make it a multiple of {jax.device_count()}.')
    model, params = checkpoint.load_model(args.checkpoint, args.model)
    image_size = checkpoint.native_image_size(params, model)
    results = evaluate(model, params, dataset_config(args, image_size), shots,
                       range(args.seeds), args.holdout)
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(f'{args.dataset} few-shot linear accuracy over {args.seeds} seeds, '
        f'{results["num_test"]} test images ({args.test_split}):')
  print(table(results, shots))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump({'checkpoint': args.checkpoint, 'dataset': args.dataset, **results}, f, indent=1)
  return 0


if __name__ == '__main__':
  hardware.keep_freed_host_memory()
  sys.exit(main())

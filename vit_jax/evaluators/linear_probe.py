"""Few-shot linear evaluation of a frozen model, the ViT paper's yardstick (Section 4.1, "Metrics").

`evaluate` runs it in training (evaluators/fewshot.py) and in `python -m vit_jax.fewshot`
(tools/fewshot.py).

The representation (`VisionTransformer.features`) of k training images per class is regressed onto
{-1, 1}^K targets by L2-regularised least squares with an unregularised bias, solved in closed
form on the device; a test image's class is the argmax of its K regressed scores.

For each seed the images of every class of the training split are drawn in a seeded random order:
the first k are the k shots (so shots nest, the 1-shot image is among the 5 shots), and the next
`holdout` choose the regularisation from `L2_GRID` by their accuracy: the test split is never
looked at before the final score. Results are the mean and the standard deviation over seeds.

Memory: the training side holds the features of the drawn images only, at most
seeds x classes x (max shots + holdout) rows, on the devices and split across them, never those
of the whole split (its labels are read once); the regressions keep sums of X^T X and X^T Y; the
test split streams through the devices and leaves only counts of correct predictions.

Several processes (JAX's multi-process runtime) each read their share of the images; the sums
reduce across processes inside the jitted computations, and every process gets the same results.
"""
import functools
import time
from typing import Iterator, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

from vit_jax import hardware
from vit_jax.models import blank

# TensorFlow, and the input pipeline that imports it, are imported where they are used: the
# command line sets up its console (vit_jax.console.run) before TensorFlow loads.

L2_GRID = tuple(2.0**i for i in range(-6, 14, 2))  # Ridge penalties tried per seed and k.
HOLDOUT = 10  # Default held-out training images per class that choose the L2.
HIGHEST = jax.lax.Precision.HIGHEST


# Closed-form regression.


class Statistics(NamedTuple):
  """Sums over the training rows, of features x (D,) shifted by a fixed vector, and targets y (K,).

  count: (); sum_x: (D,); sum_y: (K,); xtx: (D, D), sum of x x^T; xty: (D, K), sum of x y^T.
  With a leading axis (C,) on each: the sums of C regressions.
  """
  count: jax.Array
  sum_x: jax.Array
  sum_y: jax.Array
  xtx: jax.Array
  xty: jax.Array


def targets(labels: jax.Array, num_classes: int) -> jax.Array:
  """int (N,) -> float32 (N, K): +1 at the label, -1 elsewhere."""
  return 2 * jax.nn.one_hot(labels, num_classes) - 1


def zero_statistics(dim: int, num_classes: int, regressions: tuple[int, ...] = ()) -> Statistics:
  """Empty float32 sums, each of shape `regressions` + its own; numpy arrays, so that every
  process passes the same (replicated) value to a computation over several processes."""
  shapes = Statistics((), (dim,), (num_classes,), (dim, dim), (dim, num_classes))
  return Statistics(*(np.zeros(regressions + shape, np.float32) for shape in shapes))


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


def predict(features: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
  """Classes (B,) of features (B, D) under the regression W (D, K), b (K,)."""
  return jnp.argmax(jnp.matmul(features, w, precision=HIGHEST) + b, axis=-1)


# C regressions at once, each row of a batch of features (B, D) weighted (B, C) for each. Jitted
# once here: every shape compiles once per process, and later evaluations reuse it. With batches
# sharded over several processes' devices, the sums reduce across processes inside the
# computation, and every process gets the same (replicated) result.


@jax.jit
def accumulate_each(stats: Statistics, features: jax.Array, labels: jax.Array,
                    weights: jax.Array, shift: jax.Array) -> Statistics:
  """Adds features (B, D) - shift (D,) and targets(labels (B,)) to the C sums `stats`, row b to
  sum c with weight (B, C) [b, c]."""
  y = targets(labels, stats.sum_y.shape[-1])
  return jax.vmap(accumulate, in_axes=(0, None, None, 1))(stats, features - shift, y, weights)


@jax.jit
def solve_each(stats: Statistics, l2: jax.Array) -> tuple[jax.Array, jax.Array]:
  """W (C, D, K) and b (C, K) of the C sums `stats`, each with its ridge penalty l2 (C,): `solve`
  of one regression after the other.

  Not a vmap: XLA:CPU's LAPACK kernels (jaxlib 0.10) split a batch of matrices into tasks on the
  thread pool that also runs each device's share of a computation, then wait for the tasks. The
  statistics are on every device, so each device's share can take a thread of the pool and wait
  for tasks that no free thread is left to run, and the process hangs. One matrix runs inline.
  """
  return jax.lax.map(lambda args: solve(*args), (stats, l2))


@jax.jit
def count_correct(correct: jax.Array, features: jax.Array, labels: jax.Array,
                  weights: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
  """correct (C,) plus the rows of features (B, D) that regression c, W (C, D, K) and b (C, K),
  classifies as labels (B,), counted with weight (B, C) [b, c], or (B,) for every c."""
  hits = jax.vmap(predict, in_axes=(None, 0, 0))(features, w, b) == labels  # (C, B)
  return correct + jnp.sum(hits * weights.T, axis=1)


@jax.jit
def add_weights(total: jax.Array, weights: jax.Array) -> jax.Array:
  """total (C,) plus the column sums of weights (B, C), or (B,) for every c."""
  return total + weights.sum(0)


@jax.jit
def mean_row(features: jax.Array, weights: jax.Array) -> jax.Array:
  """The mean (D,) of the rows of features (B, D) that have a weight (B, C) above 0."""
  used = (weights.max(1) > 0)[:, None]
  return jnp.sum(features * used, 0) / jnp.maximum(used.sum(), 1)


@jax.jit
def unshifted(w: jax.Array, b: jax.Array, shift: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Regressions W (C, D, K), b (C, K) of features - shift (D,) as regressions of the features."""
  return w, b - jnp.einsum('d,cdk->ck', shift, w, precision=HIGHEST)


def fit(batches: Sequence[dict], num_classes: int, l2_grid: Sequence[float] = L2_GRID):
  """C regressions of the shots, each with the L2 from `l2_grid` most accurate on its held-out
  rows (the smallest such L2 on ties).

  Args:
    batches: dicts of 'features' (B, D), 'label' int (B,) in [0, num_classes), and 'shots' and
      'holdout' (B, C): 1 where a row is among the shots (the held-out images) of regression c,
      else 0. Numpy arrays, or jax.Arrays (sharded over any processes' devices).
    num_classes: K.
    l2_grid: the ridge penalties tried.
  Returns:
    W (C, D, K) and b (C, K), jax.Arrays; the chosen L2 and the held-out accuracy, numpy (C,).
  """
  num_regressions, dim = batches[0]['shots'].shape[1], batches[0]['features'].shape[1]
  shift = mean_row(batches[0]['features'], batches[0]['shots'])  # Keeps float32 sums accurate.
  stats = zero_statistics(dim, num_classes, (num_regressions,))
  held_out = np.zeros(num_regressions, np.float32)
  pacer = hardware.Pacer()
  for batch in batches:
    stats, held_out = pacer.step((
        accumulate_each(stats, batch['features'], batch['label'], batch['shots'], shift),
        add_weights(held_out, batch['holdout'])))

  def correct_with(l2):
    w, b = unshifted(*solve_each(stats, np.full(num_regressions, l2, np.float32)), shift)
    correct = np.zeros(num_regressions, np.float32)
    for batch in batches:
      correct = pacer.step(count_correct(correct, batch['features'], batch['label'],
                                         batch['holdout'], w, b))
    return np.asarray(correct)

  accuracy = np.stack([correct_with(l2) for l2 in l2_grid], 1) / np.asarray(held_out)[:, None]
  chosen = np.asarray(l2_grid)[accuracy.argmax(1)]  # The first, smallest, of equal maxima.
  w, b = unshifted(*solve_each(stats, chosen.astype(np.float32)), shift)
  return w, b, chosen, accuracy.max(1)


def probe(shots: tuple[np.ndarray, np.ndarray], holdout: tuple[np.ndarray, np.ndarray],
          num_classes: int, l2_grid: Sequence[float] = L2_GRID):
  """The regression of (features, labels) `shots` whose L2 from `l2_grid` is most accurate on
  `holdout` (the smallest such L2 on ties): (W (D, K), b (K,), l2, holdout accuracy)."""
  is_shot = np.repeat([1.0, 0.0], [len(shots[1]), len(holdout[1])]).astype(np.float32)[:, None]
  w, b, l2, accuracy = fit([{'features': np.concatenate([shots[0], holdout[0]]),
                             'label': np.concatenate([shots[1], holdout[1]]),
                             'shots': is_shot, 'holdout': 1 - is_shot}], num_classes, l2_grid)
  return w[0], b[0], float(l2[0]), float(accuracy[0])


# Choosing shots.


def shots_that_fit(shots, smallest: int, holdout: int,
                   split: str) -> tuple[tuple[int, ...], Optional[str]]:
  """(the k of `shots` for which a smallest class of `smallest` images in `split` has k shots
  and `holdout` further images, why the others cannot run or None)."""
  fit = tuple(k for k in shots if k + holdout <= smallest)
  skipped = [k for k in shots if k not in fit]
  if not skipped:
    return fit, None
  return fit, (f'{"/".join(map(str, skipped))}-shot: k-shot needs k + {holdout} images of each '
               f'class in {split!r} (k shots, {holdout} held out to choose the L2), and its '
               f'smallest class has {smallest}.')


def choose_shots(labels: np.ndarray, num_classes: int, shots: int, holdout: int, seed: int,
                 label_names: Optional[Sequence[str]] = None) -> tuple[np.ndarray, np.ndarray]:
  """Positions in `labels` of `shots` and of `holdout` further images of each class.

  Each class's positions are drawn in an order fixed by (seed, class); the first `shots` are the
  shots (so the first k of them are the k-shot choice), the next `holdout` the held-out images.
  A ValueError names the classes (by `label_names`, else by index) that have too few images.

  Returns:
    int (num_classes, shots) and int (num_classes, holdout), disjoint.
  """
  counts = np.bincount(labels, minlength=num_classes)
  if counts.min() < shots + holdout:
    short = [label_names[c] if label_names else c for c in range(num_classes)
             if counts[c] < shots + holdout]
    raise ValueError(
        f'Classes {short[:10]} have fewer than {shots} shots + {holdout} held-out images in the '
        f'training split (smallest: {counts.min()}): use fewer shots, a smaller --holdout, or a '
        'larger training split.')
  draws = [np.random.default_rng([seed, c]).permutation(np.flatnonzero(labels == c))
           for c in range(num_classes)]
  return (np.stack([d[:shots] for d in draws]),
          np.stack([d[shots:shots + holdout] for d in draws]))


def membership(positions: np.ndarray, draws: Sequence[tuple[np.ndarray, np.ndarray]],
               shots: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
  """Which regression each of `positions` (N,) is a shot, and a held-out image, of: float32
  (N, C) each, C = len(shots) x len(draws), regression c the c // len(draws)-th k of `shots` on
  the c % len(draws)-th draw of `choose_shots`."""
  pairs = [(draw, k) for k in shots for draw in draws]
  return (np.stack([np.isin(positions, draw[0][:, :k]) for draw, k in pairs], 1).astype(np.float32),
          np.stack([np.isin(positions, draw[1]) for draw, _ in pairs], 1).astype(np.float32))


# Features.


def split_labels(config, split: str) -> np.ndarray:
  """int64 (N,): the labels of `split` of config.dataset in stored order, images unread; a
  ValueError for multi-label data (k-shot takes k images of each class, each of one class)."""
  from vit_jax.data import sources
  source = sources.get_source(config)
  if source.multi_label:
    raise ValueError(f'{config.dataset} is multi-label (an image has any number of its classes); '
                     'few-shot evaluation takes k images of each class, each of one class.')
  return source.labels(split)


def class_sizes(config, split: str) -> np.ndarray:
  """int (K,): the number of images of each class in `split` of config.dataset; reads the
  labels only."""
  from vit_jax.data import sources
  num_classes = len(sources.get_source(config).label_names)
  return np.bincount(split_labels(config, split), minlength=num_classes)


def selected_images(config, split: str, positions: np.ndarray, batch: int) -> Iterator[np.ndarray]:
  """Preprocessed images at the sorted `positions` of `split`, in batches of `batch`:
  float32 (b, crop, crop, 3), b <= batch."""
  import tensorflow as tf
  from vit_jax.data import image_ops
  from vit_jax.data import shards
  from vit_jax.data import sources
  shard = sources.get_source(config).shard(split, 0, 1)
  wanted = np.zeros(shard.num_examples, bool)
  wanted[positions] = True
  wanted = tf.constant(wanted)

  def is_wanted(position, record):
    del record
    return tf.gather(wanted, position)

  def preprocess(position, record):
    del position
    image, turn = shard.decode(record['image'],
                               image_ops.shorter_side_needed(config.pp, train=False))
    return image_ops.preprocess_eval(image, config.pp, turn)

  images = shard.epoch(None).enumerate().filter(shards.as_written(is_wanted)).map(
      shards.as_written(preprocess), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return images.batch(batch).prefetch(2).as_numpy_iterator()


def padded(rows: np.ndarray, size: int) -> np.ndarray:
  """rows (n, ...) with zero rows appended up to (size, ...)."""
  return np.concatenate([rows, np.zeros((size - len(rows),) + rows.shape[1:], rows.dtype)])


def drawn_positions(draws) -> np.ndarray:
  """The sorted positions in the training split of every image that `draws` choose."""
  return np.unique(np.concatenate([a.ravel() for draw in draws for a in draw]))


def train_batches(config, labels: np.ndarray, draws, shots: Sequence[int],
                  mesh: jax.sharding.Mesh) -> Iterator[dict]:
  """The shots and held-out images of `draws` of config.train_split with their `membership`:
  global batches {'image', 'label', 'shots', 'holdout'} of config.batch_eval rows, sharded along
  the mesh's 'data' axis, zero rows (zero weights) after the last image. Each process reads and
  preprocesses its own contiguous share of the images."""
  from vit_jax.data import pipeline
  positions = drawn_positions(draws)
  mine = np.array_split(positions, jax.process_count())[jax.process_index()]
  batch = pipeline.local_batch_size(config, 'batch_eval', jax.process_count())
  is_shot, is_held_out = membership(mine, draws, shots)
  images = selected_images(config, config.train_split, mine, batch)

  no_images = np.zeros((0, *blank.image_hw(config.pp.crop), 3), np.float32)

  def local_batches():
    for i in range(-(-len(positions) // config.batch_eval)):  # Every share fits in as many.
      rows = slice(i * batch, (i + 1) * batch)
      yield {'image': padded(next(images, no_images), batch),
             'label': padded(labels[mine[rows]], batch), 'shots': padded(is_shot[rows], batch),
             'holdout': padded(is_held_out[rows], batch)}

  return pipeline.prefetch_to_mesh(local_batches(), NamedSharding(mesh, P('data')), 2)


@functools.partial(jax.jit, static_argnums=0)
def features(model, params, images: jax.Array) -> jax.Array:
  """`model`'s features (B, D) of images (B, H, W, 3) in [-1, 1], compiled once per model and
  shape."""
  return model.apply({'params': params}, images, method='features')


# Evaluation.


def check_model(model) -> None:
  """Raises ValueError unless `model` gives one feature vector per image."""
  if model.classifier not in ('token', 'gap'):
    raise ValueError(f'classifier={model.classifier!r} gives features per token; few-shot '
                     "evaluation needs one vector per image: a 'token' or 'gap' model.")


def default_mesh() -> jax.sharding.Mesh:
  """A 'data' axis over all devices."""
  return jax.sharding.Mesh(np.array(jax.devices()), ('data',))


def evaluate(model, params, config, shots: Sequence[int], seeds: Sequence[int],
             holdout: int, mesh: Optional[jax.sharding.Mesh] = None) -> dict:
  """Few-shot linear accuracy of `model` on config.dataset, for each k of `shots`.

  Runs in every process of a multi-process run alike: each reads and preprocesses its share of
  the images, the sums reduce across processes and all get the same results.

  Args:
    model, params: a VisionTransformer and its parameters (best already on the mesh's devices:
      host arrays are copied to them for every batch).
    config: dataset settings: `dataset`, `train_split`, `test_split`, `pp` (the evaluation
      preprocessing), `batch_eval` (a multiple of the device count) and the source options of
      vit_jax.data.sources (`tfds_data_dir`, ...).
    shots: the k of k-shot; seeds: one shot choice per seed; holdout: held-out images per class.
    mesh: a mesh with a 'data' axis; default: all devices.
  Returns:
    {k: {'mean': accuracy in [0, 1], 'std': over seeds, 'accuracy': per seed, 'l2': per seed,
    'holdout_accuracy': per seed}}, and 'num_test', 'seconds_train' (the shots' and held-out
    images' features and the regressions), 'seconds_test' (the test pass: features and scores).
  """
  from vit_jax.data import pipeline
  from vit_jax.data import sources
  check_model(model)
  mesh = mesh or default_mesh()
  labels = split_labels(config, config.train_split)
  label_names = sources.get_source(config).label_names
  num_classes = len(label_names)
  draws = [choose_shots(labels, num_classes, max(shots), holdout, seed, label_names)
           for seed in seeds]
  # One batch size for the shots and the test images, so that `features` compiles once.
  config = config.copy_and_resolve_references()
  config.batch_eval = max(pipeline.eval_batch_size(config, mesh, len(drawn_positions(draws))),
                          pipeline.eval_batch_size(config, mesh))

  start = time.perf_counter()
  pacer = hardware.Pacer()
  batches = [{'features': pacer.step(features(model, params, batch.pop('image'))), **batch}
             for batch in train_batches(config, labels, draws, shots, mesh)]
  w, b, l2, holdout_accuracy = fit(batches, num_classes)
  seconds_train = time.perf_counter() - start

  start = time.perf_counter()
  correct, num_test = np.zeros(len(l2), np.float32), np.zeros((), np.float32)
  for batch in pipeline.get_eval_iterator(config, mesh):
    correct, num_test = pacer.step((
        count_correct(correct, features(model, params, batch['image']), batch['label'],
                      batch['mask'], w, b),
        add_weights(num_test, batch['mask'])))
  num_test = int(num_test)
  per_k = lambda values: dict(zip(shots, np.reshape(values, (len(shots), -1)).tolist()))
  results = {k: {'accuracy': accuracy, 'mean': float(np.mean(accuracy)),
                 'std': float(np.std(accuracy)), 'l2': per_k(l2)[k],
                 'holdout_accuracy': per_k(holdout_accuracy)[k]}
             for k, accuracy in per_k(np.asarray(correct) / num_test).items()}
  return {**results, 'num_test': num_test, 'seconds_train': seconds_train,
          'seconds_test': time.perf_counter() - start}

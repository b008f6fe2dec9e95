"""Input pipeline: preprocessed, sharded, resumable batches of images.

Sources (`config.dataset`, see `sources.py`): `'fashion_mnist_embedded'` (ships with the
package), an image folder `DIR/{train,test}/<class_name>/*.{jpg,png,bmp,gif,webp}` (or
`DIR/<class_name>/*.jpg`, a tenth held out as `test`; or, labelled per pixel,
`DIR/{train,test}/{images,masks}/`), or a tfds name.

Order. Training examples come from an endless stream of epochs, each epoch in an order drawn from
the seed and the epoch number; the random augmentation of the example at position `g` of the
stream is drawn from the seed and `g`, and the stream's batch `n` is positions `[n*b, (n+1)*b)`.
`get_train_iterator(..., start_step=n)` skips `n*b` undecoded records (at most one epoch of them is
read) and yields exactly what an uninterrupted run yields from step `n` on.
  * The embedded data and image folders (sources with random access): one stream, of the whole
    split, permuted exactly, keyed by `(config.seed, epoch)` and `(config.seed, g)`, with
    b = config.batch. Every process walks the stream's undecoded records and decodes only its rows
    `[p*b/P, (p+1)*b/P)` of each batch (process p of P), so the global batch at step `n` depends on
    the seed and `n` alone: 2 processes of 4 devices train on the same batches as 1 of 8, and a run
    may resume with another number of processes. The rows assemble into the global batch because
    the mesh's `data` axis holds the devices in process order, as `jax.devices()` does.
  * tfds datasets (read sequentially): one stream per process, of its contiguous share of the
    split (`tfds.even_splits`), shuffled with a buffer of `config.shuffle_buffer` records, keyed by
    `(config.seed, p, epoch)` and `(config.seed, p, g)`, with b = config.batch / P. The global
    batch depends on the number of processes, so the iterator state records it and a restore
    checks it.

Preprocessing (`config.pp`), as in the ViT paper: training takes an Inception-style random crop
(5%-100% of the area, aspect ratio 3/4-4/3), resizes it to `pp.crop` and flips it at random
(`pp.flip`), then applies RandAugment where `pp.randaug` is set (vit_jax/data/randaugment.py, keyed
like the rest by `(config.seed, g)`); evaluation resizes to `pp.crop`, or resizes the short side
to `pp.resize` and takes the central `pp.crop` square. Resizes that shrink are antialiased, and a
large JPEG is decoded at the smallest of libjpeg's scales that still holds the pixels these take
(`image_ops.decode_image`; not for labels per pixel). A JPEG of an image folder is cropped and
sized as stored, then turned as its EXIF orientation shows it (`orientation`), once it is small.
Images are float32 in [-1, 1], labels int32 class indices (the loss takes them as they are, or
one-hot via `jax.nn.one_hot(label, num_classes)`), or for multi-label data (an image folder with
a labels.csv, a tfds label that is a sequence) float32 multi-hot rows (num_classes,).
"""
import collections
import dataclasses
import logging
import math
from typing import Any, Iterator, Optional

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import tensorflow as tf

from vit_jax.data import image_ops
from vit_jax.data import shards
from vit_jax.data import sources
from vit_jax.models import blank


_ORDER, _AUGMENT = 0, 1  # Purposes of random keys.


_FOREVER = 2**62  # Number of training epochs.


# The config fields the training order depends on: a resumed run must use the same values.
ORDER_FIELDS = ('dataset', 'train_split', 'seed', 'batch')
Batch = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
  """What the model and the training loop need to know about `config.dataset`.

  Attributes:
    num_classes: number of classes.
    label_names: name of each class, indexed by label.
    num_train: number of examples in `config.train_split`.
    num_test: number of examples in `config.test_split`.
    multi_label: whether an image has any number of the classes (labels: multi-hot rows).
    per_pixel_labels: whether each pixel has a label (segmentation), not each image.
  """
  num_classes: int
  label_names: list[str]
  num_train: int
  num_test: int
  multi_label: bool = False
  per_pixel_labels: bool = False


def get_dataset_info(config) -> DatasetInfo:
  """Class count, class names and split sizes of `config.dataset`; raises the error of an image
  of the test split that does not decode, so that it stops a run before training, not at the
  first evaluation."""
  source = sources.get_source(config)
  info = DatasetInfo(len(source.label_names), source.label_names,
                     source.num_examples(config.train_split),
                     source.num_examples(config.test_split), source.multi_label,
                     source.per_pixel_labels)
  source.check_decodable(config.test_split)
  return info


def num_examples(config, split: str) -> int:
  """The number of examples of the split string `split` of config.dataset."""
  return sources.get_source(config).num_examples(split)


def local_batch_size(config, field: str, process_count: int) -> int:
  """`config.<field>` (a global batch size) divided among `process_count` processes."""
  global_batch = config[field]
  if global_batch % process_count:
    raise ValueError(f'config.{field}={global_batch} is not divisible by the number of '
                     f'processes ({process_count}): make it a multiple of {process_count}.')
  return global_batch // process_count


def _shard(source, split: str, process_index: int, process_count: int) -> shards.Shard:
  shard = source.shard(split, process_index, process_count)
  if not shard.num_examples:
    share = f' for process {process_index} of {process_count}' if process_count > 1 else ''
    raise ValueError(f'Split {split!r} of {source.name!r} has no examples{share}: use a larger '
                     'split.')
  return shard


def _shorter_side(source, pp, train: bool) -> Optional[int]:
  """The shorter side an image of `source` may be decoded at (image_ops.shorter_side_needed):
  None, the whole image, where labels per pixel are read at the image's full size."""
  return None if source.per_pixel_labels else image_ops.shorter_side_needed(pp, train)


def _label(label: tf.Tensor, multi_label: bool) -> tf.Tensor:
  """A record's label as batches hold it: int32 () class, or float32 (C,) multi-hot."""
  return tf.cast(label, tf.float32 if multi_label else tf.int32)


def _fixed_options() -> tf.data.Options:
  """tf.data without its autotuner: over an endless pipeline its model grows with every epoch,
  and tearing the iterator down at the end of a run then took up to a minute."""
  options = tf.data.Options()
  options.autotune.enabled = False
  return options


def train_dataset(config, *, process_index: int, process_count: int,
                  start_step: int = 0) -> tf.data.Dataset:
  """This process's training batches from step `start_step` on, as an endless tf.data pipeline.

  Returns:
    Batches `{'image': float32 (b, h, w, 3) in [-1, 1], 'label': int32 (b,)}` with
    b = config.batch // process_count and (h, w) the sides of config.pp.crop; for multi-label
    data 'label' float32 (b, C), for labels per pixel int32 (b, h, w).
  """
  image_ops.check_pp(config.pp)
  batch = local_batch_size(config, 'batch', process_count)
  source = sources.get_source(config)
  if source.random_access:  # One stream of global batches; this process takes its rows of each.
    shard = _shard(source, config.train_split, 0, 1)
    stream, stream_batch, first_row = 0, config.batch, process_index * batch
  else:  # A stream of local batches from this process's share.
    shard = _shard(source, config.train_split, process_index, process_count)
    stream, stream_batch, first_row = process_index, batch, 0
  first_position = start_step * stream_batch
  first_epoch, offset = divmod(first_position, shard.num_examples)

  def epoch(n):
    return shard.epoch(image_ops.random_key(config.seed, stream, _ORDER, n))

  def is_own_row(position, record):
    del record
    row = position % stream_batch
    return (row >= first_row) & (row < first_row + batch)

  shorter_side = _shorter_side(source, config.pp, train=True)

  def preprocess(position, record):
    key = image_ops.random_key(config.seed, stream, _AUGMENT, position)
    image, turn = shard.decode(record['image'], shorter_side)
    label = shard.decode_label(record['label'])
    if source.per_pixel_labels:  # Cropped, resized and flipped with the image.
      image, label = image_ops.preprocess_train_per_pixel(image, label, key, config.pp)
    else:
      image = image_ops.preprocess_train(image, key, config.pp, turn)
    return {'image': image, 'label': _label(label, source.multi_label)}

  records = tf.data.Dataset.range(first_epoch, _FOREVER).flat_map(shards.as_written(epoch))
  examples = records.skip(offset).enumerate(start=first_position).filter(
      shards.as_written(is_own_row)).map(shards.as_written(preprocess),
                                         num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  return examples.batch(batch, drop_remainder=True).prefetch(2).with_options(_fixed_options())


def eval_dataset(config, *, process_index: int, process_count: int) -> tf.data.Dataset:
  """This process's share of `config.test_split`, once, padded to a count shared by all processes.

  Returns:
    Batches `{'image': float32 (b, h, w, 3) in [-1, 1], 'label': int32 (b,), 'mask': float32
    (b,)}` with b = config.batch_eval // process_count and (h, w) the sides of config.pp.crop;
    for multi-label data 'label' float32 (b, C), for labels per pixel int32 (b, h, w). `mask` is
    1 for real examples and 0 for padding. Every process yields ceil(largest share / b) batches.
  """
  image_ops.check_pp(config.pp)
  batch = local_batch_size(config, 'batch_eval', process_count)
  source = sources.get_source(config)
  shard = _shard(source, config.test_split, process_index, process_count)
  num_batches = math.ceil(max(source.shard_sizes(config.test_split, process_count)) / batch)

  shorter_side = _shorter_side(source, config.pp, train=False)

  def preprocess(record):
    image, turn = shard.decode(record['image'], shorter_side)
    label = shard.decode_label(record['label'])
    if source.per_pixel_labels:  # Sized as the image is.
      image, label = image_ops.preprocess_eval_per_pixel(image, label, config.pp)
    else:
      image = image_ops.preprocess_eval(image, config.pp, turn)
    return {'image': image, 'label': _label(label, source.multi_label), 'mask': tf.constant(1.0)}

  examples = shard.epoch(None).map(
      shards.as_written(preprocess), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  label = examples.element_spec['label']
  padding = {'image': tf.zeros([*blank.image_hw(config.pp.crop), 3]),
             'label': tf.zeros(label.shape, label.dtype), 'mask': tf.constant(0.0)}
  examples = examples.concatenate(tf.data.Dataset.from_tensors(padding).repeat(
      num_batches * batch - shard.num_examples))
  return examples.batch(batch).prefetch(tf.data.AUTOTUNE)


def _numpy_batches(dataset: tf.data.Dataset, config, split: str) -> Iterator[Batch]:
  """Iterates `dataset` as numpy; an image that fails to decode is reported by the source."""
  batches = dataset.as_numpy_iterator()
  while True:
    try:
      batch = next(batches)
    except StopIteration:
      return
    except tf.errors.OpError as e:
      raise sources.get_source(config).decode_error(split, e) from None
    yield batch


def train_batches(config, *, process_index: int = 0, process_count: int = 1,
                  start_step: int = 0) -> Iterator[Batch]:
  """`train_dataset` as numpy batches: this process's share of each global batch."""
  dataset = train_dataset(config, process_index=process_index, process_count=process_count,
                          start_step=start_step)
  return _numpy_batches(dataset, config, config.train_split)


def eval_batches(config, *, process_index: int = 0, process_count: int = 1) -> Iterator[Batch]:
  """`eval_dataset` as numpy batches: this process's share of each global batch."""
  dataset = eval_dataset(config, process_index=process_index, process_count=process_count)
  return _numpy_batches(dataset, config, config.test_split)


def _check_process_rows(sharding: NamedSharding, global_batch: int):
  """Checks that this process's devices hold the rows of a global batch its pipeline reads.

  Process p of P reads rows [p*b, (p+1)*b) of each global batch, b = global_batch / P.
  """
  rows = {row for index in sharding.addressable_devices_indices_map((global_batch,)).values()
          for row in range(global_batch)[index[0]]}
  batch = global_batch // jax.process_count()
  first = jax.process_index() * batch
  if rows != set(range(first, first + batch)):
    raise ValueError(
        f'The devices of process {jax.process_index()} hold rows {min(rows)}-{max(rows)} of each '
        f'global batch of {global_batch}, but its input pipeline reads rows {first}-'
        f'{first + batch - 1}: build the mesh from jax.devices() in their order, with each '
        "process's devices in consecutive rows of the 'data' axis.")


def _data_sharding(mesh: jax.sharding.Mesh, global_batch: int, field: str) -> NamedSharding:
  """Sharding of a batch along the mesh's `data` axis, checking that the batch divides."""
  if 'data' not in mesh.shape:
    raise ValueError(f"The mesh has axes {tuple(mesh.shape)}; the input pipeline shards batches "
                     "along an axis named 'data'.")
  if global_batch % mesh.shape['data']:
    raise ValueError(f'config.{field}={global_batch} is not divisible by the {mesh.shape["data"]} '
                     f"devices of the mesh's 'data' axis: make it a multiple of "
                     f'{mesh.shape["data"]}.')
  sharding = NamedSharding(mesh, P('data'))
  _check_process_rows(sharding, global_batch)
  return sharding


def _to_global(batch: Batch, sharding: NamedSharding, process_count: int) -> Batch:
  """This process's numpy share -> global jax.Arrays, (local_batch, ...) -> (global_batch, ...)."""
  return {
      name: jax.make_array_from_process_local_data(
          sharding, value, (value.shape[0] * process_count,) + value.shape[1:])
      for name, value in batch.items()}


def prefetch_to_mesh(batches: Iterator[Batch], sharding: NamedSharding,
                     size: int) -> Iterator[Batch]:
  """Turns local numpy batches into global arrays, keeping `size` batches in flight to devices."""
  queue = collections.deque()
  for batch in batches:
    queue.append(_to_global(batch, sharding, jax.process_count()))
    if len(queue) > size:
      yield queue.popleft()
  yield from queue


def _order_settings(config) -> dict[str, Any]:
  """The settings the training order depends on: a resumed run must have the same."""
  settings = {field: config[field] for field in ORDER_FIELDS}
  if not sources.get_source(config).random_access:  # Each process shuffles its own tfds share.
    settings['process_count'] = jax.process_count()
  return settings


class TrainIterator:
  """Global training batches; `get_state()` is what `restore_train_iterator` resumes from.

  Yields `{'image': float32 (batch, crop, crop, 3), 'label': int32 (batch,)}` jax.Arrays sharded
  along the mesh's `data` axis, batch = config.batch.
  """

  def __init__(self, config, mesh: jax.sharding.Mesh, start_step: int):
    sharding = _data_sharding(mesh, config.batch, 'batch')
    local_batches = train_batches(config, process_index=jax.process_index(),
                                  process_count=jax.process_count(), start_step=start_step)
    self._batches = prefetch_to_mesh(local_batches, sharding, config.get('prefetch', 2))
    self._order = _order_settings(config)
    self._data = sources.get_source(config).fingerprint(config.train_split)
    self._step = start_step

  def __iter__(self):
    return self

  def __next__(self) -> Batch:
    batch = next(self._batches)
    self._step += 1
    return batch

  def get_state(self) -> dict[str, Any]:
    """JSON-serialisable: the next step, the settings the order depends on and the data's
    fingerprint (the source's `fingerprint` of the train split).

    `{'step', 'dataset', 'train_split', 'seed', 'batch', 'data'}`, plus `'process_count'` for
    tfds.
    """
    return {'step': self._step, **self._order, 'data': self._data}


def get_train_iterator(config, mesh: jax.sharding.Mesh, *, start_step: int = 0) -> TrainIterator:
  """Endless global training batches from step `start_step` on (see the module docstring)."""
  return TrainIterator(config, mesh, start_step)


def restore_train_iterator(config, mesh: jax.sharding.Mesh,
                           state: dict[str, Any]) -> TrainIterator:
  """Continues from `TrainIterator.get_state()`, after checking that the order is unchanged (a
  library caller continues in another order with `get_train_iterator(config, mesh,
  start_step=state['step'])`)."""
  current = _order_settings(config)
  changed = [f'{field}: saved {state.get(field)!r}, now {value!r}'
             for field, value in current.items() if state.get(field) != value]
  if changed:
    raise ValueError(
        f'Cannot resume the training data order: {"; ".join(changed)}. Run with the saved '
        'values, or use another --workdir to start afresh.')
  train_iter = TrainIterator(config, mesh, state['step'])
  if 'data' in state and (changes := data_changes(state['data'], train_iter.get_state()['data'])):
    skipping = (' (config.skip_bad_images drops the files that do not decode)'
                if config.get('skip_bad_images') else '')
    what = (f'The training data changed since the checkpoint of step {state["step"]}: '
            f'{config.dataset} split {config.train_split!r} now has {changes}{skipping}')
    if not config.get('resume_changed_data'):
      raise ValueError(
          f'{what}, so its order would not be the one trained on. Restore the data as it was, '
          'set --config.resume_changed_data=True to resume in a new order (no longer exact), '
          'or use another --workdir to start afresh.')
    logging.warning('%s: resuming in a new order, no longer exact '
                    '(config.resume_changed_data).', what)
  return train_iter


def data_changes(saved: dict[str, Any], now: dict[str, Any]) -> str:
  """How the data's fingerprint `now` differs from the `saved` one, e.g. '199 examples (200
  when saved)' or 'other examples, as many as when saved'; '' where they agree."""
  if saved == now:
    return ''
  def told(key, value):  # Examples: a count, or tfds's {split: count}.
    if key == 'version':
      return f'tfds version {value}'
    return f'{value} examples' if isinstance(value, int) else f'split sizes {value}'

  changes = [f'{told(key, now.get(key))} ({told(key, saved.get(key))} when saved)'
             for key in ('examples', 'version') if saved.get(key) != now.get(key)]
  return ', '.join(changes) or 'other examples, as many as when saved'


def eval_batch_size(config, mesh: jax.sharding.Mesh, examples: Optional[int] = None) -> int:
  """config.batch_eval, or, where `examples` (default: those of config.test_split) fill less than
  one such batch, `examples` rounded up to a multiple of the devices of the mesh's 'data' axis and
  of the processes, so that each gets as many rows: 10 test images on 2 devices are one batch of
  10, not one of 512 with 502 padded ones to compute."""
  process_count = jax.process_count()
  if examples is None:  # As many rows as the largest process share, in every process.
    source = sources.get_source(config)
    examples = max(source.shard_sizes(config.test_split, process_count)) * process_count
  multiple = math.lcm(mesh.shape['data'], process_count)
  return min(config.batch_eval, max(1, math.ceil(examples / multiple)) * multiple)


def get_eval_iterator(config, mesh: jax.sharding.Mesh) -> Iterator[Batch]:
  """One pass over `config.test_split`: global batches `{'image', 'label', 'mask'}`.

  Every example appears exactly once with mask 1; the last batches are padded with mask 0.
  """
  sharding = _data_sharding(mesh, config.batch_eval, 'batch_eval')
  local_batches = eval_batches(config, process_index=jax.process_index(),
                               process_count=jax.process_count())
  return prefetch_to_mesh(local_batches, sharding, config.get('prefetch', 2))

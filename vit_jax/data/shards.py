"""What every source of images shares: `DataError` (an image that does not decode, one line
naming it), the split strings of tfds (`split_names`), each process's share of a split
(`Shard`, `shard_bounds`), and `ArraySource`, images held as arrays.
"""
import dataclasses
import functools
import hashlib
import re
import types
from typing import Callable, Optional

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds


class DataError(ValueError):
  """Images that cannot be read; the message is one line naming them and the fix."""


@dataclasses.dataclass(frozen=True)
class Shard:
  """One process's share of a split, or the whole split.

  Attributes:
    num_examples: number of examples in the share.
    epoch: `key -> tf.data.Dataset` of one pass over the share as records
      `{'image': undecoded image, 'label': int64 () class, int64 (C,) multi-hot of a
      multi-label source, or per pixel int64 (height, width) or the string path of a mask
      file}`; shuffled by the stateless key (int64 (2,)) or, for `key=None`, in the stored order.
    decode: (undecoded image, shorter side needed in pixels or None) -> (uint8 (height, width,
      3), its EXIF orientation): a large image decoded at a smaller size where its format
      allows and a side is given (image_ops.decode_image), as stored; the orientation an int32
      () that preprocessing turns the image by once it has sized it (image_ops.preprocess_train,
      preprocess_eval), or None for sources whose images are stored as shown.
    decode_label: a record's label -> the label as preprocessing takes it: the labels per pixel
      (height, width) of a mask file's path; the label itself for all others.
  """
  num_examples: int
  epoch: Callable[[Optional[tf.Tensor]], tf.data.Dataset]
  decode: Callable[[tf.Tensor, Optional[int]], tuple[tf.Tensor, Optional[tf.Tensor]]]
  decode_label: Callable[[tf.Tensor], tf.Tensor]


def stored_label(label: tf.Tensor) -> tf.Tensor:
  """The `decode_label` of labels held as they are used: the label itself."""
  return label


def as_written(fn: Callable) -> Callable:
  """`fn` for tf.data to trace as written, skipping AutoGraph's rewrite of its Python source into
  graph control flow: the pipeline's functions branch on Python values only, and the rewrite of
  each, in every process, took longer than building the rest of the pipeline."""
  return tf.autograph.experimental.do_not_convert(fn)


def shard_bounds(num_examples: int, process_index: int, process_count: int) -> tuple[int, int]:
  """[start, end) of the contiguous share of process `process_index` of `process_count`."""
  return (num_examples * process_index // process_count,
          num_examples * (process_index + 1) // process_count)


def short_message(error: tf.errors.OpError) -> str:
  """The first line of a TensorFlow error message, without the names of internal functions."""
  return re.sub(r'\{\{.*?\}\}', '', error.message).strip().split('\n')[0]


def split_names(split: str) -> list[str]:
  """The split names a split string reads: `'train[:90%]+test'` -> `['train', 'test']`."""
  return [part.split('[')[0].strip() for part in split.split('+')]


def _absolute_slices(split: str, sizes: dict[str, int]) -> list[tuple[str, slice]]:
  """Resolves a tfds split string against split sizes into (split name, slice) pairs."""
  infos = {name: types.SimpleNamespace(num_examples=n) for name, n in sizes.items()}
  instructions = tfds.core.ReadInstruction.from_spec(split).to_absolute(infos)
  return [(i.splitname, slice(i.from_, i.to)) for i in instructions]


class ArraySource:
  """A source with random access: every split is an array of items and an array of labels.

  Items are what `decode` turns into an image: uint8 grey images for the embedded dataset, file
  paths for image folders. Labels are int class indices (N,), for a `multi_label` source
  multi-hot rows (N, C), or with `per_pixel_labels` one per pixel of the decoded image (N,
  height, width), or the paths of mask files (N,) that `decode_label` reads. The epoch order is a
  stateless permutation of the share.
  """
  random_access = True

  def __init__(self, name: str, label_names: list[str],
               load_split: Callable[[str], tuple[np.ndarray, np.ndarray]],
               decode: Callable[[tf.Tensor, Optional[int]],
                                tuple[tf.Tensor, Optional[tf.Tensor]]],
               multi_label: bool = False,
               per_pixel_labels: bool = False,
               decode_label: Callable[[tf.Tensor], tf.Tensor] = stored_label):
    self.name = name
    self.label_names = label_names
    self.multi_label = multi_label
    self.per_pixel_labels = per_pixel_labels
    self._load_split = functools.cache(load_split)
    self._decode = decode
    self._decode_label = decode_label

  def select(self, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(items, labels) of a split string, e.g. `'train[:98%]'`."""
    sizes = {name: len(self._load_split(name)[1]) for name in split_names(split)}
    try:
      slices = _absolute_slices(split, sizes)
    except ValueError as e:
      raise ValueError(
          f'Bad split {split!r} for {self.name!r} (split sizes: {sizes}): {e}') from None
    parts = [(self._load_split(name)[0][s], self._load_split(name)[1][s]) for name, s in slices]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

  def num_examples(self, split: str) -> int:
    return len(self.select(split)[1])

  def labels(self, split: str) -> np.ndarray:
    """int64 (N,), or multi-hot (N, C): the labels of `split` in stored order."""
    return self.select(split)[1].astype(np.int64)

  def fingerprint(self, split: str) -> dict:
    """JSON: what the order of `split` depends on, {'examples': n, 'sha256': of its items and
    labels} (a folder's: the file list, relative to the folder, and the labels)."""
    items, labels = self.select(split)
    digest = hashlib.sha256(labels.tobytes())
    digest.update(self._item_bytes(items))
    return {'examples': len(labels), 'sha256': digest.hexdigest()}

  def _item_bytes(self, items: np.ndarray) -> bytes:
    return items.tobytes()

  def shard_sizes(self, split: str, process_count: int) -> list[int]:
    """Number of examples in the share of each process."""
    bounds = [shard_bounds(self.num_examples(split), p, process_count)
              for p in range(process_count)]
    return [end - start for start, end in bounds]

  def shard(self, split: str, process_index: int, process_count: int) -> Shard:
    items, labels = self.select(split)
    start, end = shard_bounds(len(labels), process_index, process_count)
    items = tf.constant(items[start:end])
    labels = tf.constant(labels[start:end])  # Cast per record: masks stay uint8 here.

    def label(i):  # A path stays as it is, for decode_label to read.
      stored = tf.gather(labels, i)
      return stored if stored.dtype == tf.string else tf.cast(stored, tf.int64)

    def epoch(key):
      order = tf.range(end - start)
      if key is not None:
        order = tf.random.experimental.stateless_shuffle(order, seed=key)
      return tf.data.Dataset.from_tensor_slices(order).map(as_written(
          lambda i: {'image': tf.gather(items, i), 'label': label(i)}))

    return Shard(end - start, epoch, self._decode, self._decode_label)

  def check_decodable(self, split: str) -> None:
    """Raises the `decode_error` of the first image of `split` that does not decode; arrays of
    pixels always do."""
    del split

  def decode_error(self, split: str, error: tf.errors.OpError) -> Exception:
    """The error to raise when decoding an image of `split` failed with `error`."""
    del split  # Arrays of pixels always decode.
    return DataError(f'Cannot read an image of dataset {self.name!r}: {short_message(error)}')

"""Where images come from: the embedded dataset, image folders and tfds datasets.

Every source turns a split string (`'train'`, `'train[:98%]'`, `'test'`) into `Shard`s: one
process's share of the split (the whole split is the share of process 0 of 1) as a tf.data
pipeline of undecoded records, plus the function that decodes a record's image. Records are cheap
to produce and to skip (an array index, a file path, or the encoded bytes of a tfds example), so
that a resumed run skips to its step before decoding. Sources with `random_access` (arrays and
image folders) permute a share exactly; tfds shards are read in file order and shuffled with a
buffer. `folders.py` reads image folders; `pipeline.py` turns shards into preprocessed batches.
"""
import functools
import os
from typing import Optional

import tensorflow as tf

from vit_jax.data import embedded
from vit_jax.data import folders
from vit_jax.data import image_files
from vit_jax.data import segmentation
from vit_jax.data import shards
from vit_jax.data import tfds_source


def _grey_to_rgb(image: tf.Tensor, shorter_side: Optional[int] = None) -> tuple[tf.Tensor, None]:
  """(uint8 (height, width) -> uint8 (height, width, 3), no orientation); pixels, already decoded
  at their size (shards.Shard.decode)."""
  del shorter_side
  return tf.image.grayscale_to_rgb(image[..., None]), None


def embedded_source() -> shards.ArraySource:
  """Fashion-MNIST as shipped in `vit_jax/data/` (see its README): splits `train` and `test`."""
  arrays = embedded.arrays()

  def load_split(name):
    if f'{name}_images' not in arrays:
      raise ValueError(f'{embedded.DATASET} has splits train and test, not {name!r}: set '
                       'config.train_split / config.test_split accordingly.')
    return arrays[f'{name}_images'], arrays[f'{name}_labels']

  return shards.ArraySource(embedded.DATASET, [str(n) for n in arrays['label_names']],
                            load_split, _grey_to_rgb)


def segmentation_source() -> shards.ArraySource:
  """The canvases of the embedded data's `train` and `test` items (vit_jax/data/segmentation.py),
  each labelled per pixel: (56, 56) masks of 11 classes, 'background' first."""
  arrays = embedded.arrays()

  def load_split(name):
    if name not in segmentation.SPLIT_STREAMS:
      raise ValueError(f'{embedded.SEGMENTATION_DATASET} has splits train and test, not '
                       f'{name!r}: set config.train_split / config.test_split accordingly.')
    return segmentation.split_of(arrays, name)

  label_names = segmentation.background_and([str(n) for n in arrays['label_names']])
  return shards.ArraySource(embedded.SEGMENTATION_DATASET, label_names, load_split, _grey_to_rgb,
                            per_pixel_labels=True)


def no_such_dataset(dataset: str, data_dir: Optional[str], tfds_error: str) -> Exception:
  """The error for a `config.dataset` that tfds did not take (`tfds_error`: the first line of its
  message) and no folder holds: a path where one holds a '/' (`image_files.missing_folder` has
  taken those that can only be paths), else an unknown name."""
  if '/' in dataset:
    return FileNotFoundError(image_files.no_folder_line(dataset))
  return ValueError(
      f'config.dataset={dataset!r} is neither {embedded.DATASET!r}, an existing image folder, '
      f'nor a tfds dataset (config.tfds_data_dir={data_dir!r}{"; tfds: " if tfds_error else ""}'
      f'{tfds_error}). Fix the name or the path.')


@functools.cache
def _cached_source(dataset, data_dir, manual_dir, skip_bad_images, shuffle_buffer):
  if dataset == embedded.DATASET:
    return embedded_source()
  if dataset == embedded.SEGMENTATION_DATASET:
    return segmentation_source()
  if error := image_files.missing_folder(dataset):
    raise FileNotFoundError(error)
  if os.path.isdir(os.path.expanduser(dataset)):
    return folders.FolderSource(os.path.expanduser(dataset), skip_bad_images)
  try:
    return tfds_source.TfdsSource(dataset, data_dir, manual_dir, shuffle_buffer)
  except tfds_source.UnknownDataset as e:
    raise no_such_dataset(dataset, data_dir, str(e)) from None


def get_source(config):
  """The source `config.dataset` names: the embedded dataset, an image folder or a tfds name."""
  return _cached_source(config.dataset, config.get('tfds_data_dir'),
                        config.get('tfds_manual_dir'), config.get('skip_bad_images', False),
                        config.shuffle_buffer)

"""Image folders as datasets: class folders, with or without split folders, multi-label folders
(a labels.csv) and folders labelled per pixel (images and their masks).

`FolderSource` lists a folder's files once, in a fixed class-mixed order, and reads and decodes
them as the pipeline asks; `sources.get_source` picks it for a `config.dataset` that is a folder.
"""
import collections
import csv
import functools
import os
import re
from typing import Iterable, Iterator, Optional

from absl import logging
import numpy as np
from PIL import Image
import tensorflow as tf

from vit_jax.data import image_ops
from vit_jax.data import orientation
from vit_jax.data import shards
from vit_jax.data.image_files import (files_under, FLAT_SPLITS, FLAT_TEST_FRACTION,
                                      flat_test_count, IMAGE_EXTENSIONS, IMAGES, is_flat_folder,
                                      is_image_file, LABELS_CSV, MASKS, shown_size, subfolders,
                                      visible)


# An image folder DIR labelled per pixel (IMAGES and MASKS: image_files): DIR/CLASSES_TXT, where
# it exists, names the classes, line i class i.
CLASSES_TXT = 'classes.txt'
MASK_IGNORE = 255  # config.seg.ignore_label's default.
_FILE_ORDER_SEED = 0  # Fixes the stored order of image folders, so that slices are class-mixed.


def decode_image_file(path: tf.Tensor,
                      shorter_side: Optional[int] = None) -> tuple[tf.Tensor, tf.Tensor]:
  """Reads and decodes a JPEG/PNG/BMP/GIF/WebP file (shards.Shard.decode): string () -> (uint8
  (height, width, 3) as stored, a large JPEG scaled down to `shorter_side` or more
  (image_ops.decode_image); int32 () its EXIF orientation, by which preprocessing turns it as
  image viewers and `predict` show it)."""
  encoded = tf.io.read_file(path)
  return image_ops.decode_image(encoded, shorter_side), orientation.exif_orientation(encoded)


def decode_upright_file(path: tf.Tensor,
                        shorter_side: Optional[int] = None) -> tuple[tf.Tensor, None]:
  """`decode_image_file`, the image turned as shown at once (no orientation left to apply): for
  labels per pixel, whose mask labels the image as shown."""
  image, turn = decode_image_file(path, shorter_side)
  return orientation.upright(image, turn), None


def _check_decode(path: tf.Tensor) -> tf.Tensor:
  """The shape (3,) of the image file at `path` decoded as cheaply as in full: a JPEG at an
  eighth of each side (libjpeg still reads all of its data; only its inverse DCT is smaller),
  any other image whole. Raises what its decoder raises."""
  return tf.shape(image_ops.decode_image(tf.io.read_file(path), shorter_side=1))


def decode_failure(path: str) -> str:
  """Why the image file at `path` does not read and decode, in TensorFlow's words."""
  try:
    _check_decode(tf.constant(path))
  except tf.errors.OpError as e:
    return shards.short_message(e)
  return 'it decoded when read again'


def undecodable_files(paths: np.ndarray) -> Iterator[str]:
  """Yields, in order, the files of `paths` (str (n,)) that cannot be read and decoded.

  Decodes every file in parallel with tf.data (`_check_decode`) and finds the failures as gaps in
  the sequence of indices that decoded; stops as soon as the caller stops asking.
  """
  decoded = tf.data.Dataset.from_tensor_slices(paths).enumerate().map(
      shards.as_written(lambda i, path: (i, _check_decode(path))),
      num_parallel_calls=tf.data.AUTOTUNE, deterministic=True).ignore_errors()
  expected = 0
  for index, _ in decoded.as_numpy_iterator():
    yield from (str(p) for p in paths[expected:index])
    expected = index + 1
  yield from (str(p) for p in paths[expected:])


def _class_dirs(split_dir: str) -> list[str]:
  """Sorted class names (subfolders) of `split_dir`, with a clear error if there are none."""
  if not os.path.isdir(split_dir):
    raise FileNotFoundError(
        f'Image folder split {split_dir} does not exist: an image folder dataset needs '
        f'DIR/<split>/<class_name>/<images>, or DIR/<class_name>/<images> with no split '
        f'folders (config.dataset=DIR).')
  classes = subfolders(split_dir)
  if not classes:
    raise ValueError(f'Image folder split {split_dir} has no class subfolders: put the images of '
                     f'each class into {split_dir}/<class_name>/.')
  return classes


def check_utf8_paths(paths: Iterable[str]) -> None:
  """A DataError naming the first of the file `paths` that is not valid UTF-8 (which
  TensorFlow's file names must be), with its undecodable bytes as \\xNN escapes."""
  for path in paths:
    try:
      path.encode('utf-8')
    except UnicodeEncodeError:  # os.listdir keeps undecodable bytes as surrogate escapes.
      shown = os.fsencode(path).decode('utf-8', 'backslashreplace')
      raise shards.DataError(f'The file name {shown} is not valid UTF-8, which TensorFlow needs: '
                      'rename it, e.g. to ASCII letters and digits.') from None


def _list_images(split_dir: str, train_classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """Paths and labels of the images of `split_dir`'s class folders (and of their subfolders,
  as torchvision's ImageFolder and Keras read them), in a fixed class-mixed order."""
  paths, labels, others = [], [], collections.Counter()
  for class_name in _class_dirs(split_dir):
    class_dir = os.path.join(split_dir, class_name)
    if class_name not in train_classes:
      raise ValueError(
          f'Class folder {class_dir} has no counterpart in the train split (classes: '
          f'{", ".join(train_classes)}): labels come from the train class folders, so add it '
          'there or remove it here.')
    files = list(files_under(class_dir))
    check_utf8_paths(files)
    images = list(filter(is_image_file, files))
    if not images:
      raise ValueError(f'Class folder {class_dir} holds no {"/".join(IMAGE_EXTENSIONS)} images: '
                       'add its images, or remove the folder.')
    others.update(os.path.splitext(path)[1].lower() or os.path.basename(path)
                  for path in files if not is_image_file(path))
    paths += images
    labels += [train_classes.index(class_name)] * len(images)
  if others:
    logging.warning('Ignoring %d file(s) in %s that are not %s images: %s.', others.total(),
                    split_dir, '/'.join(IMAGE_EXTENSIONS),
                    ', '.join(f'{n} {kind}' for kind, n in others.most_common()))
  order = np.random.default_rng(_FILE_ORDER_SEED).permutation(len(paths))
  return np.array(paths)[order], np.array(labels, np.int64)[order]


def read_labels_csv(directory: str) -> dict[str, list[str]]:
  """{file: its class names} of `directory`/LABELS_CSV, files as written (relative to
  `directory`); a ValueError naming the file where it lacks the columns `file` and `labels`."""
  path = os.path.join(directory, LABELS_CSV)
  with open(path, newline='', encoding='utf-8') as f:
    reader = csv.DictReader(f)
    if not {'file', 'labels'} <= set(reader.fieldnames or ()):
      raise ValueError(f'{path} has the columns {reader.fieldnames}; it needs a header row '
                       'naming the columns file and labels, e.g. "file,labels" then '
                       '"train/0001.jpg,cat dog".')
    return {os.path.normpath(row['file']): (row['labels'] or '').split() for row in reader}


def _csv_split(directory: str, rows: dict[str, list[str]], split: str) -> dict[str, list[str]]:
  """The rows of `rows` (read_labels_csv) whose file is in `directory`/`split`/; a
  FileNotFoundError where there are none, or where a file is missing."""
  rows = {file: names for file, names in rows.items() if file.split(os.sep)[0] == split}
  if not rows:
    raise FileNotFoundError(f'{os.path.join(directory, LABELS_CSV)} lists no file of split '
                            f'{split!r}: list the images of {os.path.join(directory, split)}/ '
                            f'as {split}/NAME.')
  missing = [file for file in rows if not os.path.isfile(os.path.join(directory, file))]
  if missing:
    raise FileNotFoundError(f'{os.path.join(directory, LABELS_CSV)} lists {len(missing)} '
                            f'file(s) that do not exist, e.g. {os.path.join(directory, missing[0])}'
                            ': remove their rows or add the files.')
  return rows


def _list_csv_images(directory: str, rows: dict[str, list[str]], split: str,
                     train_classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """Paths and multi-hot labels int64 (N, C) of the images LABELS_CSV lists in `split`, in a
  fixed order."""
  rows = _csv_split(directory, rows, split)
  files = sorted(rows)
  check_utf8_paths(os.path.join(directory, file) for file in files)
  labels = np.zeros((len(files), len(train_classes)), np.int64)
  index = {name: i for i, name in enumerate(train_classes)}
  for row, file in enumerate(files):
    for name in rows[file]:
      if name not in index:
        raise ValueError(f'{os.path.join(directory, LABELS_CSV)} labels {file} {name!r}, a class '
                         'no image of the train split has: labels come from the train split, so '
                         'label a train image with it or remove it here.')
      labels[row, index[name]] = 1
  order = np.random.default_rng(_FILE_ORDER_SEED).permutation(len(files))
  paths = np.array([os.path.join(directory, file) for file in files])
  return paths[order], labels[order]


def is_mask_folder(directory: str) -> bool:
  """Whether `directory` is an image folder labelled per pixel: DIR/train/{IMAGES,MASKS}/."""
  return all(os.path.isdir(os.path.join(directory, 'train', d)) for d in (IMAGES, MASKS))


# The PNG modes of a mask, whose pixel values (greyscale) or palette indices are class ids.
MASK_MODES = ('L', 'P')


def _check_mask_file(image: str, mask: str) -> None:
  """A DataError naming `mask` where it is not an 8-bit greyscale or palette PNG the size of
  `image` as it is shown (a JPEG turned upright by its EXIF orientation); reads the files'
  headers only."""
  with Image.open(image) as pixels, Image.open(mask) as ids:
    if ids.format != 'PNG' or ids.mode not in MASK_MODES:
      raise shards.DataError(
          f'The mask {mask} is a {ids.format} image of mode {ids.mode}; a mask is an 8-bit PNG '
          'of class ids, greyscale (mode L, e.g. PIL.Image.fromarray(ids.astype(np.uint8))) or '
          'palette (mode P: the indices are the ids).')
    width, height = shown_size(pixels)
    if ids.size != (width, height):
      raise shards.DataError(f'The mask {mask} is {ids.size[0]}x{ids.size[1]} px, its image '
                             f'{image} {width}x{height} (as shown): give them one size.')


def _list_masked_images(directory: str, split: str) -> tuple[np.ndarray, np.ndarray]:
  """Paths of the images of `directory`/`split`/IMAGES and of their masks (relative to
  `directory`: the labels, which mask_decoder reads), in a fixed order; a FileNotFoundError
  naming an image without its mask, a DataError naming a mask unlike its image."""
  images_dir, masks_dir = (os.path.join(directory, split, d) for d in (IMAGES, MASKS))
  for folder in (images_dir, masks_dir):
    if not os.path.isdir(folder):
      raise FileNotFoundError(f'{folder} does not exist: an image folder labelled per pixel '
                              f'needs DIR/<split>/{IMAGES}/ and DIR/<split>/{MASKS}/.')
  names = sorted(visible(os.listdir(images_dir)))
  check_utf8_paths(os.path.join(images_dir, name) for name in names)
  files = list(filter(is_image_file, names))
  if not files:
    raise ValueError(f'{images_dir} holds no {"/".join(IMAGE_EXTENSIONS)} images.')
  images = [os.path.join(images_dir, f) for f in files]
  masks = [os.path.join(split, MASKS, os.path.splitext(f)[0] + '.png') for f in files]
  missing = [i for i, mask in enumerate(masks) if not os.path.isfile(os.path.join(directory, mask))]
  if missing:
    raise FileNotFoundError(
        f'The image {images[missing[0]]} has no mask {os.path.join(directory, masks[missing[0]])} '
        f'({len(missing)} image(s) of {images_dir} lack one): add an 8-bit PNG of class ids per '
        f'pixel ({MASK_IGNORE} where unlabelled).')
  for image, mask in zip(images, masks):
    _check_mask_file(image, os.path.join(directory, mask))
  order = np.random.default_rng(_FILE_ORDER_SEED).permutation(len(files))
  return np.array(images)[order], np.array(masks)[order]


def read_mask(path: str | bytes) -> np.ndarray:
  """uint8 (height, width) class ids of the mask PNG at `path`: a greyscale PNG's values, a
  palette PNG's indices (TensorFlow's PNG decoder would give a palette's colours)."""
  with Image.open(os.fsdecode(path)) as ids:
    return np.asarray(ids, np.uint8)


def mask_class_names(directory: str, train_masks: np.ndarray) -> list[str]:
  """The lines of `directory`/CLASSES_TXT; without it, 'class 0' to 'class K', K the largest id
  (other than MASK_IGNORE) of the `train_masks` (paths relative to `directory`), all read."""
  path = os.path.join(directory, CLASSES_TXT)
  if os.path.isfile(path):
    with open(path, encoding='utf-8') as f:
      return [line.strip() for line in f.read().strip('\n').split('\n')]
  largest = 0
  for mask in train_masks:
    ids = read_mask(os.path.join(directory, mask))
    largest = max(largest, int(ids[ids != MASK_IGNORE].max(initial=0)))
  logging.info('%s has no %s: read its %d train masks, classes 0-%d (name them in %s, one a '
               'line, to skip this).', directory, CLASSES_TXT, len(train_masks), largest, path)
  return [f'class {i}' for i in range(largest + 1)]


_MASK_ERROR = re.compile(r'assertion failed: \[(The mask .*?)\]')


def mask_decoder(directory: str, num_classes: int):
  """`decode_label` of masks: a mask's path relative to `directory` -> uint8 (height, width) class
  ids; an error naming the file where an id is neither < `num_classes` nor MASK_IGNORE."""
  def decode(mask: tf.Tensor) -> tf.Tensor:
    path = tf.strings.join([directory, mask], os.sep)
    ids = tf.numpy_function(read_mask, [path], tf.uint8, stateful=False)
    ids.set_shape([None, None])
    known = tf.reduce_all((ids < num_classes) | (ids == MASK_IGNORE))
    message = tf.strings.join(['The mask ', path, f' has a class id of {num_classes} or more '
                               f'(not {MASK_IGNORE}, unlabelled): it has {num_classes} classes'])
    with tf.control_dependencies([tf.debugging.Assert(known, [message])]):
      return tf.identity(ids)
  return decode


def _drop_undecodable(split: str, paths: np.ndarray,
                      labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Removes the files that cannot be decoded, and logs how many and which (of `split`, e.g.
  "/data/photos split 'train'")."""
  bad = list(undecodable_files(paths))
  if bad:
    shown = ', '.join(bad[:10]) + (' ...' if len(bad) > 10 else '')
    logging.warning('Skipping %d undecodable image(s) of %d in %s (config.skip_bad_images): %s',
                    len(bad), len(paths), split, shown)
  keep = ~np.isin(paths, bad)
  return paths[keep], labels[keep]


def _flat_split(directory: str, split: str, classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """Paths and labels of split `split` of the flat folder `directory` (FLAT_SPLITS)."""
  if split not in FLAT_SPLITS:
    raise ValueError(
        f'{directory} holds its class folders without split folders, so its splits are train and '
        f'test ({FLAT_TEST_FRACTION:.0%} of its images held out), not {split!r}: set '
        'config.train_split / config.test_split accordingly, e.g. train[:50%].')
  paths, labels = _list_images(directory, classes)
  held_out = np.zeros(len(paths), bool)
  for label in range(len(classes)):
    positions = np.flatnonzero(labels == label)
    held_out[positions[len(positions) - flat_test_count(len(positions)):]] = True
  part = held_out if split == 'test' else ~held_out
  return paths[part], labels[part]


class FolderSource(shards.ArraySource):
  """Images in `directory/<split>/<class_name>/*.{jpg,png,...}`, classes sorted by name (or, in
  a flat folder, `directory/<class_name>/*.jpg`, split by `_flat_split`); or,
  where `directory`/LABELS_CSV exists, multi-label: the images it lists, each with its classes
  (those of the train split's images, sorted by name), as multi-hot labels; or, where
  `is_mask_folder`, labelled per pixel: the images of `<split>`/IMAGES, each with its mask in
  `<split>`/MASKS, classes named by `mask_class_names`."""

  def __init__(self, directory: str, skip_bad_images: bool):
    self._skip_bad_images = skip_bad_images
    multi_label = os.path.isfile(os.path.join(directory, LABELS_CSV))
    per_pixel = is_mask_folder(directory)
    decode_label = shards.stored_label
    if per_pixel:
      list_images = functools.cache(lambda name: _list_masked_images(directory, name))
      train_classes = mask_class_names(directory, list_images('train')[1])
      decode_label = mask_decoder(directory, len(train_classes))
    elif multi_label:
      rows = read_labels_csv(directory)
      train_classes = sorted({name for names in _csv_split(directory, rows, 'train').values()
                              for name in names})
      list_images = lambda name: _list_csv_images(directory, rows, name, train_classes)
    elif is_flat_folder(directory):
      train_classes = _class_dirs(directory)
      list_images = lambda name: _flat_split(directory, name, train_classes)
      logging.info('%s has no train/ and test/ folders: %.0f%% of the images of each class '
                   'folder are held out as its test split, the same ones every time.', directory,
                   100 * FLAT_TEST_FRACTION)
    else:
      train_classes = _class_dirs(os.path.join(directory, 'train'))
      list_images = lambda name: _list_images(os.path.join(directory, name), train_classes)

    def load_split(name):
      paths, labels = list_images(name)
      if skip_bad_images:
        paths, labels = _drop_undecodable(f'{directory} split {name!r}', paths, labels)
      return paths, labels

    decode = decode_upright_file if per_pixel else decode_image_file
    super().__init__(directory, train_classes, load_split, decode, multi_label,
                     per_pixel, decode_label)

  def _item_bytes(self, items: np.ndarray) -> bytes:
    start = len(os.path.join(self.name, ''))  # The folder may move; its files are the data.
    return '\n'.join(str(path)[start:] for path in items).encode('utf-8', 'surrogateescape')

  def check_decodable(self, split: str) -> None:
    """Raises the `decode_error` of `split` if an image of it does not decode, unless
    config.skip_bad_images has dropped them (then all do)."""
    if not self._skip_bad_images and next(undecodable_files(self.select(split)[0]), None):
      raise self.decode_error(split, None)

  def decode_error(self, split: str, error: Optional[tf.errors.OpError]) -> Exception:
    """Names the files of `split` that do not decode, each with its own error (`error`, from a
    pipeline that read several at once, need not be the error of any one of them)."""
    bad = list(undecodable_files(self.select(split)[0]))
    if not bad and error is not None and (mask := _MASK_ERROR.search(error.message)):
      return shards.DataError(mask.group(1))  # The file and its fault, from mask_decoder.
    if not bad:
      return shards.DataError(f'Cannot decode an image of {self.name} split {split!r}: '
                       f'{shards.short_message(error)}')
    named = '; '.join(f'{path} ({decode_failure(path)})' for path in bad[:3])
    more = f' and {len(bad) - 3} more' if len(bad) > 3 else ''
    return shards.DataError(
        f'Cannot decode {len(bad)} image(s) of {self.name} split {split!r}: {named}{more}. '
        'Remove or replace them, or set config.skip_bad_images=True to skip (and count) them.')

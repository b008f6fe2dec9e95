"""Where images come from: the embedded dataset, image folders and tfds datasets.

Every source turns a split string (`'train'`, `'train[:98%]'`, `'test'`) into `Shard`s: one
process's share of the split (the whole split is the share of process 0 of 1) as a tf.data
pipeline of undecoded records, plus the function that decodes a record's image. Records are cheap
to produce and to skip (an array index, a file path, or the encoded bytes of a tfds example), so
that a resumed run skips to its step before decoding. Sources with `random_access` (arrays and
image folders) permute a share exactly; tfds shards are read in file order and shuffled with a
buffer. `input_pipeline.py` turns shards into preprocessed batches.
"""
import collections
import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import shutil
import socket
import types
from typing import Callable, Iterator, Optional
import urllib.parse
import urllib.request

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

EMBEDDED_DATASET = 'fashion_mnist_embedded'
EMBEDDED_PATH = os.path.join(os.path.dirname(__file__), 'fashion_mnist_embedded.npz')
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.gif', '.webp')  # tf.io.decode_image's.
_FILE_ORDER_SEED = 0  # Fixes the stored order of image folders, so that slices are class-mixed.


class DataError(ValueError):
  """Images that cannot be read; the message is one line naming them and the fix."""


@dataclasses.dataclass(frozen=True)
class Shard:
  """One process's share of a split, or the whole split.

  Attributes:
    num_examples: number of examples in the share.
    epoch: `key -> tf.data.Dataset` of one pass over the share as records
      `{'image': undecoded image, 'label': int64 ()}`; shuffled by the stateless key (int64 (2,))
      or, for `key=None`, in the stored order.
    decode: undecoded image -> uint8 (height, width, 3).
  """
  num_examples: int
  epoch: Callable[[Optional[tf.Tensor]], tf.data.Dataset]
  decode: Callable[[tf.Tensor], tf.Tensor]


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
  paths for image folders. The epoch order is a stateless permutation of the share.
  """
  random_access = True

  def __init__(self, name: str, label_names: list[str],
               load_split: Callable[[str], tuple[np.ndarray, np.ndarray]],
               decode: Callable[[tf.Tensor], tf.Tensor]):
    self.name = name
    self.label_names = label_names
    self._load_split = functools.cache(load_split)
    self._decode = decode

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
    """int64 (N,): the labels of `split` in stored order."""
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
    labels = tf.constant(labels[start:end], tf.int64)

    def epoch(key):
      order = tf.range(end - start)
      if key is not None:
        order = tf.random.experimental.stateless_shuffle(order, seed=key)
      return tf.data.Dataset.from_tensor_slices(order).map(
          lambda i: {'image': tf.gather(items, i), 'label': tf.gather(labels, i)})

    return Shard(end - start, epoch, self._decode)

  def check_decodable(self, split: str) -> None:
    """Raises the `decode_error` of the first image of `split` that does not decode; arrays of
    pixels always do."""
    del split

  def decode_error(self, split: str, error: tf.errors.OpError) -> Exception:
    """The error to raise when decoding an image of `split` failed with `error`."""
    del split  # Arrays of pixels always decode.
    return DataError(f'Cannot read an image of dataset {self.name!r}: {short_message(error)}')


# The embedded dataset.


def _embedded_arrays() -> dict[str, np.ndarray]:
  if not os.path.exists(EMBEDDED_PATH):
    raise FileNotFoundError(
        f'The embedded dataset {EMBEDDED_PATH} is missing: reinstall vit_jax, or rebuild it with '
        '`python scripts/build_embedded_dataset.py`.')
  with np.load(EMBEDDED_PATH) as data:
    return {name: data[name] for name in data.files}


def _grey_to_rgb(image: tf.Tensor) -> tf.Tensor:
  """uint8 (height, width) -> uint8 (height, width, 3)."""
  return tf.image.grayscale_to_rgb(image[..., None])


def embedded_source() -> ArraySource:
  """Fashion-MNIST as shipped in `vit_jax/data/` (see its README): splits `train` and `test`."""
  arrays = _embedded_arrays()

  def load_split(name):
    if f'{name}_images' not in arrays:
      raise ValueError(f'{EMBEDDED_DATASET} has splits train and test, not {name!r}: set '
                       'config.train_split / config.test_split accordingly.')
    return arrays[f'{name}_images'], arrays[f'{name}_labels']

  return ArraySource(EMBEDDED_DATASET, [str(n) for n in arrays['label_names']], load_split,
                     _grey_to_rgb)


# Image folders.


def decode_image_file(path: tf.Tensor) -> tf.Tensor:
  """Reads and decodes a JPEG/PNG/BMP/GIF/WebP file: string () -> uint8 (height, width, 3)."""
  return tf.io.decode_image(tf.io.read_file(path), channels=3, expand_animations=False)


def decode_failure(path: str) -> str:
  """Why the image file at `path` does not read and decode, in TensorFlow's words."""
  try:
    decode_image_file(tf.constant(path))
  except tf.errors.OpError as e:
    return short_message(e)
  return 'it decoded when read again'


def undecodable_files(paths: np.ndarray) -> Iterator[str]:
  """Yields, in order, the files of `paths` (str (n,)) that cannot be read and decoded.

  Decodes every file in parallel with tf.data and finds the failures as gaps in the sequence of
  indices that decoded; stops as soon as the caller stops asking.
  """
  decoded = tf.data.Dataset.from_tensor_slices(paths).enumerate().map(
      lambda i, path: (i, tf.shape(decode_image_file(path))),
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
        f'DIR/<split>/<class_name>/<images> (config.dataset=DIR).')
  classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir())
  if not classes:
    raise ValueError(f'Image folder split {split_dir} has no class subfolders: put the images of '
                     f'each class into {split_dir}/<class_name>/.')
  return classes


def check_utf8_names(folder: str, names: list[str]) -> None:
  """A DataError naming the first of the file `names` in `folder` that is not valid UTF-8 (which
  TensorFlow's file names must be), with its undecodable bytes as \\xNN escapes."""
  for name in names:
    try:
      name.encode('utf-8')
    except UnicodeEncodeError:  # os.listdir keeps undecodable bytes as surrogate escapes.
      shown = os.fsencode(os.path.join(folder, name)).decode('utf-8', 'backslashreplace')
      raise DataError(f'The file name {shown} is not valid UTF-8, which TensorFlow needs: '
                      'rename it, e.g. to ASCII letters and digits.') from None


def _list_images(split_dir: str, train_classes: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """Paths and labels of all images in `split_dir`, in a fixed class-mixed order."""
  paths, labels, others = [], [], collections.Counter()
  for class_name in _class_dirs(split_dir):
    class_dir = os.path.join(split_dir, class_name)
    if class_name not in train_classes:
      raise ValueError(
          f'Class folder {class_dir} has no counterpart in the train split (classes: '
          f'{", ".join(train_classes)}): labels come from the train class folders, so add it '
          'there or remove it here.')
    names = sorted(os.listdir(class_dir))
    check_utf8_names(class_dir, names)
    files = [f for f in names if f.lower().endswith(IMAGE_EXTENSIONS)]
    if not files:
      raise ValueError(f'Class folder {class_dir} holds no {"/".join(IMAGE_EXTENSIONS)} images: '
                       'add its images, or remove the folder.')
    others.update(os.path.splitext(f)[1].lower() or f for f in names if f not in files)
    paths += [os.path.join(class_dir, f) for f in files]
    labels += [train_classes.index(class_name)] * len(files)
  if others:
    logging.warning('Ignoring %d file(s) in %s that are not %s images: %s.', others.total(),
                    split_dir, '/'.join(IMAGE_EXTENSIONS),
                    ', '.join(f'{n} {kind}' for kind, n in others.most_common()))
  order = np.random.default_rng(_FILE_ORDER_SEED).permutation(len(paths))
  return np.array(paths)[order], np.array(labels, np.int64)[order]


def _drop_undecodable(split_dir: str, paths: np.ndarray,
                      labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Removes the files that cannot be decoded, and logs how many and which."""
  bad = list(undecodable_files(paths))
  if bad:
    shown = ', '.join(bad[:10]) + (' ...' if len(bad) > 10 else '')
    logging.warning('Skipping %d undecodable image(s) of %d in %s (config.skip_bad_images): %s',
                    len(bad), len(paths), split_dir, shown)
  keep = ~np.isin(paths, bad)
  return paths[keep], labels[keep]


class FolderSource(ArraySource):
  """Images in `directory/<split>/<class_name>/*.{jpg,png,...}`; classes sorted by name."""

  def __init__(self, directory: str, skip_bad_images: bool):
    self._skip_bad_images = skip_bad_images
    train_classes = _class_dirs(os.path.join(directory, 'train'))

    def load_split(name):
      split_dir = os.path.join(directory, name)
      paths, labels = _list_images(split_dir, train_classes)
      if skip_bad_images:
        paths, labels = _drop_undecodable(split_dir, paths, labels)
      return paths, labels

    super().__init__(directory, train_classes, load_split, decode_image_file)

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
    if not bad:
      return DataError(f'Cannot decode an image of {self.name} split {split!r}: '
                       f'{short_message(error)}')
    named = '; '.join(f'{path} ({decode_failure(path)})' for path in bad[:3])
    more = f' and {len(bad) - 3} more' if len(bad) > 3 else ''
    return DataError(
        f'Cannot decode {len(bad)} image(s) of {self.name} split {split!r}: {named}{more}. '
        'Remove or replace them, or set config.skip_bad_images=True to skip (and count) them.')


# tfds datasets.


class TfdsSource:
  """A tfds image classification dataset with features `image` and `label`.

  Read sequentially: a process reads its own share (`tfds.even_splits`), shuffled with a buffer.
  """
  random_access = False

  def __init__(self, name: str, data_dir: Optional[str], manual_dir: Optional[str],
               shuffle_buffer: int):
    try:
      self._builder = tfds.builder(name, data_dir=data_dir)
    except (tfds.core.registered.DatasetNotFoundError, ValueError) as e:  # Unknown; unparsable.
      raise no_such_dataset(name, data_dir, str(e).split('\n')[0].rstrip('.')) from None
    if not self._builder.is_prepared():
      self._prepare(manual_dir)
    features = self._builder.info.features
    if 'image' not in features or 'label' not in features:
      raise ValueError(f'tfds dataset {name!r} has features {list(features)}; the input pipeline '
                       "needs an image classification dataset with features 'image' and 'label'.")
    self.name = name
    self.label_names = list(features['label'].names)
    self._shuffle_buffer = shuffle_buffer

  def _prepare(self, manual_dir: Optional[str]):
    logging.info('Preparing tfds dataset %s in %s', self._builder.name, self._builder.data_dir)
    self._check_downloads_reachable(manual_dir)
    try:
      with unfinished_files_removed(self._builder):
        self._builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    except Exception as e:
      raise ValueError(
          f'tfds dataset {self._builder.name!r} is not prepared in {self._builder.data_dir} and '
          f'preparing it failed: {e}. Set config.tfds_data_dir to where it is prepared, or, for '
          'datasets that need a manual download (e.g. imagenet2012), put the files into '
          'config.tfds_manual_dir.') from e

  def _check_downloads_reachable(self, manual_dir: Optional[str]) -> None:
    """Raises a one-line ValueError if a file the dataset still has to download is on a host
    that cannot be connected to; tfds would retry it for minutes. Datasets with a manual
    download are left to tfds, which names the files it needs."""
    if self._builder.MANUAL_DOWNLOAD_INSTRUCTIONS:
      return
    manual = manual_dir or os.path.join(self._builder.data_dir_root, 'downloads', 'manual')
    for url, info in missing_downloads(self._builder, manual).items():
      reason = unreachable(url)
      if reason:
        raise ValueError(
            f'tfds dataset {self._builder.name!r} is not prepared in {self._builder.data_dir} '
            f'and its download {url} cannot be reached ({reason}). Set config.tfds_data_dir to '
            f'where it is prepared, or download the file yourself (tfds\'s manual download) '
            f'into config.tfds_manual_dir (default {manual}) as {info.filename or "its name"}.')

  def num_examples(self, split: str) -> int:
    try:
      return self._builder.info.splits[split].num_examples
    except (KeyError, ValueError) as e:
      raise ValueError(f'Bad split {split!r} for tfds dataset {self.name!r} (splits: '
                       f'{list(self._builder.info.splits)}): {e}') from None

  def labels(self, split: str) -> np.ndarray:
    """int64 (N,): the labels of `split` in stored order, read without the images."""
    self.num_examples(split)  # Validates the split string.
    records = self._builder.as_dataset(
        split=split, shuffle_files=False,
        decoders=tfds.decode.PartialDecoding({'label': True}))
    batches = records.map(lambda example: example['label']).batch(65536)
    return np.concatenate([np.zeros(0, np.int64), *batches.as_numpy_iterator()]).astype(np.int64)

  def fingerprint(self, split: str) -> dict:
    """JSON: what the order of `split` depends on, {'version': the prepared dataset's,
    'examples': {split name: size} of the splits it reads}."""
    self.num_examples(split)  # Validates the split string.
    return {'version': str(self._builder.info.version),
            'examples': {name: self.num_examples(name) for name in split_names(split)}}

  def shard_sizes(self, split: str, process_count: int) -> list[int]:
    """Number of examples in the share of each process."""
    self.num_examples(split)  # Validates the split string.
    return [self.num_examples(s) for s in tfds.even_splits(split, process_count)]

  def shard(self, split: str, process_index: int, process_count: int) -> Shard:
    self.num_examples(split)  # Validates the split string.
    process_split = tfds.even_splits(split, process_count)[process_index]
    records = self._builder.as_dataset(
        split=process_split, shuffle_files=False,
        decoders={'image': tfds.decode.SkipDecoding()}).map(
            lambda example: {'image': example['image'], 'label': example['label']})

    def epoch(key):
      if key is None:
        return records
      return records.shuffle(self._shuffle_buffer, seed=key[0], reshuffle_each_iteration=False)

    return Shard(self.num_examples(process_split), epoch, self.decode)

  @staticmethod
  def decode(encoded: tf.Tensor) -> tf.Tensor:
    return tf.io.decode_image(encoded, channels=3, expand_animations=False)

  def check_decodable(self, split: str) -> None:
    """Does nothing: tfds wrote the records it prepared, and reading them all would be slow."""
    del split

  def decode_error(self, split: str, error: tf.errors.OpError) -> Exception:
    return ValueError(f'Cannot decode an image of tfds dataset {self.name!r} split {split!r}: '
                      f'{short_message(error)}')


CONNECT_TIMEOUT_S = 5.0  # How long a download's host may take to accept a connection.


def missing_downloads(builder: tfds.core.DatasetBuilder, manual_dir: str) -> dict:
  """{url: tfds UrlInfo} of the files `builder` downloads that are neither in `manual_dir` (by
  their file name) nor downloaded already (where tfds keeps them, in DATA_DIR/downloads)."""
  downloads = os.path.join(builder.data_dir_root, 'downloads')
  folders = (os.path.join(downloads, builder.name), downloads)
  missing = {}
  for url, info in (builder.url_infos or {}).items():
    names = {tfds.core.download.resource.get_dl_fname(url, checksum)
             for checksum in (info.checksum, None)}
    kept = [os.path.join(folder, name) for folder in folders for name in names]
    if info.filename:
      kept.append(os.path.join(manual_dir, info.filename))
    if not any(os.path.exists(path) for path in kept):
      missing[url] = info
  return missing


def unreachable(url: str, timeout: float = CONNECT_TIMEOUT_S) -> Optional[str]:
  """Why no connection to the host of `url` (or to the proxy the environment names for it)
  opens within `timeout` seconds; None if one does, or for schemes other than http(s) and ftp."""
  parts = urllib.parse.urlsplit(url)
  ports = {'http': 80, 'https': 443, 'ftp': 21}
  if parts.scheme not in ports or not parts.hostname:
    return None
  host, port = parts.hostname, parts.port or ports[parts.scheme]
  proxy = urllib.request.getproxies().get(parts.scheme)
  if proxy and not urllib.request.proxy_bypass(host):
    proxy_parts = urllib.parse.urlsplit(proxy if '://' in proxy else f'http://{proxy}')
    host, port = proxy_parts.hostname, proxy_parts.port or ports.get(proxy_parts.scheme, 80)
  try:
    socket.create_connection((host, port), timeout=timeout).close()
  except OSError as e:
    return f'{host}:{port}: {e.strerror or str(e) or type(e).__name__}'
  return None


@contextlib.contextmanager
def unfinished_files_removed(builder: tfds.core.DatasetBuilder) -> Iterator[None]:
  """If the block raises, removes what it left unfinished in the folders where tfds downloads,
  extracts and prepares `builder`'s dataset: entries added to them that are tfds's temporary
  ones (`*.tmp.*`, `*.incomplete*`) or empty folders, and the data folder itself if the block
  made it and left it empty. Finished downloads stay, for the next try to use."""
  root = str(builder.data_dir_root)
  downloads = os.path.join(root, 'downloads')
  folders = [os.path.join(downloads, builder.name), os.path.join(downloads, 'extracted'),
             os.path.join(root, builder.name), downloads, root]  # Deepest first.
  before = {folder: set(os.listdir(folder)) if os.path.isdir(folder) else None
            for folder in folders}
  try:
    yield
  except BaseException:
    for folder, names in before.items():
      for name in set(os.listdir(folder)) - (names or set()) if os.path.isdir(folder) else ():
        path = os.path.join(folder, name)
        if '.tmp.' in name or '.incomplete' in name:
          shutil.rmtree(path, ignore_errors=True)
        elif os.path.isdir(path) and not os.listdir(path):
          os.rmdir(path)
    if before[root] is None and os.path.isdir(root) and not os.listdir(root):
      os.rmdir(root)
    raise


def no_such_dataset(dataset: str, data_dir: Optional[str], tfds_error: str = '') -> Exception:
  """The error for a `config.dataset` that names nothing: a path (it holds a '/' or starts with
  '.' or '~') that does not exist, or a tfds name that tfds did not take (`tfds_error`: the first
  line of its message)."""
  if '/' in dataset or dataset.startswith(('.', '~')):
    return FileNotFoundError(
        f'config.dataset={dataset!r} is a path, and no folder exists there (relative paths start '
        f'at {os.getcwd()}): give an image folder DIR with DIR/train/<class>/ and '
        'DIR/test/<class>/.')
  return ValueError(
      f'config.dataset={dataset!r} is neither {EMBEDDED_DATASET!r}, an existing image folder, '
      f'nor a tfds dataset (config.tfds_data_dir={data_dir!r}{"; tfds: " if tfds_error else ""}'
      f'{tfds_error}). Fix the name or the path.')


@functools.cache
def _cached_source(dataset, data_dir, manual_dir, skip_bad_images, shuffle_buffer):
  if dataset == EMBEDDED_DATASET:
    return embedded_source()
  if os.path.isdir(os.path.expanduser(dataset)):
    return FolderSource(os.path.expanduser(dataset), skip_bad_images)
  if dataset.startswith(('.', '/', '~')) or dataset.endswith('/'):  # Not a tfds name.
    raise no_such_dataset(dataset, data_dir)
  return TfdsSource(dataset, data_dir, manual_dir, shuffle_buffer)


def get_source(config):
  """The source `config.dataset` names: the embedded dataset, an image folder or a tfds name."""
  return _cached_source(config.dataset, config.get('tfds_data_dir'),
                        config.get('tfds_manual_dir'), config.get('skip_bad_images', False),
                        config.shuffle_buffer)

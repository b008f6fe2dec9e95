"""Datasets of tensorflow-datasets by name (`TfdsSource`): prepared on first use, or one line
within seconds where the download cannot be reached, naming `config.tfds_data_dir` and tfds's
manual download and leaving no half-written file behind.
"""
import contextlib
import io
import os
import shutil
import socket
import tempfile
from typing import Iterator, Optional
import urllib.parse
import urllib.request

from absl import logging
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from vit_jax.data import image_ops
from vit_jax.data import shards


class UnknownDataset(ValueError):
  """A name tfds does not know, or cannot parse; the message is tfds's first line."""


class TfdsSource:
  """A tfds image classification dataset with features `image` and `label` (a ClassLabel), or
  multi-label: `label` or `labels` a Sequence of ClassLabel (e.g. voc's `labels`), read as
  multi-hot rows.

  Read sequentially: a process reads its own share (`tfds.even_splits`), shuffled with a buffer.
  """
  random_access = False
  per_pixel_labels = False

  def __init__(self, name: str, data_dir: Optional[str], manual_dir: Optional[str],
               shuffle_buffer: int):
    try:
      with empty_tfds_temporaries_removed():
        self._builder = tfds.builder(name, data_dir=data_dir)
    except (tfds.core.registered.DatasetNotFoundError, ValueError) as e:  # Unknown; unparsable.
      raise UnknownDataset(str(e).split('\n')[0].rstrip('.')) from None
    if not is_prepared(self._builder):
      self._prepare(manual_dir)
    features = self._builder.info.features
    self._label_key = next((key for key in ('label', 'labels') if key in features), None)
    label = features[self._label_key] if self._label_key else None
    self.multi_label = isinstance(label, tfds.features.Sequence)
    class_label = label.feature if self.multi_label else label
    if 'image' not in features or not isinstance(class_label, tfds.features.ClassLabel):
      raise ValueError(f'tfds dataset {name!r} has features {list(features)}; the input pipeline '
                       "needs an image classification dataset with features 'image' and 'label' "
                       "(a ClassLabel, or for multi-label data a Sequence of ClassLabel, as "
                       "'label' or 'labels').")
    self.name = name
    self.label_names = list(class_label.names)
    self._shuffle_buffer = shuffle_buffer

  def _prepare(self, manual_dir: Optional[str]):
    logging.info('Preparing tfds dataset %s in %s', self._builder.name, self._builder.data_dir)
    self._check_downloads_reachable(manual_dir)
    try:  # tfds prints 'Downloading and preparing dataset ...' to stdout; the line above says so.
      with unfinished_files_removed(self._builder), contextlib.redirect_stdout(io.StringIO()):
        self._builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=manual_dir))
    except Exception as e:
      reason = ' '.join(str(e).split()).rstrip('.')  # A manual download's steps span lines.
      raise ValueError(
          f'tfds dataset {self._builder.name!r} is not prepared in {self._builder.data_dir} and '
          f'preparing it failed: {reason}. Set config.tfds_data_dir to where it is prepared, or, '
          'for datasets that need a manual download (e.g. imagenet2012), put the files into '
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

  def label(self, example: dict[str, tf.Tensor]) -> tf.Tensor:
    """The label of a tfds example: int64 (), or multi-hot int64 (C,) of a Sequence."""
    label = example[self._label_key]
    if not self.multi_label:
      return label
    one_hot = tf.one_hot(label, len(self.label_names), dtype=tf.int64)
    return tf.minimum(tf.reduce_sum(one_hot, axis=0), 1)

  def labels(self, split: str) -> np.ndarray:
    """int64 (N,), or multi-hot (N, C): the labels of `split` in stored order, read without
    the images."""
    self.num_examples(split)  # Validates the split string.
    records = self._builder.as_dataset(
        split=split, shuffle_files=False,
        decoders=tfds.decode.PartialDecoding({self._label_key: True}))
    batches = records.map(shards.as_written(self.label)).batch(65536)
    empty = np.zeros((0, len(self.label_names)) if self.multi_label else 0, np.int64)
    return np.concatenate([empty, *batches.as_numpy_iterator()]).astype(np.int64)

  def fingerprint(self, split: str) -> dict:
    """JSON: what the order of `split` depends on, {'version': the prepared dataset's,
    'examples': {split name: size} of the splits it reads}."""
    self.num_examples(split)  # Validates the split string.
    return {'version': str(self._builder.info.version),
            'examples': {name: self.num_examples(name) for name in shards.split_names(split)}}

  def shard_sizes(self, split: str, process_count: int) -> list[int]:
    """Number of examples in the share of each process."""
    self.num_examples(split)  # Validates the split string.
    return [self.num_examples(s) for s in tfds.even_splits(split, process_count)]

  def shard(self, split: str, process_index: int, process_count: int) -> shards.Shard:
    self.num_examples(split)  # Validates the split string.
    process_split = tfds.even_splits(split, process_count)[process_index]
    records = self._builder.as_dataset(
        split=process_split, shuffle_files=False,
        decoders={'image': tfds.decode.SkipDecoding()}).map(shards.as_written(
            lambda example: {'image': example['image'], 'label': self.label(example)}))

    def epoch(key):
      if key is None:
        return records
      return records.shuffle(self._shuffle_buffer, seed=key[0], reshuffle_each_iteration=False)

    return shards.Shard(self.num_examples(process_split), epoch, self.decode, shards.stored_label)

  @staticmethod
  def decode(encoded: tf.Tensor, shorter_side: Optional[int] = None) -> tuple[tf.Tensor, None]:
    """The image as its builder stored it (shards.Shard.decode): tfds' datasets are read, as
    their published recipes read them, without EXIF orientation."""
    return image_ops.decode_image(encoded, shorter_side), None

  def check_decodable(self, split: str) -> None:
    """Does nothing: tfds wrote the records it prepared, and reading them all would be slow."""
    del split

  def decode_error(self, split: str, error: tf.errors.OpError) -> Exception:
    return ValueError(f'Cannot decode an image of tfds dataset {self.name!r} split {split!r}: '
                      f'{shards.short_message(error)}')


CONNECT_TIMEOUT_S = 5.0  # How long a download's host may take to accept a connection.


def is_prepared(builder: tfds.core.DatasetBuilder) -> bool:
  """Whether tfds has prepared `builder`'s dataset. tfds's own check warns "Variant folder ... has
  no dataset_info.json" for every dataset not prepared yet, which reads as a broken one: a
  folder that does not exist yet is not asked about."""
  return builder.data_path.exists() and builder.is_prepared()


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
def empty_tfds_temporaries_removed() -> Iterator[None]:
  """Removes the empty folders `tmp*tfds` that the block adds to the temporary directory.
  tfds 4.9.10 makes one each time it builds a dataset not yet prepared
  (`DatasetInfo.initialize_from_bucket`, before it finds its GCS bucket disabled) and never
  removes it; nothing is ever written into them."""
  folder = tempfile.gettempdir()
  before = set(os.listdir(folder))
  try:
    yield
  finally:
    for name in set(os.listdir(folder)) - before:
      if name.startswith('tmp') and name.endswith('tfds'):
        with contextlib.suppress(OSError):  # Not empty, or gone: not one of those.
          os.rmdir(os.path.join(folder, name))


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

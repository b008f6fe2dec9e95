"""ViT parameters in the layout of the published .npz checkpoints: reading, writing, the spec.

The published files (ViT-B_16.npz and friends, the AugReg files) are `numpy.savez` archives
whose keys are parameter paths joined by '/', e.g. `Transformer/encoderblock_0/LayerNorm_0/scale`.
Inside each encoder block, older files number the modules pre-linen style (`LayerNorm_0`,
`MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3`), newer ones linen style
(`LayerNorm_0`, `MultiHeadDotProductAttention_0`, `LayerNorm_1`, `MlpBlock_0`), and older hybrid
files store GroupNorm scale and bias as (1, 1, 1, C) instead of (C,). `load` reads all of them
into the model's tree; `save` writes the pre-linen numbering that tools reading the published
files look for.

Models built with `scan_layers=True` hold the blocks as one `Transformer/encoderblock` whose
leaves are stacked along a leading layer axis. `scan_blocks` and `unscan_blocks` convert between
the two layouts; `save` always writes the published per-block one, and
`finetune.load_pretrained` returns the layout of the model it is given.

`save` can store the model's spec (`registry.model_spec`) inside the archive, under SPEC_KEY;
`runs.load_model` rebuilds the model from it. A training run's spec also holds its dataset's
class names.

Wherever a checkpoint path is taken, a published name (`augreg:B/16`, `paper:ViT-B_16`; see
`published`, or `python -m vit_jax.checkpoint --list`) stands for that file, downloaded once
into a local cache (`runs.model_path`); its errors are `published.PublishedError`s (also
`ValueError`s). Paths with a scheme (`gs://...`) are read and written with TensorFlow's gfile,
imported only then. Every error is a `FileNotFoundError` or a `CheckpointError` (a `ValueError`)
whose message is one line naming the file, or the parameter path with both shapes.
"""
import errno
import io
import json
import os
import shutil
from typing import Any, Collection, Optional
import zipfile
import zlib

from flax import traverse_util
import numpy as np

from vit_jax import console


Params = dict[str, Any]
SCANNED_BLOCKS = ('Transformer', 'encoderblock')


BLOCK_PREFIX = 'encoderblock_'


# The archive key of the model spec, its JSON text as float32 byte values. Loaders that look
# parameters up by path (timm's) pass it by. Loaders that keep every entry (the official
# vit_jax's load_pretrained) get one more float32 leaf, which flax's apply ignores and a
# gradient step leaves as it is (its gradient is zero), where text would fail to jit.
SPEC_KEY = 'vit_jax_model_spec'
_PRE_LINEN_TO_LINEN = {
    'MultiHeadDotProductAttention_1': 'MultiHeadDotProductAttention_0',
    'LayerNorm_2': 'LayerNorm_1',
    'MlpBlock_3': 'MlpBlock_0',
}


_LINEN_TO_PRE_LINEN = {linen: old for old, linen in _PRE_LINEN_TO_LINEN.items()}
MAX_LISTED = 6


class CheckpointError(ValueError):
  """A checkpoint that cannot be read or does not fit the model; the message says which and why."""


def _is_url(path: str) -> bool:
  return '://' in path


def open_file(path: str, mode: str):
  """A binary file object: local paths with `open`, URLs (gs://...) with TensorFlow's gfile."""
  if not _is_url(path):
    if 'r' in mode and not os.path.isfile(path):
      raise FileNotFoundError(f'No such checkpoint file: {path}')
    return open(path, mode)
  import tensorflow as tf  # Seconds to import: only URLs need it.
  try:
    if 'r' in mode and not tf.io.gfile.exists(path):
      raise FileNotFoundError(f'No such checkpoint file: {path}')
    return tf.io.gfile.GFile(path, mode)
  except tf.errors.OpError as e:
    raise CheckpointError(f'Cannot open {path}: {e.message}') from None


def _read_npz(path: str, keys: Optional[Collection[str]] = None) -> dict[str, np.ndarray]:
  """The arrays of the archive at `path`, by key: all, or those of `keys` that it holds."""
  with open_file(path, 'rb') as f:
    if f.read(2) != b'PK':  # What every zip archive, hence every .npz, starts with.
      raise CheckpointError(f'{path} is not an .npz checkpoint archive (not a zip file).')
    f.seek(0)
    try:
      with np.load(f, allow_pickle=False) as archive:
        arrays = {key: archive[key] for key in archive.files if keys is None or key in keys}
    except (ValueError, EOFError, zipfile.BadZipFile, zlib.error) as e:
      raise CheckpointError(
          f'{path} is a damaged .npz checkpoint archive ({type(e).__name__}: {e}).') from None
  return arrays


def _decode_spec(arrays: dict[str, np.ndarray], path: str) -> Optional[dict]:
  """The model spec stored under SPEC_KEY among `arrays`; None if there is none."""
  if SPEC_KEY not in arrays:
    return None
  try:
    return json.loads(bytes(arrays[SPEC_KEY].astype(np.uint8)).decode())
  except (ValueError, TypeError) as e:
    raise CheckpointError(f'{path}: its {SPEC_KEY} entry is not a JSON model spec ({e}).'
                          ) from None


def read_spec(path) -> Optional[dict]:
  """The model spec saved in the .npz at `path` (see `save`), reading nothing else; None for
  files without one (the published checkpoints, files written by older versions)."""
  path = os.fspath(path)
  return _decode_spec(_read_npz(path, keys=(SPEC_KEY,)), path)


def _rename_block_modules(path: tuple[str, ...], names: dict[str, str]) -> tuple[str, ...]:
  """Renames, by `names`, the module right below each `encoderblock_{i}` of a parameter path."""
  return tuple(names.get(name, name) if i and path[i - 1].startswith(BLOCK_PREFIX) else name
               for i, name in enumerate(path))


def _block_number(path: tuple[str, ...]) -> Optional[int]:
  """i for a path under `Transformer/encoderblock_{i}`, None for any other path."""
  if len(path) > 2 and path[0] == 'Transformer' and path[1].startswith(BLOCK_PREFIX):
    suffix = path[1][len(BLOCK_PREFIX):]
    return int(suffix) if suffix.isdigit() else None
  return None


def is_scanned(params: Params) -> bool:
  """Whether `params` hold the encoder blocks in the scanned layout (`Transformer/encoderblock`)."""
  return SCANNED_BLOCKS[1] in params.get('Transformer', {})


def scan_blocks(params: Params) -> Params:
  """Per-block params -> the layout of a model built with `scan_layers=True`.

  Each leaf `Transformer/encoderblock/X` is the numpy stack, (L, ...), of the L leaves
  `Transformer/encoderblock_{i}/X`; all other leaves are kept as they are (params already
  scanned come back unchanged). A CheckpointError names a leaf that the blocks do not all have,
  or have with different shapes.
  """
  by_leaf = {}
  scanned = {}
  for path, value in traverse_util.flatten_dict(params).items():
    i = _block_number(path)
    if i is None:
      scanned[path] = value
    else:
      by_leaf.setdefault(path[2:], {})[i] = value
  num_layers = 1 + max((i for layers in by_leaf.values() for i in layers), default=-1)
  for leaf, layers in by_leaf.items():
    name = f'Transformer/{BLOCK_PREFIX}{{i}}/{"/".join(leaf)}'
    if len(layers) != num_layers:
      raise CheckpointError(f'{name} is in blocks {sorted(layers)} only, not in all '
                            f'{num_layers}: the blocks cannot be stacked into one scanned layer.')
    shapes = sorted({np.shape(v) for v in layers.values()})
    if len(shapes) > 1:
      raise CheckpointError(f'{name} has shapes {shapes} in different blocks: the blocks '
                            'cannot be stacked into one scanned layer.')
    scanned[SCANNED_BLOCKS + leaf] = np.stack([np.asarray(layers[i]) for i in range(num_layers)])
  return traverse_util.unflatten_dict(scanned)


def unscan_blocks(params: Params) -> Params:
  """The scanned layout (see `scan_blocks`) -> the published per-block one.

  Leaf `Transformer/encoderblock/X` of shape (L, ...) becomes the L numpy leaves
  `Transformer/encoderblock_{i}/X`; all other leaves, and per-block params, are kept as they are.
  """
  unscanned = {}
  for path, value in traverse_util.flatten_dict(params).items():
    if path[:2] != SCANNED_BLOCKS:
      unscanned[path] = value
      continue
    for i, layer in enumerate(np.asarray(value)):
      unscanned[('Transformer', f'{BLOCK_PREFIX}{i}', *path[2:])] = layer
  return traverse_util.unflatten_dict(unscanned)


def _squeeze_group_norm(path: tuple[str, ...], value: np.ndarray) -> np.ndarray:
  """GroupNorm scale/bias of older hybrid files, (1, 1, 1, C) -> (C,); other values as they are."""
  is_group_norm = len(path) > 1 and path[-2].startswith('gn')
  if is_group_norm and value.ndim > 1 and all(d == 1 for d in value.shape[:-1]):
    return value.reshape(-1)
  return value


def load_with_spec(path) -> tuple[Params, Optional[dict]]:
  """(parameter tree, model spec or None) of a published-layout .npz checkpoint: see `load`."""
  path = os.fspath(path)
  arrays = _read_npz(path)
  spec = _decode_spec(arrays, path)
  flat = {}
  for key, value in arrays.items():
    if key != SPEC_KEY:
      tree_path = _rename_block_modules(tuple(key.split('/')), _PRE_LINEN_TO_LINEN)
      flat[tree_path] = _squeeze_group_norm(tree_path, value)
  if not flat:
    raise CheckpointError(f'{path} is an empty archive: it holds no parameters.')
  return traverse_util.unflatten_dict(flat), spec


def load(path) -> Params:
  """Reads a published-layout .npz checkpoint into the model's parameter tree.

  Accepts pre-linen and linen module numbering and (1, 1, 1, C) or (C,) GroupNorm parameters.
  Returns a nested dict of numpy arrays (linen names, GroupNorm (C,)); a saved model spec is
  left out (`load_with_spec`, `read_spec`).
  """
  return load_with_spec(path)[0]


def save(params: Params, path, *, linen_names: bool = False, spec: Optional[dict] = None) -> None:
  """Writes `params` (numpy or jax arrays) as a published-layout .npz archive at `path`.

  Encoder blocks get the pre-linen numbering of the published files
  (`MultiHeadDotProductAttention_1`, `LayerNorm_2`, `MlpBlock_3`), or with `linen_names=True`
  the model's own; scanned params are written per block (`unscan_blocks`). A model spec
  (`vit_jax.models.registry.model_spec`) is stored under the key SPEC_KEY. Local files are
  written to a temporary file first and then renamed, so a crash never leaves half a file.
  """
  path = os.fspath(path)
  names = {} if linen_names else _LINEN_TO_PRE_LINEN
  arrays = {'/'.join(_rename_block_modules(p, names)): np.asarray(v)
            for p, v in traverse_util.flatten_dict(unscan_blocks(params)).items()}
  if spec is not None:
    arrays[SPEC_KEY] = np.frombuffer(json.dumps(spec).encode(), np.uint8).astype(np.float32)
  if _is_url(path):
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    with open_file(path, 'wb') as f:
      f.write(buffer.getvalue())
    return
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  try:
    with open(path + '.tmp', 'wb') as f:
      np.savez(f, **arrays)
    os.replace(path + '.tmp', path)
  except BaseException:  # E.g. a full disk: leave nothing half-written behind.
    if os.path.exists(path + '.tmp'):
      os.remove(path + '.tmp')
    raise


def free_space(path: str) -> str:
  """The free space of the file system holding `path` (or its nearest existing parent), in
  readable units: '0 bytes', '220 KiB', '4.9 MiB', '12.30 GiB'."""
  path = os.path.abspath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  return console.readable_bytes(shutil.disk_usage(path).free)


def is_out_of_space(error: BaseException) -> bool:
  """Whether `error` (an OSError, or a library's own error: safetensors', TensorFlow's,
  TensorStore's) says that the file system is full."""
  return ((isinstance(error, OSError) and error.errno == errno.ENOSPC)
          or 'No space left on device' in str(error))

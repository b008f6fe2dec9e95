"""ViT parameters in the layout of the published .npz checkpoints, and fine-tuning setup.

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
the two layouts; `save` always writes the published per-block one, and `load_pretrained` returns
the layout of the model it is given.

`save` can store the model's spec (`vit_jax.models.model_spec`) inside the archive, under
SPEC_KEY; `load_model` rebuilds the model from it, or from a registry name for files without
one, and takes a training workdir for its `model.npz`. A training run's spec also holds its
dataset's class names (`saved_label_names`).

Wherever a checkpoint path is taken, a published name (`augreg:B/16`, `paper:ViT-B_16`; see
`vit_jax.published`, or `python -m vit_jax.checkpoint --list`) stands for that file, downloaded
once into a local cache (`model_path`); its errors are `published.PublishedError`s (also
`ValueError`s). Paths with a scheme (`gs://...`) are read and written with TensorFlow's gfile,
imported only then. Every error is a `FileNotFoundError` or a `CheckpointError` (a `ValueError`)
whose message is one line naming the file, or the parameter path with both shapes.
"""
import argparse
import errno
import io
import json
import logging
import math
import os
import shutil
import zipfile
import zlib
from typing import Any, Collection, Optional

from flax import traverse_util
import ml_collections
import numpy as np
import scipy.ndimage

from vit_jax import console
from vit_jax import models
from vit_jax import mpp
from vit_jax import positions
from vit_jax import published

Params = dict[str, Any]

POSEMB_PATH = ('Transformer', 'posembed_input', 'pos_embedding')
PATCH_KERNEL_PATH = ('embedding', 'kernel')
SCANNED_BLOCKS = ('Transformer', 'encoderblock')
BLOCK_PREFIX = 'encoderblock_'
# Spline orders of scipy.ndimage.zoom.
POSEMB_METHODS = {'bilinear': 1, 'bicubic': 3}
# The archive key of the model spec, its JSON text as float32 byte values. Loaders that look
# parameters up by path (timm's) pass it by. Loaders that keep every entry (the official
# vit_jax's load_pretrained) get one more float32 leaf, which flax's apply ignores and a
# gradient step leaves as it is (its gradient is zero), where text would fail to jit.
SPEC_KEY = 'vit_jax_model_spec'
WORKDIR_MODEL = 'model.npz'  # Where training writes the final params, in its workdir.
RUN_CONFIG = 'config.json'  # Where training saves its config, in its workdir.
_PRE_LINEN_TO_LINEN = {
    'MultiHeadDotProductAttention_1': 'MultiHeadDotProductAttention_0',
    'LayerNorm_2': 'LayerNorm_1',
    'MlpBlock_3': 'MlpBlock_0',
}
_LINEN_TO_PRE_LINEN = {linen: old for old, linen in _PRE_LINEN_TO_LINEN.items()}
_MAX_LISTED = 6


class CheckpointError(ValueError):
  """A checkpoint that cannot be read or does not fit the model; the message says which and why."""


def _is_url(path: str) -> bool:
  return '://' in path


def _open(path: str, mode: str):
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
  with _open(path, 'rb') as f:
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
  (`vit_jax.models.model_spec`) is stored under the key SPEC_KEY. Local files are
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
    with _open(path, 'wb') as f:
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


def model_overrides_path(path: str) -> str:
  """Where the model overrides of checkpoint `path` are: FILE.npz -> FILE.overrides.json."""
  return os.path.splitext(path)[0] + '.overrides.json'


def save_model_overrides(overrides: dict[str, Any], path, *, note: str = '') -> None:
  """Records, next to checkpoint `path` (at `model_overrides_path(path)`), the VisionTransformer
  fields the weights need, e.g. {'approximate_gelu': False} for weights trained with exact GELU.

  Deprecated: the model spec saved inside the file (`save(..., spec=...)`) replaces this record,
  which `load_model` and fine-tuning still read for files without a spec.
  """
  text = json.dumps({'model_overrides': overrides, 'note': note}, indent=2)
  with _open(model_overrides_path(os.fspath(path)), 'wb') as f:
    f.write(text.encode())


def load_model_overrides(path) -> dict[str, Any]:
  """The VisionTransformer fields recorded next to checkpoint `path` by `save_model_overrides`;
  {} when there is no such record (the published checkpoints have none)."""
  try:
    with _open(model_overrides_path(os.fspath(path)), 'rb') as f:
      overrides = json.loads(f.read())['model_overrides']
    if not isinstance(overrides, dict):
      raise TypeError(f'model_overrides is a {type(overrides).__name__}, not an object')
    return overrides
  except FileNotFoundError:
    return {}
  except (ValueError, KeyError, TypeError) as e:
    raise CheckpointError(f'{model_overrides_path(os.fspath(path))} is not a model-overrides '
                          f'record ({e}); delete it or rewrite it with save_model_overrides.'
                          ) from None


def square_grid(num_tokens: int, what: str) -> tuple[int, int]:
  """(n, n) for num_tokens = n*n; a CheckpointError naming `what` otherwise."""
  side = math.isqrt(num_tokens)
  if side * side != num_tokens:
    raise CheckpointError(f'{what}: {num_tokens} grid positions are not a square grid; '
                          'give the grid (rows, columns) explicitly.')
  return side, side


def _spline_order(method: str) -> int:
  """The scipy.ndimage.zoom spline order of a POSEMB_METHODS name."""
  if method not in POSEMB_METHODS:
    raise CheckpointError(f'posemb_method={method!r}; choose one of {list(POSEMB_METHODS)}.')
  return POSEMB_METHODS[method]


def resize_posemb(posemb, grid_hw: tuple[int, int], *, has_class_token: bool,
                  method: str = 'bilinear',
                  source_grid_hw: Optional[tuple[int, int]] = None) -> np.ndarray:
  """Resizes position embeddings (1, [1 +] h*w, D) to a grid of `grid_hw` = (rows, columns).

  The class-token row (the first, when `has_class_token`) is kept as it is. The grid of the
  other rows, (h, w) = `source_grid_hw` (default: square), is interpolated in 2-D with
  corners aligned, as scipy.ndimage.zoom does: the four corner embeddings are kept exactly.
  `method` is 'bilinear' (as the published fine-tuning code) or 'bicubic' (cubic spline).
  Returns a numpy array (1, [1 +] rows*columns, D) of posemb's dtype.
  """
  posemb = np.asarray(posemb)
  order = _spline_order(method)
  if posemb.ndim != 3 or posemb.shape[0] != 1:
    raise CheckpointError(
        f'Position embeddings must have shape (1, tokens, D), not {posemb.shape}.')
  num_extra = 1 if has_class_token else 0
  extra, grid = posemb[:, :num_extra], posemb[0, num_extra:]
  source_hw = source_grid_hw or square_grid(len(grid), 'The position embeddings to resize')
  if math.prod(source_hw) != len(grid):
    raise CheckpointError(f'source_grid_hw={tuple(source_hw)} does not hold the {len(grid)} '
                          'grid rows of the position embeddings.')
  grid = grid.reshape(*source_hw, -1)
  if tuple(source_hw) != tuple(grid_hw):
    zoom = (grid_hw[0] / source_hw[0], grid_hw[1] / source_hw[1], 1)
    grid = scipy.ndimage.zoom(grid.astype(np.float64), zoom, order=order)
  grid = grid.reshape(1, grid_hw[0] * grid_hw[1], -1).astype(posemb.dtype)
  return np.concatenate([extra, grid], axis=1)


def resize_table(table, length: int, *, method: str = 'bilinear') -> np.ndarray:
  """Interpolates a table of position parameters (n, ...) along its first axis to (length, ...),
  ends aligned as scipy.ndimage.zoom does: the first and last entries are kept (and the middle
  one of an odd n to an odd length). For learned_2d's row and column tables, each resized on
  its own axis, and relative's table of 2P - 1 offsets (offset 0 stays in the middle; 1-D
  offsets over the raster have no exact meaning on a grid of another width, so this only
  stretches them). `method` as for `resize_posemb`; returns numpy of table's dtype."""
  table = np.asarray(table)
  order = _spline_order(method)
  if len(table) == length:
    return table
  zoom = (length / len(table),) + (1,) * (table.ndim - 1)
  return scipy.ndimage.zoom(table.astype(np.float64), zoom, order=order).astype(table.dtype)


def file_posemb(params: Params, spec: Optional[dict]) -> Optional[str]:
  """The posemb kind (vit_jax.positions.POSEMB_KINDS) of a checkpoint: its saved spec's, else
  the one its parameters show; None for a file without spec or position parameters (posemb
  'none' or 'sincos_2d', which only a spec tells apart)."""
  if spec is not None:
    return spec.get('model', {}).get('posemb', 'learned_1d')
  names = {path[-1] for path in traverse_util.flatten_dict(params)}
  for name, kind in ((POSEMB_PATH[-1], 'learned_1d'), (positions.ROW, 'learned_2d'),
                     (positions.RELATIVE, 'relative')):
    if name in names:
      return kind
  return None


def check_posemb(params: Params, spec: Optional[dict], model, source: str) -> None:
  """Raises a CheckpointError, naming both kinds, unless the checkpoint's position embeddings
  are of the kind of `model.posemb`."""
  kind = file_posemb(params, spec)
  parameter_free = ('none', 'sincos_2d')
  if kind == model.posemb or (kind is None and model.posemb in parameter_free):
    return
  found = f'posemb={kind!r}' if kind else f'no position parameters (posemb in {parameter_free})'
  raise CheckpointError(f'{source} has {found} but the model has posemb={model.posemb!r}: '
                        f'build the model with the checkpoint\'s kind (config.posemb).')


def _fit_positions(restored: dict, target: dict, model, *, grid: Optional[tuple[int, int]],
                   method: str) -> dict:
  """`restored` (flat, per block) with its position parameters resized to those of `target`
  (shapes, flat, per block): learned_1d's with `resize_posemb` to `grid` (see
  `load_pretrained`), learned_2d's and relative's tables with `resize_table`."""
  restored = dict(restored)
  # Resized only when the file and the model agree on the class token; else _check_flat says.
  same_tokens = (('cls',) in restored) == model.has_class_token
  if POSEMB_PATH in restored and POSEMB_PATH in target and same_tokens:
    restored[POSEMB_PATH] = _fit_posemb(restored[POSEMB_PATH], target[POSEMB_PATH].shape,
                                        has_class_token=model.has_class_token, grid=grid,
                                        method=method)
  names = (positions.ROW, positions.COLUMN, positions.RELATIVE)
  for path, value in restored.items():
    if path[-1] in names and path in target and np.shape(value)[1:] == target[path].shape[1:]:
      restored[path] = resize_table(value, target[path].shape[0], method=method)
  return restored


def _bilinear_matrix(size: int, new_size: int) -> np.ndarray:
  """(new_size, size) float64: the bilinear resize of `size` samples to `new_size`, with
  half-pixel centres and clamped ends, as tf.image.resize(method='bilinear') resizes each row and
  column of an image (without antialiasing)."""
  source = np.clip((np.arange(new_size) + 0.5) * size / new_size - 0.5, 0, size - 1)
  low = np.floor(source).astype(int)
  high = np.minimum(low + 1, size - 1)
  matrix = np.zeros((new_size, size))
  np.add.at(matrix, (np.arange(new_size), low), 1 - (source - low))
  np.add.at(matrix, (np.arange(new_size), high), source - low)
  return matrix


def resize_patch_kernel(kernel, patch_hw: tuple[int, int]) -> np.ndarray:
  """The patch-embedding kernel (h, w, C, D) for patches of `patch_hw` = (rows, columns)
  pixels, by the pseudo-inverse resize of FlexiViT (Beyer et al., 2023, Section 3.4).

  With R the bilinear resize of an h x w patch to patch_hw (`_bilinear_matrix` on each axis),
  the new kernel k' = pinv(R^T) k. For patch_hw at least (h, w), R^T has full row rank and
  <R x, k'> = <x, k> for every patch x: a patch resized to patch_hw gets the token the old
  kernel gave it. A whole image resized by the same factor differs from its patches resized
  one by one only in the border pixels of each patch, where bilinear interpolation blends in
  the neighbouring patch. For a smaller patch_hw, k' is the least-squares fit of the old
  tokens over white-noise patches. Returns numpy (rows, columns, C, D) of kernel's dtype.
  """
  kernel = np.asarray(kernel)
  rows = np.linalg.pinv(_bilinear_matrix(kernel.shape[0], patch_hw[0]).T)  # (rows, h)
  columns = np.linalg.pinv(_bilinear_matrix(kernel.shape[1], patch_hw[1]).T)  # (columns, w)
  resized = np.einsum('ih,jw,hwcd->ijcd', rows, columns, kernel.astype(np.float64))
  return resized.astype(kernel.dtype)


def _fit_patch_kernel(restored: dict, target: dict, model, source: str) -> dict:
  """`restored` (flat) with its patch-embedding kernel resized (`resize_patch_kernel`, logged)
  to the target's patch size where only that differs; as it is otherwise, and for hybrid models,
  whose kernel is over ResNet features (a CheckpointError from _check_flat then)."""
  kernel = restored.get(PATCH_KERNEL_PATH)
  if kernel is None or PATCH_KERNEL_PATH not in target or model.resnet_layers is not None:
    return restored
  old, new = np.shape(kernel), tuple(target[PATCH_KERNEL_PATH].shape)
  if len(old) != 4 or old[:2] == new[:2] or old[2:] != new[2:]:
    return restored
  logging.info('Resized the patch-embedding kernel of %s from %dx%d to %dx%d pixels (pseudo-'
               'inverse resize): images resized by the same factor keep their tokens.',
               source, *old[:2], *new[:2])
  return {**restored, PATCH_KERNEL_PATH: resize_patch_kernel(kernel, new[:2])}


def fit_positions(params: Params, model, image_size: int, *,
                  method: str = 'bilinear') -> Params:
  """`params` (per block, of `model` without scan_layers) with their position parameters
  resized for square images of `image_size` pixels, whatever the posemb kind."""
  target = traverse_util.flatten_dict(models.param_shapes(model, image_size))
  restored = _fit_positions(traverse_util.flatten_dict(params), target, model, grid=None,
                            method=method)
  return traverse_util.unflatten_dict(restored)


def _shape_mismatches(params: dict, reference: dict) -> list[str]:
  """One phrase per differently shaped, missing or unexpected leaf of two flat trees."""
  name = '/'.join
  problems = [f'{name(p)} is {tuple(np.shape(params[p]))} in the file but '
              f'{tuple(reference[p].shape)} in the model'
              for p in reference if p in params
              and tuple(np.shape(params[p])) != tuple(reference[p].shape)]
  problems += [f'missing {name(p)} {tuple(reference[p].shape)}'
               for p in reference if p not in params]
  problems += [f'unexpected {name(p)} {tuple(np.shape(params[p]))}'
               for p in params if p not in reference]
  return problems


def _check_flat(params: dict, reference: dict, source: str) -> None:
  problems = _shape_mismatches(params, reference)
  if problems:
    listed = '; '.join(problems[:_MAX_LISTED])
    more = f'; and {len(problems) - _MAX_LISTED} more' if len(problems) > _MAX_LISTED else ''
    raise CheckpointError(
        f'{source} does not fit the model: {listed}{more}. Check that the model (name, '
        'classifier, representation_size, hybrid stem, image size) is the one of the checkpoint.')


def check_matches(params: Params, reference: Params, *, source: str) -> None:
  """Raises a CheckpointError unless `params` has the paths and shapes of `reference`.

  `reference` may hold arrays or jax.ShapeDtypeStructs (e.g. vit_jax.models.param_shapes).
  Either may be scanned: both are compared in the per-block layout. The message names `source`
  and every mismatching path with its shapes.
  """
  # Zero-stride stand-ins take no memory and, unlike ShapeDtypeStructs, can be unscanned.
  stand_ins = {p: np.broadcast_to(np.zeros((), x.dtype), x.shape)
               for p, x in traverse_util.flatten_dict(reference).items()}
  reference = unscan_blocks(traverse_util.unflatten_dict(stand_ins))
  _check_flat(traverse_util.flatten_dict(unscan_blocks(params)),
              traverse_util.flatten_dict(reference), source)


def _fit_posemb(posemb: np.ndarray, target_shape: tuple[int, ...], *, has_class_token: bool,
                grid: Optional[tuple[int, int]], method: str) -> np.ndarray:
  """`posemb` resized to the target's number of tokens, or as it is when no resize applies."""
  num_extra = 1 if has_class_token else 0
  if grid is None:
    if posemb.shape == tuple(target_shape):
      return posemb
    grid = square_grid(target_shape[1] - num_extra, "The model's position embeddings")
  if math.prod(grid) + num_extra != target_shape[1]:
    raise CheckpointError(f'grid={tuple(grid)} gives {math.prod(grid) + num_extra} position '
                          f'embeddings, but the model has {target_shape[1]}.')
  if posemb.ndim != 3 or posemb.shape[-1] != target_shape[-1]:
    return posemb  # Reported with both shapes by check_matches.
  return resize_posemb(posemb, grid, has_class_token=has_class_token, method=method)


def _fit_pretraining_params(restored: dict, target: dict, source: str) -> dict:
  """`restored` (flat) without the masked-patch-prediction parameters (vit_jax.mpp) that
  `target` lacks (fine-tuning a pre-trained model; logged), and with `target`'s fresh ones
  that it lacks (pre-training from a published model)."""
  extra = lambda path: path[0].startswith(mpp.PARAM_PREFIX)
  dropped = sorted({p[0] for p in restored if extra(p) and p not in target})
  if dropped:
    logging.info('Dropped the pre-training parameters %s of %s: the model does not use them.',
                 ', '.join(dropped), source)
  fitted = {p: v for p, v in restored.items() if not (extra(p) and p not in target)}
  return {**{p: v for p, v in target.items() if extra(p) and p not in fitted}, **fitted}


def load_pretrained(path, init_params: Params, model, *,
                    posemb_method: str = 'bilinear',
                    grid: Optional[tuple[int, int]] = None,
                    keep_head: bool = False) -> Params:
  """The checkpoint at `path`, set up to fine-tune `model` (a VisionTransformer), freshly
  initialised as `init_params`.

  - `pre_logits` is dropped when `model.representation_size` is None;
  - `head` is replaced by the freshly initialised one of `init_params` (new classes), or, with
    `keep_head`, kept from the file (the same classes, e.g. continuing at a higher resolution);
  - the parameters that masked patch prediction adds (vit_jax.mpp.PARAM_PREFIX) are dropped,
    with a log line, when `init_params` lacks them, and taken from it when the file does;
  - the position embeddings are resized with `resize_posemb` (class-token row kept when
    `model.has_class_token`) to `grid` = (rows, columns) of patches, by default the
    square grid of init_params's position embeddings. Pass `grid` for non-square images,
    e.g. (384 // 16, 512 // 16). The tables of the other learned posemb kinds are resized to
    init_params's with `resize_table`: learned_2d's rows and columns each on its axis,
    relative's offsets; `none` and `sincos_2d` have nothing to resize;
  - a patch-embedding kernel of another patch size is resized with `resize_patch_kernel`
    (models without a ResNet stem), e.g. 7x7 to 14x14 for images of twice the size, which
    then start with the tokens the file's model gave them at the original size;
  - a file whose posemb kind (`file_posemb`) is not `model.posemb` is a CheckpointError.
  Anything else must match `init_params` path by path and shape by shape, or a CheckpointError
  lists what differs, in the per-block layout of the file. Returns a nested dict of numpy
  arrays with exactly init_params's structure, shapes and dtypes, scanned when init_params is
  (`scan_blocks`).
  """
  source = os.fspath(path)
  params, spec = load_with_spec(source)
  check_posemb(params, spec, model, source)
  restored = traverse_util.flatten_dict(unscan_blocks(params))
  target = traverse_util.flatten_dict(unscan_blocks(init_params))
  if model.representation_size is None:
    restored = {p: v for p, v in restored.items() if p[0] != 'pre_logits'}
  if not keep_head:
    restored = {p: v for p, v in restored.items() if p[0] != 'head'}
    restored.update({p: v for p, v in target.items() if p[0] == 'head'})
  restored = _fit_pretraining_params(restored, target, source)
  restored = _fit_positions(restored, target, model, grid=grid, method=posemb_method)
  restored = _fit_patch_kernel(restored, target, model, source)
  _check_flat(restored, target, source)
  params = traverse_util.unflatten_dict(
      {p: np.asarray(restored[p], dtype=target[p].dtype) for p in target})
  return scan_blocks(params) if is_scanned(init_params) else params


# Models from saved files.


def model_path(path_or_workdir) -> str:
  """The .npz of `path_or_workdir`: the path itself, WORKDIR/model.npz for a folder, or the
  cached file of a published name (downloaded on first use, `published.fetch`)."""
  path = os.fspath(path_or_workdir)
  if published.is_name(path):
    return published.fetch(path)
  return os.path.join(path, WORKDIR_MODEL) if os.path.isdir(path) else path


def posemb_of(params: Params) -> np.ndarray:
  """The position embeddings (1, T, D) of `params`; a CheckpointError if they have none."""
  try:
    return params['Transformer']['posembed_input']['pos_embedding']
  except KeyError:
    raise CheckpointError('The checkpoint has no Transformer/posembed_input/'
                          'pos_embedding: it is not a ViT checkpoint.') from None


def native_image_size(params: Params, model) -> int:
  """The image size, in pixels, at which the checkpoint's position parameters (of
  `model.posemb`'s kind) form the grid; one patch for the kinds without any (none, sincos_2d),
  which fit every grid."""
  if model.posemb == 'learned_1d':
    num_patches = posemb_of(params).shape[1] - model.has_class_token
  elif model.posemb in ('learned_2d', 'relative'):
    shapes = {path[-1]: np.shape(v) for path, v in traverse_util.flatten_dict(params).items()}
    if model.posemb == 'learned_2d':
      num_patches = shapes[positions.ROW][0] * shapes[positions.COLUMN][0]
    else:  # (2P - 1, N, K), or (L, 2P - 1, N, K) scanned.
      num_patches = (shapes[positions.RELATIVE][-3] + 1) // 2
  else:
    return model.patch_pixels[0]
  side, _ = square_grid(num_patches, "The checkpoint's position embeddings "
                        '(pass --image_size)')
  return side * model.patch_pixels[0]


def model_for_params(name_or_config, params: Params, overrides: dict):
  """The registry model (a name or a model config) with the classes and representation size of
  `params`, and the VisionTransformer fields `overrides`: for files without a model spec."""
  if 'head' not in params:
    raise CheckpointError(
        'The checkpoint has no head/ parameters: it extracts features but does not classify.')
  pre_logits = params.get('pre_logits')
  return models.get_model(
      name_or_config, num_classes=params['head']['kernel'].shape[-1],
      representation_size=None if pre_logits is None else pre_logits['kernel'].shape[-1],
      **overrides)


def read_run_config(workdir) -> Optional[dict]:
  """The config that training saved in `WORKDIR/config.json`, None without one; a
  CheckpointError naming the file and the way out where it is not a JSON object."""
  path = os.path.join(os.fspath(workdir), RUN_CONFIG)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      config = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    config = e
  if not isinstance(config, dict):
    why = f'not valid JSON ({config})' if isinstance(config, Exception) else 'not a JSON object'
    raise CheckpointError(
        f'{path}, the saved config of the run in {workdir}, is {why}: repair it, or delete it '
        "(the run's checkpoints stay; a rerun then saves its own config).")
  return config


def unfinished_run(workdir) -> Optional[str]:
  """For a training workdir without its model.npz, a line saying that the run has not finished
  and how to finish it; None for anything else."""
  path = os.fspath(workdir)
  checkpoints = os.path.join(path, 'checkpoints')
  if (not os.path.isdir(path) or os.path.exists(os.path.join(path, WORKDIR_MODEL)) or
      not (os.path.isdir(checkpoints) or os.path.isfile(os.path.join(path, RUN_CONFIG)))):
    return None
  steps = [int(n) for n in os.listdir(checkpoints) if n.isdigit()] if os.path.isdir(
      checkpoints) else []
  since = f' (it resumes from its checkpoint of step {max(steps)})' if steps else ''
  return (f'{path} holds a training run that has not finished: it has no {WORKDIR_MODEL} yet. '
          f'Finish it by running its training command again with --workdir={path}{since}, then '
          'try again.')


def _recorded_model_config(path_or_workdir) -> Optional[ml_collections.ConfigDict]:
  """`config.model` of the run whose workdir is `path_or_workdir`, from its config.json (runs
  of versions that saved no model spec); None for a file, or a folder without config.json."""
  config = read_run_config(path_or_workdir) if os.path.isdir(path_or_workdir) else None
  return None if config is None else ml_collections.ConfigDict(config['model'])


def load_model(path_or_workdir, model_name: Optional[str] = None, **overrides):
  """(model, params) of a saved model: an .npz file, or a training workdir (its model.npz).

  The model is the one of the spec saved in the file (`save`); `overrides` set fields it leaves
  to the caller, e.g. `dtype=jnp.bfloat16`. `path_or_workdir` may be a published name
  (`vit_jax.published`), which also names the model. Another file without a spec (the published
  checkpoints, files of older versions) needs `model_name`, a registry name whose classes and
  representation size then follow the parameters, with the fields of a FILE.overrides.json next
  to it applied (deprecated: files now carry their spec); an older workdir's config.json also
  names it.
  Raises a CheckpointError, or FileNotFoundError, whose one line names the file and the fix.
  """
  if error := unfinished_run(path_or_workdir):
    raise FileNotFoundError(error)
  path = model_path(path_or_workdir)
  params, spec = load_with_spec(path)
  if spec is None:
    name_or_config = (model_name or published.model_of(path_or_workdir) or
                      _recorded_model_config(path_or_workdir))
    if name_or_config is None:
      raise CheckpointError(
          f'{path} holds no model spec (a published file, or one written before vit_jax saved '
          f'specs): name its model with --model NAME (one of {", ".join(models.LISTED_MODELS)}).')
    model = model_for_params(name_or_config, params, {**load_model_overrides(path), **overrides})
  elif model_name and spec.get('name') not in (None, model_name):
    raise CheckpointError(f'{path} holds a {spec.get("name")} model (its saved spec), not '
                          f'{model_name}: leave out the model name.')
  else:
    try:
      model = models.model_from_spec(spec, **overrides)
    except ValueError as e:
      raise CheckpointError(f'{path}: {e}') from None
  check_matches(params, models.param_shapes(model, native_image_size(params, model)),
                source=path)
  return model, params


def saved_label_names(path_or_workdir) -> Optional[list[str]]:
  """The class names, in label order, that a training run saved in the model spec of its
  model.npz (under 'label_names'); None for files without them: the published files, converted
  weights, files of versions that did not save them."""
  if published.is_name(os.fspath(path_or_workdir)):
    return None  # The published files hold no spec.
  spec = read_spec(model_path(path_or_workdir))
  return None if spec is None else spec.get('label_names')


def main(argv: Optional[list[str]] = None) -> int:
  """`python -m vit_jax.checkpoint --list`: prints the published names (`vit_jax.published`)."""
  parser = argparse.ArgumentParser(description=main.__doc__)
  parser.add_argument('--list', action='store_true', required=True,
                      help='print each published name with its model, resolution, training '
                      'data and file')
  parser.parse_args(argv)
  print('\n'.join(published.listing()))
  return 0


if __name__ == '__main__':
  console.run(main)

"""Fine-tuning surgery: a checkpoint's parameters fitted to another model (`load_pretrained`).

Position embeddings are resized in 2-D to the new grid (`resize_posemb`), the patch-embedding
kernel to another patch size by the pseudo-inverse of the bilinear resize (FlexiViT's,
`resize_patch_kernel`), and the head is kept or started anew; shapes that still differ are one
`CheckpointError` line naming the parameter path with both shapes (`check_matches`). The
deprecated overrides file beside a checkpoint (`load_model_overrides`) is read here too.
"""
import json
import logging
import math
import os
from typing import Any, Optional

from flax import traverse_util
import numpy as np
import scipy.ndimage

from vit_jax.checkpoints import npz
from vit_jax.models import positions
from vit_jax import tasks


POSEMB_PATH = ('Transformer', 'posembed_input', 'pos_embedding')
PATCH_KERNEL_PATH = ('embedding', 'kernel')


# Spline orders of scipy.ndimage.zoom.
POSEMB_METHODS = {'bilinear': 1, 'bicubic': 3}


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
  with npz.open_file(model_overrides_path(os.fspath(path)), 'wb') as f:
    f.write(text.encode())


def load_model_overrides(path) -> dict[str, Any]:
  """The VisionTransformer fields recorded next to checkpoint `path` by `save_model_overrides`;
  {} when there is no such record (the published checkpoints have none)."""
  try:
    with npz.open_file(model_overrides_path(os.fspath(path)), 'rb') as f:
      overrides = json.loads(f.read())['model_overrides']
    if not isinstance(overrides, dict):
      raise TypeError(f'model_overrides is a {type(overrides).__name__}, not an object')
    return overrides
  except FileNotFoundError:
    return {}
  except (ValueError, KeyError, TypeError) as e:
    raise npz.CheckpointError(f'{model_overrides_path(os.fspath(path))} is not a model-overrides '
                          f'record ({e}); delete it or rewrite it with save_model_overrides.'
                          ) from None


def square_grid(num_tokens: int, what: str) -> tuple[int, int]:
  """(n, n) for num_tokens = n*n; a CheckpointError naming `what` otherwise."""
  side = math.isqrt(num_tokens)
  if side * side != num_tokens:
    raise npz.CheckpointError(f'{what}: {num_tokens} grid positions are not a square grid; '
                          'give the grid (rows, columns) explicitly.')
  return side, side


def _spline_order(method: str) -> int:
  """The scipy.ndimage.zoom spline order of a POSEMB_METHODS name."""
  if method not in POSEMB_METHODS:
    raise npz.CheckpointError(f'posemb_method={method!r}; choose one of {list(POSEMB_METHODS)}.')
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
    raise npz.CheckpointError(
        f'Position embeddings must have shape (1, tokens, D), not {posemb.shape}.')
  num_extra = 1 if has_class_token else 0
  extra, grid = posemb[:, :num_extra], posemb[0, num_extra:]
  source_hw = source_grid_hw or square_grid(len(grid), 'The position embeddings to resize')
  if math.prod(source_hw) != len(grid):
    raise npz.CheckpointError(f'source_grid_hw={tuple(source_hw)} does not hold the {len(grid)} '
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


def file_posemb(params: npz.Params, spec: Optional[dict]) -> Optional[str]:
  """The posemb kind (vit_jax.models.positions.POSEMB_KINDS) of a checkpoint: its saved spec's, else
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


def check_posemb(params: npz.Params, spec: Optional[dict], model, source: str) -> None:
  """Raises a CheckpointError, naming both kinds, unless the checkpoint's position embeddings
  are of the kind of `model.posemb`."""
  kind = file_posemb(params, spec)
  parameter_free = ('none', 'sincos_2d')
  if kind == model.posemb or (kind is None and model.posemb in parameter_free):
    return
  found = f'posemb={kind!r}' if kind else f'no position parameters (posemb in {parameter_free})'
  raise npz.CheckpointError(f'{source} has {found} but the model has posemb={model.posemb!r}: '
                        f'build the model with the checkpoint\'s kind (config.posemb).')


def file_grid(spec: Optional[dict], model) -> Optional[tuple[int, int]]:
  """The (rows, columns) of patches of the images a checkpoint was trained at, from the
  (height, width) its saved spec records (training runs record it) and the spec's patch size
  (`model`'s stem); None for a file that records none: its grid is then taken to be square."""
  if not spec or 'image_size' not in spec:
    return None
  patch = spec.get('model', {}).get('patch_size', model.patch_size)
  return tuple(side // (size * model.stem_stride) for side, size in zip(spec['image_size'], patch))


def _fit_positions(restored: dict, target: dict, model, *, grid: Optional[tuple[int, int]],
                   method: str, source_grid: Optional[tuple[int, int]] = None) -> dict:
  """`restored` (flat, per block) with its position parameters resized to those of `target`
  (shapes, flat, per block): learned_1d's with `resize_posemb` from `source_grid` (None:
  square) to `grid` (see `load_pretrained`), learned_2d's and relative's tables with
  `resize_table`."""
  restored = dict(restored)
  # Resized only when the file and the model agree on the class token; else _check_flat says.
  same_tokens = (('cls',) in restored) == model.has_class_token
  if POSEMB_PATH in restored and POSEMB_PATH in target and same_tokens:
    restored[POSEMB_PATH] = _fit_posemb(restored[POSEMB_PATH], target[POSEMB_PATH].shape,
                                        has_class_token=model.has_class_token, grid=grid,
                                        method=method, source_grid=source_grid)
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
    listed = '; '.join(problems[:npz.MAX_LISTED])
    more = f'; and {len(problems) - npz.MAX_LISTED} more' if len(problems) > npz.MAX_LISTED else ''
    raise npz.CheckpointError(
        f'{source} does not fit the model: {listed}{more}. Check that the model (name, '
        'classifier, representation_size, hybrid stem, image size) is the one of the checkpoint.')


def check_matches(params: npz.Params, reference: npz.Params, *, source: str) -> None:
  """Raises a CheckpointError unless `params` has the paths and shapes of `reference`.

  `reference` may hold arrays or jax.ShapeDtypeStructs (e.g. vit_jax.models.param_shapes).
  Either may be scanned: both are compared in the per-block layout. The message names `source`
  and every mismatching path with its shapes.
  """
  # Zero-stride stand-ins take no memory and, unlike ShapeDtypeStructs, can be unscanned.
  stand_ins = {p: np.broadcast_to(np.zeros((), x.dtype), x.shape)
               for p, x in traverse_util.flatten_dict(reference).items()}
  reference = npz.unscan_blocks(traverse_util.unflatten_dict(stand_ins))
  _check_flat(traverse_util.flatten_dict(npz.unscan_blocks(params)),
              traverse_util.flatten_dict(reference), source)


def _fit_posemb(posemb: np.ndarray, target_shape: tuple[int, ...], *, has_class_token: bool,
                grid: Optional[tuple[int, int]], method: str,
                source_grid: Optional[tuple[int, int]]) -> np.ndarray:
  """`posemb` of a grid `source_grid` (None: square) resized to the target's number of tokens
  on `grid`, or as it is when no resize applies."""
  num_extra = 1 if has_class_token else 0
  if grid is None:
    if posemb.shape == tuple(target_shape):
      return posemb
    grid = square_grid(target_shape[1] - num_extra, "The model's position embeddings")
  if math.prod(grid) + num_extra != target_shape[1]:
    raise npz.CheckpointError(f'grid={tuple(grid)} gives {math.prod(grid) + num_extra} position '
                          f'embeddings, but the model has {target_shape[1]}.')
  if posemb.ndim != 3 or posemb.shape[-1] != target_shape[-1]:
    return posemb  # Reported with both shapes by check_matches.
  return resize_posemb(posemb, grid, has_class_token=has_class_token, method=method,
                       source_grid_hw=source_grid)


def _fit_pretraining_params(restored: dict, target: dict, source: str) -> dict:
  """`restored` (flat) without the parameters a task adds (tasks.EXTRA_PARAM_PREFIXES, e.g.
  masked patch prediction's) that `target` lacks (fine-tuning a pre-trained model; logged), and
  with `target`'s fresh ones that it lacks (pre-training from a published model)."""
  extra = lambda path: path[0].startswith(tasks.EXTRA_PARAM_PREFIXES)
  dropped = sorted({p[0] for p in restored if extra(p) and p not in target})
  if dropped:
    logging.info('Dropped the pre-training parameters %s of %s: the model does not use them.',
                 ', '.join(dropped), source)
  fitted = {p: v for p, v in restored.items() if not (extra(p) and p not in target)}
  return {**{p: v for p, v in target.items() if extra(p) and p not in fitted}, **fitted}


def load_pretrained(path, init_params: npz.Params, model, *,
                    posemb_method: str = 'bilinear',
                    grid: Optional[tuple[int, int]] = None,
                    keep_head: bool = False) -> npz.Params:
  """The checkpoint at `path`, set up to fine-tune `model` (a VisionTransformer), freshly
  initialised as `init_params`.

  - `pre_logits` is dropped when `model.representation_size` is None;
  - `head` is replaced by the freshly initialised one of `init_params` (new classes), or, with
    `keep_head`, kept from the file (the same classes, e.g. continuing at a higher resolution);
  - the parameters that a task adds (vit_jax.tasks.EXTRA_PARAM_PREFIXES: masked patch
    prediction's `mpp_`) are dropped, with a log line, when `init_params` lacks them, and taken
    from it when the file does;
  - the position embeddings are resized with `resize_posemb` (class-token row kept when
    `model.has_class_token`) to `grid` = (rows, columns) of patches, by default the
    square grid of init_params's position embeddings. Pass `grid` for non-square images,
    e.g. (384 // 16, 512 // 16). The file's own grid is the one its spec records
    (`file_grid`: runs trained at (height, width) record it), else square. The tables of the
    other learned posemb kinds are resized to init_params's with `resize_table`: learned_2d's
    rows and columns each on its axis, relative's offsets; `none` and `sincos_2d` have nothing
    to resize;
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
  params, spec = npz.load_with_spec(source)
  check_posemb(params, spec, model, source)
  restored = traverse_util.flatten_dict(npz.unscan_blocks(params))
  target = traverse_util.flatten_dict(npz.unscan_blocks(init_params))
  if model.representation_size is None:
    restored = {p: v for p, v in restored.items() if p[0] != 'pre_logits'}
  if not keep_head:
    restored = {p: v for p, v in restored.items() if p[0] != 'head'}
    restored.update({p: v for p, v in target.items() if p[0] == 'head'})
  restored = _fit_pretraining_params(restored, target, source)
  restored = _fit_positions(restored, target, model, grid=grid, method=posemb_method,
                            source_grid=file_grid(spec, model))
  restored = _fit_patch_kernel(restored, target, model, source)
  _check_flat(restored, target, source)
  params = traverse_util.unflatten_dict(
      {p: np.asarray(restored[p], dtype=target[p].dtype) for p in target})
  return npz.scan_blocks(params) if npz.is_scanned(init_params) else params

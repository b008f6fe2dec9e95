"""A training run's files and the model in them.

`load_model(path_or_workdir)` rebuilds a model from the spec saved inside a `model.npz` (a run's
workdir stands for its `model.npz`, a published name for its downloaded file, `model_path`), or
from a registry name for files without one; `read_run_config` reads a run's `config.json`,
`saved_label_names` the class names a run recorded, and `trained_image_size` its image size.
"""
import json
import os
from typing import Optional

from flax import traverse_util
import ml_collections
import numpy as np

from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import published
from vit_jax.models import blank
from vit_jax.models import positions
from vit_jax.models import registry
from vit_jax import tasks
from vit_jax.tasks import supervised
from vit_jax.models.blank import ImageSize


WORKDIR_MODEL = 'model.npz'  # Where training writes the final params, in its workdir.
RUN_CONFIG = 'config.json'  # Where training saves its config, in its workdir.
CHECKPOINTS = 'checkpoints'  # The folder of its Orbax checkpoints there, one per step.


def model_path(path_or_workdir) -> str:
  """The .npz of `path_or_workdir`: the path itself, WORKDIR/model.npz for a folder, or the
  cached file of a published name (downloaded on first use, `published.fetch`)."""
  path = os.fspath(path_or_workdir)
  if published.is_name(path):
    return published.fetch(path)
  return os.path.join(path, WORKDIR_MODEL) if os.path.isdir(path) else path


def posemb_of(params: npz.Params) -> np.ndarray:
  """The position embeddings (1, T, D) of `params`; a CheckpointError if they have none."""
  try:
    return params['Transformer']['posembed_input']['pos_embedding']
  except KeyError:
    raise npz.CheckpointError('The checkpoint has no Transformer/posembed_input/'
                          'pos_embedding: it is not a ViT checkpoint.') from None


def native_image_size(params: npz.Params, model, spec: Optional[dict] = None) -> ImageSize:
  """The image size, in pixels, at which the checkpoint's position parameters (of
  `model.posemb`'s kind) form the grid: the (height, width) its saved `spec` records (training
  runs record theirs), a side where they are equal; else the side of the square grid of the
  parameters; one patch for the kinds without any (none, sincos_2d), which fit every grid."""
  if spec is not None and 'image_size' in spec:
    height, width = spec['image_size']
    return height if height == width else (height, width)
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
  side, _ = finetune.square_grid(num_patches, "The checkpoint's position embeddings "
                        '(pass --image_size)')
  return side * model.patch_pixels[0]


def model_for_params(name_or_config, params: npz.Params, overrides: dict):
  """The registry model (a name or a model config) with the classes and representation size of
  `params`, and the VisionTransformer fields `overrides`: for files without a model spec."""
  if 'head' not in params:
    raise npz.CheckpointError(
        'The checkpoint has no head/ parameters: it extracts features but does not classify.')
  pre_logits = params.get('pre_logits')
  return registry.get_model(
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
    raise npz.CheckpointError(
        f'{path}, the saved config of the run in {workdir}, is {why}: repair it, or delete it '
        "(the run's checkpoints stay; a rerun then saves its own config).")
  return config


def checkpoint_steps(workdir) -> list[int]:
  """The steps of the checkpoint folders in WORKDIR/checkpoints (complete or not), unsorted."""
  checkpoints = os.path.join(os.fspath(workdir), CHECKPOINTS)
  return [int(n) for n in os.listdir(checkpoints) if n.isdigit()] if os.path.isdir(
      checkpoints) else []


def unfinished_run(workdir) -> Optional[str]:
  """For a training workdir without its model.npz, a line saying that the run has not finished
  and how to finish it; None for anything else."""
  path = os.fspath(workdir)
  checkpoints = os.path.join(path, CHECKPOINTS)
  if (not os.path.isdir(path) or os.path.exists(os.path.join(path, WORKDIR_MODEL)) or
      not (os.path.isdir(checkpoints) or os.path.isfile(os.path.join(path, RUN_CONFIG)))):
    return None
  steps = checkpoint_steps(path)
  since = f' (it resumes from its checkpoint of step {max(steps)})' if steps else ''
  return (f'{path} holds a training run that has not finished: it has no {WORKDIR_MODEL} yet. '
          f'Finish it by running its training command again with --workdir={path}{since}, then '
          'try again.')


def saved_run_config(path_or_workdir) -> dict:
  """The config.json of the training run whose workdir is `path_or_workdir`; {} for a file, or
  a folder without one."""
  return (read_run_config(path_or_workdir) if os.path.isdir(path_or_workdir) else None) or {}


def _recorded_model_config(path_or_workdir) -> Optional[ml_collections.ConfigDict]:
  """`config.model` of the run whose workdir is `path_or_workdir`, from its config.json (runs
  of versions that saved no model spec); None for a file, or a folder without config.json."""
  config = saved_run_config(path_or_workdir)
  return ml_collections.ConfigDict(config['model']) if config else None


def load_model(path_or_workdir, model_name: Optional[str] = None, **overrides):
  """(model, params) of a saved model: an .npz file, or a training workdir (its model.npz).

  The model is the one of the spec saved in the file (`save`), as the objective it records
  wraps it (`tasks.saved_model`: e.g. a segmentation.SegmentationViT, whose output is logits
  per pixel); `overrides` set fields it leaves to the caller, e.g. `dtype=jnp.bfloat16`.
  `path_or_workdir` may be a published name (`published`), which also names the model. Another
  file without a spec (the published checkpoints, files of older versions) needs `model_name`, a
  registry name whose classes and representation size then follow the parameters, with the
  fields of a FILE.overrides.json next to it applied (deprecated: files now carry their spec);
  an older workdir's config.json also names it.
  Raises a CheckpointError, or FileNotFoundError, whose one line names the file and the fix.
  """
  if error := unfinished_run(path_or_workdir):
    raise FileNotFoundError(error)
  path = model_path(path_or_workdir)
  params, spec = npz.load_with_spec(path)
  if spec is None:
    name_or_config = (model_name or published.model_of(path_or_workdir) or
                      _recorded_model_config(path_or_workdir))
    if name_or_config is None:
      raise npz.CheckpointError(
          f'{path} holds no model spec (a published file, or one written before vit_jax saved '
          f'specs): name its model with --model NAME (one of {", ".join(registry.LISTED_MODELS)}).')
    model = model_for_params(name_or_config, params,
                             {**finetune.load_model_overrides(path), **overrides})
  elif model_name and spec.get('name') not in (None, model_name):
    raise npz.CheckpointError(f'{path} holds a {spec.get("name")} model (its saved spec), not '
                          f'{model_name}: leave out the model name.')
  else:
    try:
      model = tasks.saved_model(registry.model_from_spec(spec, **overrides), spec)
    except (ValueError, KeyError) as e:
      raise npz.CheckpointError(f'{path}: {e}') from None
  finetune.check_matches(
      params, registry.param_shapes(model, native_image_size(params, model, spec)), source=path)
  return model, params


def trained_image_size(path_or_workdir, params: npz.Params, model) -> ImageSize:
  """`native_image_size` of the saved model at `path_or_workdir` (as `load_model` takes it),
  with its `params` and `model`: the size its run recorded, else its position parameters'."""
  return native_image_size(params, model, npz.read_spec(model_path(path_or_workdir)))


def saved_label_names(path_or_workdir) -> Optional[list[str]]:
  """The class names, in label order, that a training run saved in the model spec of its
  model.npz (under 'label_names'); None for files without them: the published files, converted
  weights, files of versions that did not save them."""
  return saved_spec_field(path_or_workdir, 'label_names')


def saved_loss(path_or_workdir) -> str:
  """The config.loss a training run saved in the model spec of its model.npz (under 'loss'):
  'sigmoid_xent' or 'softmax_xent'; tasks.supervised.DEFAULT_LOSS for files without it (the
  published ImageNet-1k files, and files of versions that did not save it)."""
  return saved_spec_field(path_or_workdir, 'loss') or supervised.DEFAULT_LOSS


def saved_framing(path_or_workdir, trained_size: ImageSize,
                  image_size: ImageSize) -> Optional[int]:
  """The short side to resize an image to before taking its centre at `image_size`, as the run
  that made the model at `path_or_workdir` evaluated at `trained_size`: its config.pp.resize
  (model.npz records it), scaled as `image_size` is to `trained_size`; None to resize the whole
  image (runs without a resize, and other files)."""
  resize = saved_spec_field(path_or_workdir, 'resize')
  if not resize:
    return None
  return round(resize * min(blank.image_hw(image_size)) / min(blank.image_hw(trained_size)))


def saved_spec_field(path_or_workdir, field: str):
  """`field` of the model spec of the file (or workdir's model.npz); None where it holds none."""
  if published.is_name(os.fspath(path_or_workdir)):
    return None  # The published files hold no spec.
  spec = npz.read_spec(model_path(path_or_workdir))
  return None if spec is None else spec.get(field)

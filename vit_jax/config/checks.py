"""Config validation that needs no TensorFlow: the values, the mesh, the batches' split over the
devices, the model and the pretrained path; each failure a ConfigError of one line naming the
field and the fix.

`python -m vit_jax.main` runs these checks before it imports TensorFlow, so that a bad value is
reported within seconds; `trainer.train_and_evaluate` runs them for library callers, then checks
the dataset and its splits (`dataset_checks.check_data`, through tf.data), all before compiling.
"""
import logging
import math
import numbers
import os

import jax
import ml_collections
import numpy as np

from vit_jax.models import blank
from vit_jax.training import param_groups
from vit_jax import sharding
from vit_jax.checkpoints import published
from vit_jax.checkpoints import runs
from vit_jax.config import defaults
from vit_jax.config import fields
from vit_jax.data import image_files
from vit_jax.errors import ConfigError  # Re-exported: callers catch validation.ConfigError.
from vit_jax.models import attention
from vit_jax.models import encoder
from vit_jax.models import positions
from vit_jax.models import registry
from vit_jax import tasks


def data_parallel_size(config: ml_collections.ConfigDict, num_devices: int) -> int:
  """The size of the mesh's 'data' axis over `num_devices` devices."""
  return config.mesh.data if config.mesh.data != -1 else num_devices // config.mesh.model


def mesh_error(config: ml_collections.ConfigDict, num_devices: int) -> str | None:
  """Why `config.mesh` (with a positive `mesh.model`) does not cover `num_devices` devices, or
  None where it does."""
  data, model = config.mesh.data, config.mesh.model
  if data == -1 and num_devices % model:
    return (f'config.mesh.model={model} does not divide the {num_devices} devices: make it a '
            f'divisor of {num_devices}.')
  if data_parallel_size(config, num_devices) * model != num_devices:
    return (f'config.mesh data={data} x model={model} does not cover the {num_devices} devices: '
            f'make their product {num_devices} (data=-1 fills it in).')
  return None


def batch_split_error(config: ml_collections.ConfigDict, data_devices: int) -> str | None:
  """Why the batches (and micro-batches) of `config` do not split evenly over `data_devices`
  data-parallel devices, or None where they do; one sentence per batch that does not."""
  errors = []
  if config.accum_steps == 'auto':  # Chosen among the divisors of the batch per device.
    config = config.copy_and_resolve_references()
    with config.ignore_type():
      config.accum_steps = 1
  if config.batch % (data_devices * config.accum_steps):
    errors.append(f'config.batch={config.batch} is not divisible by {data_devices} data-parallel '
                  f'devices x config.accum_steps={config.accum_steps}: make it a multiple of '
                  f'{data_devices * config.accum_steps}.')
  if config.batch_eval % data_devices:
    errors.append(f'config.batch_eval={config.batch_eval} is not divisible by {data_devices} '
                  f'data-parallel devices: make it a multiple of {data_devices}.')
  return ' '.join(errors) or None


def fits_devices(config: ml_collections.ConfigDict, num_devices: int) -> bool:
  """Whether `config` can train on `num_devices` devices: its values are valid, its mesh covers
  them, and its batches split evenly over the data-parallel ones."""
  return (values_error(config) is None and mesh_error(config, num_devices) is None and
          batch_split_error(config, data_parallel_size(config, num_devices)) is None)


def field_at(config: ml_collections.ConfigDict, field: str, missing=None):
  """The value of dotted `field` ('pp.crop') in `config`; `missing` where a part is absent."""
  value = config
  for key in field.split('.'):
    if not isinstance(value, ml_collections.ConfigDict) or key not in value:
      return missing
    value = value[key]
  return value


def _bounds(allowed: fields.Range) -> str:
  """`allowed`'s bounds in words: 'greater than 0', '0 or more', 'in [0, 1)'."""
  low, high = allowed.low, allowed.high
  if high is None:
    return f'greater than {low}' if allowed.low_open else f'{low} or more'
  if low is None:
    return f'less than {high}' if allowed.high_open else f'{high} or less'
  return f'in {"[("[allowed.low_open]}{low}, {high}{"])"[allowed.high_open]}'


def _is_kind(value, kind: type) -> bool:
  """Whether `value` is a number of `kind`: an int (not a bool), or for float any real number."""
  return (not isinstance(value, bool) and
          isinstance(value, numbers.Integral if kind is int else numbers.Real))


def _in_range(value, allowed: fields.Range) -> bool:
  """Whether `value` is a finite number of `allowed.kind` within its bounds."""
  if not (_is_kind(value, allowed.kind) and math.isfinite(value)):
    return False
  low, high = allowed.low, allowed.high
  return ((low is None or (value > low if allowed.low_open else value >= low)) and
          (high is None or (value < high if allowed.high_open else value <= high)))


def _is_special(value, special) -> bool:
  """Whether `value` is the special value `special`: None, a word ('auto') or a number."""
  if special is None or isinstance(special, str):
    return value == special
  return _is_kind(value, float) and value == special


def range_error(field: str, value, allowed: fields.Range) -> str | None:
  """Why `value` of config `field` is not one `allowed` (vit_jax.config.FIELD_RANGES) takes, in
  one line, or None where it is."""
  special = [(v, meaning, _in_range(v, allowed)) for v, meaning in allowed.special]
  if _in_range(value, allowed) or any(_is_special(value, v) for v, _, _ in special):
    return None
  kind = '' if _is_kind(value, allowed.kind) else (
      'an integer ' if allowed.kind is int else 'a number ')
  notes = ''.join(f' ({v!r}: {meaning})' for v, meaning, inside in special if inside)
  options = [f'{v!r} ({meaning})' for v, meaning, inside in special if not inside]
  return (f'config.{field}={value!r} must be '
          f'{" or ".join(options + [kind + _bounds(allowed)])}{notes}.')


def values_error(config: ml_collections.ConfigDict) -> str | None:
  """Why a field value of `config` cannot work on any devices, or None where all can: first
  the type and range of each numeric field (vit_jax.config.FIELD_RANGES), then the objective
  and its task's fields (vit_jax.tasks.config_error), then the entries of config.evals
  (vit_jax.evaluators.config_error)."""
  absent = object()
  for field, allowed in fields.FIELD_RANGES.items():
    value = field_at(config, field, missing=absent)
    if value is not absent and (error := range_error(field, value, allowed)):
      return error
  if error := tasks.config_error(config):  # Before the evaluators: they ask the task.
    return error
  from vit_jax import evaluators  # Here: its evaluators import train_setup, which imports this.
  if error := evaluators.config_error(config):
    return error
  if error := randaug_error(config.pp.get('randaug')) or crop_error(config.pp.crop):
    return error
  for field, choices in (('optimizer', ('sgd', 'adamw')), ('decay_type', ('cosine', 'linear')),
                         ('loss', tuple(tasks.supervised.LOSSES)),
                         ('dtype', ('float32', 'bfloat16')), ('sharding', sharding.STRATEGIES),
                         ('remat_policy', (None,) + encoder.REMAT_POLICIES),
                         ('attention', ('auto',) + attention.ATTENTION_KERNELS),
                         ('posemb', positions.POSEMB_KINDS)):
    if config[field] not in choices:
      return f'config.{field}={config[field]!r} is not one of {choices}.'
  return None


def check_dataset_folder(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError where `config.dataset` can only be a folder and none is there: for `main`,
  before the run takes its workdir, so that a mistyped path leaves no folder behind (the plan of
  a run needs no data, and validate_config leaves the dataset to the data sources)."""
  if error := image_files.missing_folder(config.dataset):
    raise ConfigError(error)


def validate_config(config: ml_collections.ConfigDict, num_devices: int,
                    platform: str | None = None) -> None:
  """Raises ConfigError for a config that cannot train on `num_devices` devices of `platform`
  ('cpu', 'gpu', 'tpu'; default: JAX's default backend), before anything is compiled; first sets
  `config.model` to the model `config.model_name` names, where they differ (vit_jax.config), and
  moves the deprecated evaluation fields into config.evals (vit_jax.evaluators.migrate)."""
  check_pretrained_path(config)
  use_published_model(config)
  try:
    defaults.resolve_model(config)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if error := (values_error(config) or mesh_error(config, num_devices) or
               batch_split_error(config, data_parallel_size(config, num_devices))):
    raise ConfigError(error)
  from vit_jax import evaluators  # Here: its evaluators import train_setup, which imports this.
  evaluators.migrate(config)
  if error := attention.attention_error(config.attention, platform or jax.default_backend()):
    raise ConfigError(f'config.{error}')
  model = registry.get_model(config.model, num_classes=1)
  if error := encoder.stochastic_depth_error(model.stochastic_depth,
                                                model.stochastic_depth_schedule):
    raise ConfigError(f'config.model.transformer.{error}')
  step, crop = np.array(model.patch_pixels), np.array(blank.image_hw(config.pp.crop))
  if any(crop % step):
    fitting = tuple(int(side) for side in np.maximum(crop // step, 1) * step)
    raise ConfigError(
        f'config.pp.crop={config.pp.crop} is not divisible by the patch size '
        f'{step[0]}x{step[1]} of {config.model_name}: use e.g. '
        f'{fitting[0] if isinstance(config.pp.crop, int) else fitting}.')
  if param_groups.is_set(config):  # The parameter names (shapes only) their regexes select.
    named = model.clone(posemb=config.posemb, scan_layers=config.scan_layers)
    named = tasks.for_config(config).model(named, config)
    if error := param_groups.config_error(config, blank.param_shapes(named, config.pp.crop)):
      raise ConfigError(error)


def pretrained_file(config: ml_collections.ConfigDict) -> str:
  """The checkpoint file of `config.pretrained_path` (`runs.model_path`): the path itself,
  FOLDER/model.npz for a folder (a training workdir), or a published name's cached download."""
  try:
    return runs.model_path(config.pretrained_path)
  except published.PublishedError as e:
    raise ConfigError(f'config.pretrained_path: {e}') from None


def use_published_model(config: ml_collections.ConfigDict) -> None:
  """For `config.pretrained_path` naming a published checkpoint: makes its registry model the
  config's model where the config names no registry model (the default run's ViT-mini_7, a
  model of its own); a ConfigError where it names another one."""
  model_name = published.model_of(config.pretrained_path)
  if model_name is None or config.model_name == model_name:
    return
  if config.model_name in registry.MODEL_CONFIGS:
    raise ConfigError(f'config.pretrained_path={config.pretrained_path!r} holds a {model_name}, '
                      f'not the config\'s {config.model_name}: set --config.model_name='
                      f'{model_name}.')
  logging.info('config.model_name=%s: the model of %s.', model_name, config.pretrained_path)
  defaults.with_model(config, model_name)


def check_pretrained_path(config: ml_collections.ConfigDict) -> None:
  """Raises ConfigError unless `config.pretrained_path` is unset, a URL, a known published name,
  or leads to a file."""
  path = config.pretrained_path
  if not path or '://' in path:
    return
  if published.is_name(path):
    try:
      published.lookup(path)
    except published.PublishedError as e:
      raise ConfigError(f'config.pretrained_path: {e}') from None
    return
  if unfinished := runs.unfinished_run(path):
    raise ConfigError(f'config.pretrained_path: {unfinished}')
  if os.path.isdir(path) and not os.path.isfile(pretrained_file(config)):
    raise ConfigError(f'config.pretrained_path={path!r} is a folder without a model.npz: give '
                      'the path of a .npz checkpoint, or of a finished training workdir.')
  if not os.path.exists(path):
    raise ConfigError(f'config.pretrained_path={path!r} does not exist (relative paths start at '
                      f'{os.getcwd()}): give the path of a .npz checkpoint (published, or a '
                      'WORKDIR/model.npz) or of a training workdir'
                      f'{default_run_hint(path)}.')


def default_run_hint(path: str) -> str:
  """Where `path` is the default run's workdir (configs/finetune.py and configs/segmentation.py
  start from it), the words that say which command trains it; else ''."""
  from vit_jax.config import command_line  # It imports this module, and workdirs imports it:
  from vit_jax.training import workdirs  # at the call, not at this module's import.
  if os.path.normpath(path) != workdirs.default_workdir(command_line.DEFAULT_CONFIG):
    return ''
  return "; it is the default run's workdir: run `python -m vit_jax.main` here first"


def crop_error(crop) -> str | None:
  """Why `config.pp.crop` cannot work, or None: a side in pixels (square images) or (height,
  width), each an integer greater than 0."""
  sides = crop if isinstance(crop, (tuple, list)) else (crop,)
  if len(sides) in (1, 2) and all(_is_kind(side, int) and side > 0 for side in sides):
    return None
  return (f'config.pp.crop={crop!r} must be a side in pixels greater than 0 (e.g. 224) or '
          '(height, width), e.g. (224, 320).')


def randaug_error(randaug) -> str | None:
  """Why `config.pp.randaug` cannot work, or None: it is None (off) or (num_layers >= 0,
  0 <= magnitude <= 30)."""
  if randaug is None:
    return None
  if (not isinstance(randaug, (tuple, list)) or len(randaug) != 2 or
      not isinstance(randaug[0], int) or randaug[0] < 0 or
      not isinstance(randaug[1], (int, float)) or not 0 <= randaug[1] <= 30):
    return (f'config.pp.randaug={randaug!r} must be None (off) or (num_layers, magnitude) with '
            'num_layers >= 0 and magnitude in [0, 30], e.g. (2, 10).')
  return None

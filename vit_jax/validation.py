"""Config validation that needs no TensorFlow: the values, the mesh, the batches' split over the
devices, the model and the pretrained path; each failure a ConfigError of one line naming the
field and the fix.

`python -m vit_jax.main` runs these checks before it imports TensorFlow, so that a bad value is
reported within seconds; `train.train_and_evaluate` runs them for library callers, then checks
the dataset and its splits (`train.check_data`, through tf.data), all before compiling.
"""
import functools
import logging
import os

import ml_collections
import numpy as np

from vit_jax import checkpoint
from vit_jax import config as defaults
from vit_jax import models
from vit_jax import models_vit
from vit_jax import mpp
from vit_jax import positions
from vit_jax import published
from vit_jax import registry
from vit_jax import sharding


class ConfigError(ValueError):
  """A config value that cannot work; the message is one line naming the field and the fix."""


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


# Fields that count (steps, examples, devices) or scale something, so must be above 0.
POSITIVE_FIELDS = ('total_steps', 'batch', 'batch_eval', 'accum_steps', 'progress_every',
                   'eval_every', 'checkpoint_every', 'base_lr', 'mesh.model', 'pp.crop',
                   'shuffle_buffer')


def values_error(config: ml_collections.ConfigDict) -> str | None:
  """Why a field value of `config` cannot work on any devices, or None where all can."""
  if not (config.accum_steps == 'auto' or isinstance(config.accum_steps, int)):
    return (f'config.accum_steps={config.accum_steps!r} must be a number of micro-batches, '
            "e.g. 4, or 'auto'.")
  for field in POSITIVE_FIELDS:
    value = functools.reduce(getattr, field.split('.'), config)
    if value == 'auto':
      continue
    if not value > 0:
      return f'config.{field}={value!r} must be greater than 0.'
  if config.mesh.data != -1 and config.mesh.data < 1:
    return (f'config.mesh.data={config.mesh.data} must be -1 (all the devices that '
            'config.mesh.model leaves) or greater than 0.')
  if config.val_every is not None and config.val_every < 1:
    return f'config.val_every={config.val_every} must be None (eval_every) or greater than 0.'
  for field in ('every', 'num_test'):
    if config.fewshot[field] is not None and config.fewshot[field] < 1:
      return f'config.fewshot.{field}={config.fewshot[field]} must be None or greater than 0.'
  if config.fewshot.datasets and not (config.fewshot.seeds > 0 and config.fewshot.shots and
                                      min(config.fewshot.shots) > 0):
    return (f'config.fewshot.shots={tuple(config.fewshot.shots)} and config.fewshot.seeds='
            f'{config.fewshot.seeds} must be positive, e.g. (5, 10) and 1.')
  if config.warmup_steps < 0:
    return f'config.warmup_steps={config.warmup_steps} must be 0 or more.'
  if error := randaug_error(config.pp.get('randaug')):
    return error
  if not config.mixup.p >= 0:
    return f'config.mixup.p={config.mixup.p!r} must be 0 (off) or more, e.g. 0.2.'
  if not 0 <= config.ema_decay < 1:
    return (f'config.ema_decay={config.ema_decay!r} must be in [0, 1), e.g. 0.9998 '
            '(0: no EMA of the weights).')
  if error := mpp.config_error(config):
    return error
  for field, choices in (('optimizer', ('sgd', 'adamw')), ('decay_type', ('cosine', 'linear')),
                         ('dtype', ('float32', 'bfloat16')), ('sharding', sharding.STRATEGIES),
                         ('remat_policy', (None,) + models_vit.REMAT_POLICIES),
                         ('attention', ('auto',) + models_vit.ATTENTION_KERNELS),
                         ('posemb', positions.POSEMB_KINDS)):
    if config[field] not in choices:
      return f'config.{field}={config[field]!r} is not one of {choices}.'
  return None


def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Raises ConfigError for a config that cannot train, before anything is compiled; first sets
  `config.model` to the model `config.model_name` names, where they differ (vit_jax.config)."""
  check_pretrained_path(config)
  use_published_model(config)
  try:
    defaults.resolve_model(config)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if error := (values_error(config) or mesh_error(config, num_devices) or
               batch_split_error(config, data_parallel_size(config, num_devices))):
    raise ConfigError(error)
  model = models.get_model(config.model, num_classes=1)
  if error := models_vit.stochastic_depth_error(model.stochastic_depth,
                                                model.stochastic_depth_schedule):
    raise ConfigError(f'config.model.transformer.{error}')
  step = np.array(model.patch_pixels)
  if any(config.pp.crop % step):
    raise ConfigError(
        f'config.pp.crop={config.pp.crop} is not divisible by the patch size '
        f'{step[0]}x{step[1]} of {config.model_name}: use e.g. '
        f'{max(config.pp.crop // step[0], 1) * step[0]}.')


def pretrained_file(config: ml_collections.ConfigDict) -> str:
  """The checkpoint file of `config.pretrained_path` (`checkpoint.model_path`): the path itself,
  FOLDER/model.npz for a folder (a training workdir), or a published name's cached download."""
  try:
    return checkpoint.model_path(config.pretrained_path)
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
  if os.path.isdir(path) and not os.path.isfile(pretrained_file(config)):
    raise ConfigError(f'config.pretrained_path={path!r} is a folder without a model.npz: give '
                      'the path of a .npz checkpoint, or of a finished training workdir.')
  if not os.path.exists(path):
    raise ConfigError(f'config.pretrained_path={path!r} does not exist: give the path of a .npz '
                      'checkpoint (published, or a WORKDIR/model.npz) or of a training workdir.')


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

"""Tests of the objectives as tasks (vit_jax/tasks/): the registry, each task's loss and
evaluation step on a tiny model, the parameters a task adds, and the unknown objective."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import images_of
from helpers import random_params
from helpers import tiny_config
from helpers import tiny_vit
from vit_jax import tasks
from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.config import checks
from vit_jax.models import blank


def tiny_run(objective, **overrides):
  """(the task of `objective`, its model around the helpers' tiny ViT of 5 classes, the
  config)."""
  config = tiny_config(objective=objective, **overrides)
  task = tasks.get(objective)
  return task, task.model(tiny_vit(), config), config


def test_the_registry_lists_the_objectives_and_their_evaluators():
  assert tasks.OBJECTIVES == ('supervised', 'masked_patch_prediction', 'segmentation')
  assert {name: task.evaluator for name, task in tasks.TASKS.items()} == {
      'supervised': 'classification', 'masked_patch_prediction': 'mpp',
      'segmentation': 'segmentation'}
  assert tasks.for_config(tiny_config()) is tasks.get('supervised')
  assert tasks.get('supervised').needs_labels
  assert not tasks.get('masked_patch_prediction').needs_labels


def test_the_supervised_loss_is_the_smoothed_cross_entropy_of_the_labels():
  task, model, config = tiny_run('supervised', label_smoothing=0.1)
  assert model == tiny_vit()  # The ViT as it is.
  params = random_params(model, 16, scale=0.3)
  batch = {'image': jnp.asarray(images_of()), 'label': jnp.array([1, 4])}
  loss, metrics = jax.jit(task.train_loss(model, config))(params, batch, jax.random.key(0))
  logits = np.asarray(model.apply({'params': params}, batch['image'], train=False), np.float64)
  log_probs = logits - np.log(np.sum(np.exp(logits), axis=1, keepdims=True))
  targets = np.full((2, 5), 0.1 / 5) + 0.9 * np.eye(5)[[1, 4]]
  np.testing.assert_allclose(loss, -np.mean(np.sum(targets * log_probs, axis=1)), rtol=1e-5)
  assert metrics == {}


def test_the_mpp_loss_reads_the_images_only():
  task, model, config = tiny_run('masked_patch_prediction')
  params = blank.init_params(model, jax.random.key(0), 16)
  batch = {'image': jnp.asarray(images_of())}  # No labels.
  loss, metrics = jax.jit(task.train_loss(model, config))(params, batch, jax.random.key(1))
  np.testing.assert_allclose(loss, np.log(512), rtol=1e-5)  # The zero head: uniform colours.
  assert list(metrics) == ['mpp_accuracy'] and 0 <= metrics['mpp_accuracy'] <= 1


@pytest.mark.parametrize('objective, metrics', [
    ('supervised', ['correct', 'count', 'loss']),
    ('masked_patch_prediction', ['count', 'mpp_accuracy', 'mpp_loss'])])
def test_each_eval_step_sums_over_the_unmasked_examples(objective, metrics):
  task, model, config = tiny_run(objective)
  params = blank.init_params(model, jax.random.key(0), 16)
  batch = {'image': jnp.asarray(images_of(batch=3)), 'label': jnp.array([0, 1, 2]),
           'mask': jnp.array([1, 1, 0])}
  sums = jax.jit(task.eval_step(model, config))(params, batch)
  assert sorted(sums) == metrics and sums['count'] == 2


def test_mpp_adds_exactly_its_prefixed_params_and_fine_tuning_drops_them(tmp_path):
  task, model, _ = tiny_run('masked_patch_prediction')
  pretrained = random_params(model, 16)
  supervised = blank.param_shapes(tiny_vit(), 16)
  added = set(pretrained) - set(supervised)
  assert added == {'mpp_head', 'mpp_mask_embedding'} and set(supervised) < set(pretrained)
  assert task.extra_param_prefixes == ('mpp_',)
  assert tasks.get('supervised').extra_param_prefixes == ()
  assert all(name.startswith(task.extra_param_prefixes) for name in added)

  path = str(tmp_path / 'pretrained.npz')
  npz.save(pretrained, path)
  fresh = jax.device_get(blank.init_params(tiny_vit(), jax.random.key(0), 16))
  loaded = finetune.load_pretrained(path, fresh, tiny_vit())
  assert set(loaded) == set(supervised)
  np.testing.assert_array_equal(loaded['embedding']['kernel'], pretrained['embedding']['kernel'])


def test_an_unknown_objective_is_a_one_line_error():
  message = ("config.objective='mpp' is not one of ('supervised', 'masked_patch_prediction', "
             "'segmentation').")
  assert tasks.config_error(tiny_config(objective='mpp')) == message
  with pytest.raises(ValueError, match=re.escape(message)):
    tasks.get('mpp')
  # What `python -m vit_jax.main` prints after 'Config error: '.
  with pytest.raises(checks.ConfigError, match=re.escape(message)) as error:
    checks.validate_config(tiny_config(objective='mpp'), 1)
  assert str(error.value) == message

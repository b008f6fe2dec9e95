"""Tests of the exponential moving average of the weights (config.ema_decay): train state, step,
checkpoints, evaluation and the exported model.npz / model_raw.npz."""
import logging
import os

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import optax
import pytest

from helpers import tiny_config
from vit_jax import sharding
from vit_jax.checkpoints import runs
from vit_jax.config import checks
from vit_jax.training import state_checkpoints
from vit_jax.training import step as train_step
from vit_jax.training import trainer

pytestmark = pytest.mark.xdist_group('ema')  # Its module fixtures are built once.


def one_device_mesh():
  return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))


def random_batch(size=8, seed=0):
  images = jax.random.uniform(jax.random.key(seed), (size, 28, 28, 3), minval=-1, maxval=1)
  return {'image': images, 'label': jnp.arange(size) % 10}


def state_and_step(config, mesh, optimizer=None):
  """(initial state, its shardings, jitted step) of the tiny model under `config`."""
  model = trainer.build_model(config, num_classes=10)
  optimizer = optimizer or train_step.make_optimizer(config)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh, config.pp.crop)
  return state, shardings, train_step.jit_train_step(model, optimizer, config, mesh, shardings)


def test_ema_of_unchanging_params_approaches_them_as_the_closed_form():
  # Zero updates keep the params p; an EMA started at 0 is then p * (1 - decay^n) after n steps.
  frozen = optax.set_to_zero()
  optimizer = train_step.Optimizer(frozen.init, frozen.update, optax.constant_schedule(0.0))
  state, _, step = state_and_step(tiny_config(ema_decay=0.8), one_device_mesh(), optimizer)
  params = jax.device_get(state.params)
  state = state.replace(ema=jax.tree.map(jnp.zeros_like, state.ema))
  for _ in range(5):
    state, _ = step(state, random_batch())
  jax.tree.map(lambda e, p: np.testing.assert_allclose(e, p * (1 - 0.8**5), rtol=1e-5, atol=1e-7),
               jax.device_get(state.ema), params)


def test_decay_0_keeps_no_ema_and_an_ema_at_decay_0_is_the_params():
  config = tiny_config(ema_decay=0.0, warmup_steps=0)
  state, _, _ = state_and_step(config, one_device_mesh())
  assert state.ema is None
  config_step = train_step.make_train_step(trainer.build_model(config, num_classes=10),
                                           train_step.make_optimizer(config), config)
  with_ema = state.replace(ema=jax.tree.map(jnp.zeros_like, state.params))
  new, _ = jax.jit(config_step)(with_ema, random_batch())
  jax.tree.map(np.testing.assert_array_equal, new.ema, new.params)
  assert optax.tree.norm(jax.tree.map(jnp.subtract, new.params, state.params)) > 0


def test_ema_is_laid_out_as_the_params():
  mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ('data', 'model'))
  config = tiny_config(ema_decay=0.9, sharding='fsdp+tensor')
  config.model.hidden_size = 64  # Big enough for FSDP to split the kernels.
  state, shardings, _ = state_and_step(config, mesh)
  assert jax.tree.map(lambda s: s.spec, shardings.ema) == jax.tree.map(lambda s: s.spec,
                                                                        shardings.params)
  assert any(s.spec != () for s in jax.tree.leaves(shardings.ema))
  assert jax.tree.map(lambda x: x.sharding, state.ema) == shardings.params
  assert sharding.bytes_per_device(state.ema) == sharding.bytes_per_device(state.params)


@pytest.fixture(scope='module')
def stepped(tmp_path_factory):
  """(config, state after 3 AdamW steps with an EMA, shardings, checkpoint folder of step 3)."""
  config = tiny_config(ema_decay=0.5)
  mesh = one_device_mesh()
  state, shardings, step = state_and_step(config, mesh)
  for seed in range(3):
    state, _ = step(state, random_batch(seed=seed))
  workdir = str(tmp_path_factory.mktemp('ema_checkpoints'))
  checkpoints = state_checkpoints.Checkpoints(workdir, keep=2)
  checkpoints.save(state, {'position': 3})
  checkpoints.close()
  return config, jax.device_get(state), mesh, workdir


def fresh_state(config, mesh):
  state, shardings, _ = state_and_step(config, mesh)
  return state, shardings


def test_resume_restores_the_ema_exactly(stepped):
  config, saved, mesh, workdir = stepped
  assert not np.allclose(saved.ema['head']['bias'], saved.params['head']['bias'])
  checkpoints = state_checkpoints.Checkpoints(workdir, keep=2)
  restored, data = checkpoints.restore(*fresh_state(config, mesh))
  checkpoints.close()
  assert data == {'position': 3} and int(restored.step) == 3
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.ema), saved.ema)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.params), saved.params)


def test_a_checkpoint_without_ema_resumes_with_one_started_from_its_params(stepped, tmp_path,
                                                                          caplog):
  config, saved, mesh, _ = stepped
  fresh = fresh_state(config, mesh)
  checkpoints = state_checkpoints.Checkpoints(str(tmp_path), keep=2)
  checkpoints.save(jax.device_put(saved.replace(ema=None)), {'position': 3})  # EMA off.
  with caplog.at_level(logging.WARNING):  # At once: the save may still be in progress.
    restored, _ = checkpoints.restore(*fresh)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored.ema), saved.params)
  assert 'holds no EMA of the params' in caplog.text
  # And back: a run with config.ema_decay=0 drops the EMA it finds.
  off, _ = checkpoints.restore(*fresh_state(tiny_config(ema_decay=0.0), mesh))
  checkpoints.close()
  assert off.ema is None
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(off.params), saved.params)


@pytest.mark.parametrize('decay', [1.0, -0.1, 1.5])
def test_an_ema_decay_outside_0_1_is_a_one_line_config_error(decay):
  with pytest.raises(checks.ConfigError,
                     match=r'^config.ema_decay=.* must be in \[0, 1\)') as e:
    checks.validate_config(tiny_config(ema_decay=decay), jax.device_count())
  assert '\n' not in str(e.value)


def test_run_with_ema_reports_both_and_exports_the_ema_as_model_npz(tmp_path):
  config = tiny_config(ema_decay=0.7, total_steps=6, eval_every=6, checkpoint_every=6,
                       progress_every=3, test_split='test[:500]')
  config.model.transformer.stochastic_depth = 0.1  # Its config path, and its spec in model.npz.
  metrics = trainer.train_and_evaluate(config, str(tmp_path))
  ema_model, ema_params = runs.load_model(str(tmp_path))  # The workdir's model.npz.
  raw_model, raw_params = runs.load_model(str(tmp_path / 'model_raw.npz'))
  assert ema_model == raw_model and ema_model.stochastic_depth == 0.1
  assert not np.allclose(ema_params['head']['kernel'], raw_params['head']['kernel'])
  # Each file, evaluated on its own, gives the accuracy the run reported for it.
  eval_step = jax.jit(trainer.make_eval_step(ema_model))
  mesh = trainer.make_mesh(config)
  for params, name in ((ema_params, 'test_accuracy_ema'), (raw_params, 'test_accuracy')):
    measured = trainer.evaluate(eval_step, params, config, mesh)['test_accuracy']
    assert measured == pytest.approx(metrics[name], abs=1e-6)
  assert os.path.exists(tmp_path / 'checkpoints' / '6')

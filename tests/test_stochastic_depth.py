"""Tests of stochastic depth (vit_jax/models/vit.py): per-example drops of the residual branches."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
import tiny_config as tiny_config_file
from vit_jax.checkpoints import npz
from vit_jax.config import checks
from vit_jax.models import registry
from vit_jax.models import encoder
from vit_jax.models import vit
from vit_jax.training import resume

# 4x4 images in 4x4 patches: one patch and the class token, so that big batches stay cheap.
TINY = dict(num_classes=3, patch_size=(4, 4), hidden_size=8, mlp_dim=16, num_heads=2,
            num_layers=2)


def tiny_vit(**overrides):
  return vit.VisionTransformer(**{**TINY, **overrides})


def images(batch, seed=0):
  return jax.random.uniform(jax.random.key(seed), (batch, 4, 4, 3), minval=-1, maxval=1)


def random_params(model, seed=0):
  """Params of `model` with every leaf drawn from N(0, 0.5^2): posemb and cls nonzero. Drawn in
  numpy from the shapes: nothing is compiled."""
  return helpers.random_params(model, image_size=4, seed=seed, scale=0.5)


@functools.partial(jax.jit, static_argnames=('model', 'train'))
def jitted_features(model, params, x, rng, train):
  return model.apply({'params': params}, x, train=train, method='features', rngs={'dropout': rng})


def features(model, params, x, train, seed=0):
  """The model's features (B, D) of images `x`, with dropout keys from `seed`."""
  return np.asarray(jitted_features(model, params, x, jax.random.key(seed), train=train))


def without_blocks(params, keep=0):
  """`params` of the unscanned model with only its first `keep` blocks."""
  flat = dict(params)
  transformer = {k: v for k, v in params['Transformer'].items()
                 if not k.startswith('encoderblock') or int(k.split('_')[1]) < keep}
  flat['Transformer'] = transformer
  return flat


def test_linear_rates_rise_from_zero_at_the_first_block_to_the_rate_at_the_last():
  np.testing.assert_allclose(encoder.stochastic_depth_rates(0.3, 4, 'linear'),
                             [0.0, 0.1, 0.2, 0.3])
  assert encoder.stochastic_depth_rates(0.2, 3, 'uniform') == (0.2, 0.2, 0.2)
  assert encoder.stochastic_depth_rates(0.2, 1, 'linear') == (0.2,)  # First and last.


def test_drop_path_zeroes_a_fraction_rate_of_the_examples_and_keeps_the_expected_value():
  branch = jnp.ones((20_000, 3, 2))
  dropped = np.asarray(encoder.drop_path(branch, 0.3, jax.random.key(0)))
  per_example = dropped.reshape(len(dropped), -1)
  assert np.all(per_example == per_example[:, :1])  # Whole examples, not elements.
  zeroed = per_example[:, 0] == 0
  assert abs(zeroed.mean() - 0.3) < 0.02
  np.testing.assert_allclose(per_example[~zeroed], 1 / 0.7, rtol=1e-6)
  assert abs(dropped.mean() - 1.0) < 0.03  # The expected residual scale is 1.
  np.testing.assert_array_equal(encoder.drop_path(branch, 0.0, jax.random.key(0)), branch)


def test_drop_path_at_rate_1_gives_zeros_and_finite_gradients():
  branch = jnp.ones((4, 3))
  assert not np.asarray(encoder.drop_path(branch, 1.0, jax.random.key(0))).any()
  grads = jax.grad(lambda b: encoder.drop_path(b, 1.0, jax.random.key(0)).sum())(branch)
  np.testing.assert_array_equal(grads, 0.0)


@pytest.mark.parametrize('scan', [False, True])
def test_rate_1_on_every_block_makes_the_blocks_the_identity_in_training_only(scan):
  model = tiny_vit(stochastic_depth=1.0, stochastic_depth_schedule='uniform')
  params = random_params(model)
  x = images(8)
  # The reference: the same model without blocks (position embeddings and final LayerNorm).
  no_blocks = features(model.clone(num_layers=0), without_blocks(params), x, train=False)
  run = model.clone(scan_layers=scan)
  run_params = npz.scan_blocks(params) if scan else params
  np.testing.assert_allclose(features(run, run_params, x, train=True), no_blocks, atol=1e-6)
  at_eval = features(run, run_params, x, train=False)
  np.testing.assert_allclose(at_eval, features(model.clone(stochastic_depth=0.0), params, x,
                                               train=False), atol=1e-6)
  assert np.abs(at_eval - no_blocks).max() > 0.1


@pytest.mark.parametrize('scan', [False, True])
def test_linear_rates_keep_the_first_block_and_drop_the_last_at_rate_1(scan):
  model = tiny_vit(stochastic_depth=1.0, scan_layers=scan)  # Rates (0, 1) over the 2 blocks.
  params = random_params(model.clone(scan_layers=False))
  x = images(8)
  first_block_only = features(tiny_vit(num_layers=1), without_blocks(params, keep=1), x,
                              train=False)
  run_params = npz.scan_blocks(params) if scan else params
  np.testing.assert_allclose(features(model, run_params, x, train=True), first_block_only,
                             atol=1e-5)


def test_each_example_drops_both_branches_of_a_block_with_probability_rate_squared():
  model = tiny_vit(num_layers=1, stochastic_depth=0.5)
  params = random_params(model)
  x = images(4000)
  no_blocks = features(model.clone(num_layers=0), without_blocks(params), x, train=False)
  trained = features(model, params, x, train=True)
  identity = np.all(np.isclose(trained, no_blocks, atol=1e-6), axis=1)
  assert abs(identity.mean() - 0.25) < 0.04  # Attention and MLP branches drop independently.


def test_scanned_and_rematerialised_blocks_give_the_same_loss_and_gradients():
  model = tiny_vit(num_layers=3, stochastic_depth=0.5, dropout_rate=0.1, scan_layers=True)
  params = npz.scan_blocks(random_params(model.clone(scan_layers=False)))
  x = images(16)

  def loss_and_grads(run):
    loss = lambda p: jnp.sum(run.apply({'params': p}, x, train=True, method='features',
                                       rngs={'dropout': jax.random.key(3)}) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)

  plain, remat = loss_and_grads(model), loss_and_grads(model.clone(remat_policy='nothing_saveable'))
  np.testing.assert_allclose(plain[0], remat[0], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(plain[1]), jax.tree.leaves(remat[1])):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_dropout_still_applies_alongside_stochastic_depth_and_both_are_off_at_evaluation():
  model = tiny_vit(stochastic_depth=0.2, dropout_rate=0.3)
  params = random_params(model)
  x = images(8)
  # Rate 0.2 on the last of two blocks; dropout alone then changes every example.
  only_dropout = model.clone(stochastic_depth=0.0)
  a, b = features(only_dropout, params, x, True, seed=0), features(only_dropout, params, x, True, 1)
  assert np.all(np.abs(a - b).max(axis=1) > 1e-3)
  np.testing.assert_array_equal(features(model, params, x, train=False),
                                features(tiny_vit(), params, x, train=False))


def test_stochastic_depth_adds_no_params_and_travels_in_the_model_spec():
  plain, dropped = tiny_vit(), tiny_vit(stochastic_depth=0.1, stochastic_depth_schedule='uniform')
  shapes = lambda m: jax.tree.map(lambda s: s.shape, registry.param_shapes(m, image_size=4))
  assert shapes(plain) == shapes(dropped)
  spec = registry.model_spec(dropped, 'tiny')
  assert spec['model']['stochastic_depth'] == 0.1
  assert registry.model_from_spec(spec) == dropped
  older = {'name': 'tiny', 'model': {k: v for k, v in registry.model_spec(plain)['model'].items()
                                     if not k.startswith('stochastic_depth')}}
  assert registry.model_from_spec(older).stochastic_depth == 0.0


@pytest.mark.parametrize('fields, message', [
    (dict(stochastic_depth=1.5), r'^stochastic_depth=1.5 must be a drop rate in \[0, 1\]'),
    (dict(stochastic_depth_schedule='cubic'), "^stochastic_depth_schedule='cubic'; choose one"),
])
def test_bad_stochastic_depth_is_one_line_naming_the_field(fields, message):
  with pytest.raises(ValueError, match=message) as e:
    tiny_vit(**fields).init(jax.random.key(0), images(1), train=False)
  assert '\n' not in str(e.value)


def test_a_bad_rate_in_the_config_is_a_config_error_naming_its_field():
  config = tiny_config_file.get_config()
  config.model.transformer.stochastic_depth = -0.1
  with pytest.raises(checks.ConfigError,
                     match=r'^config.model.transformer.stochastic_depth=-0.1 '):
    checks.validate_config(config, jax.device_count())


def test_a_run_saved_before_stochastic_depth_resumes_without_it(tmp_path):
  config = tiny_config_file.get_config()
  resume.write_config(config, str(tmp_path))
  saved = json.loads((tmp_path / 'config.json').read_text())
  for field in ('stochastic_depth', 'stochastic_depth_schedule'):
    del saved['model']['transformer'][field]  # As an older version wrote it.
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  assert resume.resume_mismatches(config, str(tmp_path)) == []
  config.model.transformer.stochastic_depth = 0.1
  assert resume.resume_mismatches(config, str(tmp_path)) == [
      'model.transformer.stochastic_depth (saved 0.0, now 0.1)']


def test_the_registry_holds_the_one_default_of_each_transformer_field(monkeypatch):
  # The registry's configs, the model built from a config without the field (an older run's
  # config.json) and the value a resumed run assumes for it all read registry.TRANSFORMER_DEFAULTS.
  monkeypatch.setitem(registry.TRANSFORMER_DEFAULTS, 'stochastic_depth_schedule', 'uniform')
  config = registry.vit('tiny', patch=4, hidden=8, mlp=16, heads=2, layers=2)
  assert config.transformer.stochastic_depth_schedule == 'uniform'
  del config.transformer['stochastic_depth_schedule']
  assert registry.model_kwargs(config)['stochastic_depth_schedule'] == 'uniform'
  assert resume.added_field_defaults()['model.transformer.stochastic_depth_schedule'] == 'uniform'
  assert resume.added_field_defaults()['posemb'] == 'learned_1d'

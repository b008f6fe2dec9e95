"""Tests of the parameter layouts, vit_jax/sharding.py, on 8 simulated devices."""
import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import models as model_configs
from vit_jax import input_pipeline
from vit_jax import sharding
from vit_jax import train
import tiny_config


def config_for(strategy, mesh_model=1):
  config = tiny_config.get_config()
  config.model = model_configs.vit('small', patch=7, hidden=128, mlp=512, heads=4, layers=2)
  config.sharding = strategy
  config.mesh.model = mesh_model
  return config


def specs_of(strategy, mesh_model=1):
  config = config_for(strategy, mesh_model)
  mesh = train.make_mesh(config)
  model = train.build_model(config, num_classes=10)
  optimizer = train.make_optimizer(config)
  state = jax.eval_shape(lambda: train.create_train_state(config, model, optimizer, mesh, 28)[0])
  shardings = sharding.state_shardings(state, sharding.param_axes(model, 28), mesh, strategy,
                                       config.logical_axis_rules)
  return jax.tree.map(lambda s: s.spec, shardings.params), shardings


def test_data_replicates_everything():
  specs, _ = specs_of('data')
  assert set(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))) == {P()}


def test_fsdp_splits_the_largest_divisible_dimension_of_large_tensors():
  specs, _ = specs_of('fsdp')
  block = specs['Transformer']['encoderblock_0']
  assert block['MultiHeadDotProductAttention_0']['query']['kernel'] == P('data')
  assert block['MlpBlock_0']['Dense_0']['kernel'] == P(None, 'data')
  assert block['MlpBlock_0']['Dense_1']['kernel'] == P('data')
  assert block['LayerNorm_0']['scale'] == P()  # Small: replicated.


def test_tensor_splits_heads_and_mlp_over_the_model_axis():
  specs, _ = specs_of('tensor', mesh_model=2)
  block = specs['Transformer']['encoderblock_1']
  attention = block['MultiHeadDotProductAttention_0']
  assert attention['key']['kernel'] == P(None, 'model')
  assert attention['out']['kernel'] == P('model')
  assert block['MlpBlock_0']['Dense_0']['kernel'] == P(None, 'model')
  assert block['MlpBlock_0']['Dense_1']['kernel'] == P('model')
  assert specs['embedding']['kernel'] == P()


def test_fsdp_and_tensor_combine_on_a_2d_mesh():
  specs, shardings = specs_of('fsdp+tensor', mesh_model=2)
  attention = specs['Transformer']['encoderblock_0']['MultiHeadDotProductAttention_0']
  assert attention['query']['kernel'] == P('data', 'model')
  # The optimiser state follows its parameter.
  mu = shardings.opt_state[1][0].mu
  assert mu['Transformer']['encoderblock_0']['MultiHeadDotProductAttention_0']['query'][
      'kernel'].spec == P('data', 'model')


def test_unknown_strategy_is_a_clear_error():
  with pytest.raises(ValueError, match=r"config.sharding='zero3' is not one of \('data', 'fsdp'"):
    sharding.state_shardings({}, {}, train.make_mesh(config_for('data')), 'zero3')


@functools.cache
def loss_curve_and_state(strategy, mesh_model=1, steps=3):
  """Losses of the first `steps` steps under `strategy`, and the state after them."""
  config = config_for(strategy, mesh_model)
  mesh = train.make_mesh(config)
  model = train.build_model(config, num_classes=10)
  optimizer = train.make_optimizer(config)
  state, shardings = train.create_train_state(config, model, optimizer, mesh, 28)
  step = train.jit_train_step(model, optimizer, config, mesh, shardings)
  batches = input_pipeline.get_train_iterator(config, mesh)
  losses = []
  for _ in range(steps):
    state, metrics = step(state, next(batches))
    losses.append(float(metrics['train_loss']))
  return losses, state


def test_the_same_loss_curve_under_every_strategy():
  reference, _ = loss_curve_and_state('data')
  for strategy, mesh_model in (('fsdp', 1), ('tensor', 2)):
    losses, _ = loss_curve_and_state(strategy, mesh_model)
    np.testing.assert_allclose(losses, reference, rtol=2e-5, err_msg=strategy)


def test_fsdp_holds_about_an_eighth_of_the_params_per_device():
  _, replicated = loss_curve_and_state('data')
  _, sharded = loss_curve_and_state('fsdp')
  ratio = (sharding.bytes_per_device(sharded.params)
           / sharding.bytes_per_device(replicated.params))
  assert 1 / 8 <= ratio < 0.15
  ratio = (sharding.bytes_per_device(sharded.opt_state)
           / sharding.bytes_per_device(replicated.opt_state))
  assert 1 / 8 <= ratio < 0.15

"""Tests of the parameter layouts, vit_jax/sharding.py, on 4 simulated devices."""
import functools
import math

import flax.linen as nn
import jax
from jax.sharding import Mesh, PartitionSpec as P
import numpy as np
import pytest

from helpers import random_params
from vit_jax import sharding
from vit_jax.data import pipeline
from vit_jax.models import registry
from vit_jax.training import step as train_step
from vit_jax.training import trainer
import tiny_config

pytestmark = pytest.mark.xdist_group('sharding')  # Its cached training runs are made once.


def config_for(strategy, mesh_model=1):
  config = tiny_config.get_config()
  config.model_name = 'small'
  config.model = registry.vit('small', patch=7, hidden=128, mlp=512, heads=4, layers=2)
  config.sharding = strategy
  config.mesh.model = mesh_model
  return config


def specs_of(strategy, mesh_model=1):
  config = config_for(strategy, mesh_model)
  mesh = trainer.make_mesh(config)
  model = trainer.build_model(config, num_classes=10)
  optimizer = train_step.make_optimizer(config)
  state = jax.eval_shape(
      lambda: train_step.create_train_state(config, model, optimizer, mesh, 28)[0])
  axes = sharding.param_axes(sharding.declared_params(model, 28))
  shardings = sharding.state_shardings(state, axes, mesh, strategy, config.logical_axis_rules)
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
    sharding.state_shardings({}, {}, trainer.make_mesh(config_for('data')), 'zero3')


@functools.cache
def loss_curve_and_state(strategy, mesh_model=1, steps=3):
  """Losses of the first `steps` steps under `strategy` from the same random params (as a
  fine-tuning run starts: the jitted init then draws none), and the state after them."""
  config = config_for(strategy, mesh_model)
  mesh = trainer.make_mesh(config)
  model = trainer.build_model(config, num_classes=10)
  optimizer = train_step.make_optimizer(config)
  params = random_params(model, 28, scale=0.05)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh, 28, params)
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  batches = pipeline.get_train_iterator(config, mesh)
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


def test_fsdp_holds_about_a_quarter_of_the_params_per_device():
  assert jax.device_count() == 4
  _, replicated = loss_curve_and_state('data')
  _, sharded = loss_curve_and_state('fsdp')
  ratio = (sharding.bytes_per_device(sharded.params)
           / sharding.bytes_per_device(replicated.params))
  assert 1 / 4 <= ratio < 0.3
  ratio = (sharding.bytes_per_device(sharded.opt_state)
           / sharding.bytes_per_device(replicated.opt_state))
  assert 1 / 4 <= ratio < 0.3


# Every registry model, and the variants that add or restack parameters.
COVERED = [(name, {}) for name in registry.MODEL_CONFIGS] + [
    ('ViT-B_16', {'scan_layers': True}), ('R26+ViT-S_32', {'scan_layers': True}),
    ('ViT-B_16', {'representation_size': 768})]


@pytest.mark.parametrize('name,overrides', COVERED, ids=lambda x: str(x or ''))
def test_every_parameter_of_every_model_is_split_by_rules(name, overrides):
  """FSDP splits every large tensor over 'data'; tensor parallelism every attention and MLP
  kernel over 'model'. A parameter without declared axes or rules fails in `param_axes` or
  `state_shardings`. Two blocks stand for all: the others repeat the second's parameters."""
  model = registry.get_model(name, num_classes=1000, **overrides)
  model = model.clone(num_layers=min(model.num_layers, 2))
  size = model.patch_size[0] * model.stem_stride
  declared = sharding.declared_params(model, size)
  shapes, axes = nn.meta.unbox(declared), sharding.param_axes(declared)
  devices = np.array(jax.devices())
  fsdp = sharding.state_shardings(shapes, axes, Mesh(devices.reshape(4, 1), ('data', 'model')),
                                  'fsdp')
  tensor = sharding.state_shardings(shapes, axes, Mesh(devices.reshape(2, 2), ('data', 'model')),
                                    'tensor')
  flat = lambda tree: {'/'.join(sharding.path_names(path)): leaf
                       for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
  fsdp, tensor = flat(fsdp), flat(tensor)
  for path, shape in flat(shapes).items():
    if math.prod(shape.shape) >= sharding.FSDP_MIN_SIZE:
      assert 'data' in fsdp[path].spec, path
    two_heads = model.num_heads % 2 == 0
    if path.endswith(('query/kernel', 'key/kernel', 'value/kernel', 'out/kernel')) and two_heads:
      assert 'model' in tensor[path].spec, path
    if path.endswith(('MlpBlock_0/Dense_0/kernel', 'MlpBlock_0/Dense_1/kernel')):
      assert 'model' in tensor[path].spec, path


class Undeclared(nn.Module):

  @nn.compact
  def __call__(self, images, *, train):
    del train
    scale = self.param('scale', nn.initializers.ones, (3,))
    return images * scale


def test_a_parameter_without_declared_axes_is_an_error():
  with pytest.raises(ValueError, match='^Parameter scale declares no logical axes: make it with'):
    sharding.param_axes(sharding.declared_params(Undeclared(), 4))


def test_a_logical_axis_without_a_rule_is_an_error():
  axes = {('head', 'kernel'): ('embed', 'vocab')}
  mesh = Mesh(np.array(jax.devices()), ('data',))
  with pytest.raises(ValueError, match=r"^Parameter head/kernel has logical axis 'vocab', which "
                     r"no rule names: add \('vocab', MESH_AXIS or None\)"):
    sharding.state_shardings({}, axes, mesh, 'fsdp')
  sharding.state_shardings({}, axes, mesh, 'fsdp', rules=[('vocab', None)])


def test_a_malformed_rule_is_an_error():
  mesh = Mesh(np.array(jax.devices()), ('data',))
  with pytest.raises(ValueError, match=r"^config.logical_axis_rules has \('mlp', 'tensor'\); "):
    sharding.state_shardings({}, {}, mesh, 'tensor', rules=[('mlp', 'tensor')])


def test_a_rule_in_the_config_takes_precedence():
  """('mlp', None) keeps the MLP's hidden dimension whole under `tensor`, heads still split."""
  config = config_for('tensor', mesh_model=2)
  config.logical_axis_rules = [('mlp', None)]
  mesh = trainer.make_mesh(config)
  model = trainer.build_model(config, num_classes=10)
  declared = sharding.declared_params(model, 28)
  specs = jax.tree.map(lambda s: s.spec, sharding.state_shardings(
      nn.meta.unbox(declared), sharding.param_axes(declared), mesh, 'tensor',
      config.logical_axis_rules))
  block = specs['Transformer']['encoderblock_0']
  assert block['MlpBlock_0']['Dense_0']['kernel'] == P()
  assert block['MultiHeadDotProductAttention_0']['query']['kernel'] == P(None, 'model')


def test_the_train_step_constrains_activations_between_blocks_and_nothing_else_does():
  config = config_for('tensor', mesh_model=2)
  mesh = trainer.make_mesh(config)
  model = trainer.build_model(config, num_classes=10)
  optimizer = train_step.make_optimizer(config)
  state = jax.eval_shape(
      lambda: train_step.create_train_state(config, model, optimizer, mesh, 28)[0])
  axes = sharding.param_axes(sharding.declared_params(model, 28))
  shardings = sharding.state_shardings(state, axes, mesh, 'tensor', config.logical_axis_rules)
  batch = {'image': jax.ShapeDtypeStruct((config.batch, 28, 28, 3), np.float32),
           'label': jax.ShapeDtypeStruct((config.batch,), np.int32)}
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  text = step.lower(state, batch).as_text()
  # The encoder's input and each of its 2 blocks' outputs: batch over 'data', in the forward pass.
  assert text.count('sharding_constraint') >= 3
  assert 'sharding_constraint' not in jax.jit(trainer.make_eval_step(model)).lower(
      state.params, dict(batch, mask=batch['label'])).as_text()

"""Tests of the features of any block, `VisionTransformer.intermediates` (vit_jax/models/vit.py)."""
import re

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from helpers import images_of
from helpers import random_params
from helpers import tiny_vit
from vit_jax.checkpoints import npz
from vit_jax.models import positions

HYBRID = dict(patch_size=(1, 1), resnet_layers=(), resnet_width_factor=0.5)  # A 4x4 grid.


def intermediates(model, params, images, **kwargs):
  """`model.intermediates` of `images` under `params`."""
  return model.apply({'params': params}, images, method='intermediates', **kwargs)


def layer_norm(x, p):
  mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + 1e-6) * p['scale'] + p['bias']


@pytest.mark.parametrize('overrides', [
    dict(classifier='token'), dict(classifier='gap'), dict(classifier='token', scan_layers=True),
    HYBRID, *[dict(posemb=kind) for kind in positions.POSEMB_KINDS if kind != 'learned_1d']])
def test_the_last_blocks_output_normed_and_pooled_is_the_features(overrides):
  model, images = tiny_vit(**overrides), images_of()
  params = random_params(model, 16, scale=0.3)
  out = intermediates(model, params, images, blocks=(-1,))
  assert out.blocks == (1,) and out.tokens[0].shape == (2, 16 + model.has_class_token, 12)
  normed = layer_norm(np.asarray(out.tokens[0]), params['Transformer']['encoder_norm'])
  pooled = normed[:, 0] if model.classifier == 'token' else normed.mean(axis=1)
  np.testing.assert_allclose(out.features, pooled, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(out.features, model.apply({'params': params}, images,
                                                       method='features'), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize('scan_layers', [False, True])
def test_block_0_is_the_output_of_the_first_block_alone(scan_layers):
  # A one-block model with the same first block ends where block 0 of the two-block one does.
  images = images_of()
  params = random_params(tiny_vit(), 16, scale=0.3)
  first = {**params, 'Transformer': {
      k: v for k, v in params['Transformer'].items() if k != 'encoderblock_1'}}
  alone = intermediates(tiny_vit(num_layers=1), first, images, blocks=(0,)).tokens[0]
  model = tiny_vit(scan_layers=scan_layers)
  out = intermediates(model, npz.scan_blocks(params) if scan_layers else params, images,
                      blocks=(1, 0))
  assert out.blocks == (1, 0)
  np.testing.assert_allclose(out.tokens[1], alone, rtol=1e-5, atol=1e-5)
  assert not np.allclose(out.tokens[0], alone, atol=1e-3)


@pytest.mark.parametrize('posemb', positions.POSEMB_KINDS)
def test_scanned_and_unrolled_blocks_give_the_same_intermediates(posemb):
  images = images_of()
  params = random_params(tiny_vit(posemb=posemb), 16, scale=0.3)
  unrolled = intermediates(tiny_vit(posemb=posemb), params, images, blocks=(0, 1), maps=True)
  scanned = intermediates(tiny_vit(posemb=posemb, scan_layers=True), npz.scan_blocks(params),
                          images, blocks=(0, 1), maps=True)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), scanned,
               unrolled)


@pytest.mark.parametrize('overrides, grid', [(dict(), (4, 4)), (dict(classifier='gap'), (4, 4)),
                                             (HYBRID, (4, 4)), (dict(patch_size=(2, 4)), (8, 4))])
def test_maps_hold_the_patch_tokens_in_rows_and_columns_and_the_class_token_apart(overrides,
                                                                                  grid):
  model, images = tiny_vit(**overrides), images_of()
  params = random_params(model, 16, scale=0.3)
  tokens = intermediates(model, params, images, blocks=(0,)).tokens[0]
  out = intermediates(model, params, images, blocks=(0,), maps=True)
  assert out.tokens[0].shape == (2, *grid, 12)
  extra = int(model.has_class_token)
  np.testing.assert_array_equal(out.tokens[0][:, 1, 2], tokens[:, extra + grid[1] + 2])
  if extra:
    np.testing.assert_array_equal(out.class_tokens[0], tokens[:, 0])
  else:
    assert out.class_tokens is None


def test_under_jit_on_a_sharded_batch_the_tokens_stay_split_along_the_batch():
  model, images = tiny_vit(scan_layers=True), images_of(batch=8)
  params = npz.scan_blocks(random_params(tiny_vit(), 16, scale=0.3))
  mesh = Mesh(np.array(jax.devices()), ('data',))
  run = jax.jit(lambda p, x: intermediates(model, p, x, blocks=(0, -1), maps=True),
                in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))))
  out = run(params, images)
  assert out.blocks == (0, 1)  # Static: ints, not traced.
  assert out.tokens[1].sharding.spec[0] == 'data' and out.features.sharding.spec[0] == 'data'
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), out,
               intermediates(model, params, images, blocks=(0, -1), maps=True))


@pytest.mark.parametrize('blocks, bad', [((0, 2), 2), ((-3,), -3)])
def test_blocks_out_of_range_are_a_value_error_naming_the_range(blocks, bad):
  model, images = tiny_vit(), images_of()
  params = random_params(model, 16)
  message = (f'blocks={blocks}: {bad} is out of range; the model has 2 blocks, 0 to 1 (or -2 to '
             '-1 from the last).')
  with pytest.raises(ValueError, match=re.escape(message)):
    intermediates(model, params, images, blocks=blocks)


@pytest.mark.parametrize('overrides', [dict(scan_layers=True), HYBRID])
def test_maps_of_a_batch_sharded_over_explicit_axes_match_the_unsharded(overrides):
  model, images = tiny_vit(**overrides), images_of(batch=8)
  params = random_params(model, 16, scale=0.3)
  run = jax.jit(lambda p, x: intermediates(model, p, x, blocks=(-1,), maps=True))
  expected = run(params, images)  # No mesh.
  with jax.set_mesh(jax.make_mesh((2, 2), ('data', 'model'))):  # Explicit axes.
    sharded = run(params, jax.device_put(images, P('data')))
    assert jax.typeof(sharded.tokens[0]).sharding.spec[0] == 'data'
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), sharded,
               expected)

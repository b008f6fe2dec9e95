"""VisionTransformer.features on a batch sharded over a jax.make_mesh mesh (Explicit axes)."""
import functools

import jax
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from vit_jax.models import vit

TINY = dict(num_classes=3, patch_size=(4, 4), hidden_size=12, mlp_dim=24, num_heads=2,
            num_layers=1)


@pytest.mark.parametrize('overrides', [
    dict(classifier='gap', representation_size=7, scan_layers=True),
    dict(patch_size=(1, 1), resnet_layers=(), resnet_width_factor=0.5)])  # Hybrid, class token.
def test_features_of_a_batch_sharded_over_explicit_axes_match_the_unsharded(overrides):
  model = vit.VisionTransformer(**{**TINY, **overrides})
  images = np.random.default_rng(0).uniform(-1, 1, size=(8, 16, 16, 3)).astype(np.float32)
  init = jax.jit(functools.partial(model.init, train=False))
  params = init(jax.random.key(0), images[:1])['params']
  features = jax.jit(functools.partial(model.apply, method='features'))
  expected = features({'params': params}, images)  # No mesh.
  mesh = jax.make_mesh((2, 2), ('data', 'model'))
  assert mesh.axis_types == (jax.sharding.AxisType.Explicit,) * 2
  with jax.set_mesh(mesh):
    sharded = features({'params': params}, jax.device_put(images, P('data')))
    assert jax.typeof(sharded).sharding.spec == P('data', None)  # Rows stay where they were.
  np.testing.assert_allclose(sharded, expected, rtol=1e-5, atol=1e-5)

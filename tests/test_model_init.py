"""Tests of the blank-image init, vit_jax/models/blank.py."""
import jax
import numpy as np

from vit_jax.models import blank
from vit_jax.models import registry
from vit_jax.tasks import mpp


def test_param_shapes_of_the_largest_model_are_shapes_alone():
  # ViT-H/14's 632M float32 parameters would take 2.5 GB: only their shapes are made.
  shapes = blank.param_shapes(registry.get_model('ViT-H_14', num_classes=1000), 224)
  leaves = jax.tree.leaves(shapes)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
  assert sum(x.size for x in leaves) == 632_045_800  # The published count.


def test_a_height_and_width_give_one_position_per_patch_and_the_class_token():
  model = registry.get_model('testing', num_classes=3)  # 16x16 patches, width 16.
  shapes = blank.param_shapes(model, (32, 80))
  assert shapes['Transformer']['posembed_input']['pos_embedding'].shape == (1, 2 * 5 + 1, 16)
  assert blank.blank_images((32, 80)).shape == (1, 32, 80, 3)
  assert blank.blank_images(32).shape == (1, 32, 32, 3)


def test_init_params_are_the_seeds_and_include_the_pretraining_head():
  model = mpp.with_mpp(registry.get_model('testing', num_classes=3), 'mean_color_3bit')
  first = blank.init_params(model, jax.random.key(0), 16)
  again = blank.init_params(model, jax.random.key(0), 16)
  other = blank.init_params(model, jax.random.key(1), 16)
  assert set(first) > set(blank.init_params(registry.get_model('testing', num_classes=3),
                                                 jax.random.key(0), 16))
  kernel = lambda params: np.asarray(params['Transformer']['encoderblock_0']['MlpBlock_0'][
      'Dense_0']['kernel'])
  np.testing.assert_array_equal(kernel(first), kernel(again))
  assert not np.array_equal(kernel(first), kernel(other))

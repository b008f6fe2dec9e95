"""Tests of the registry, vit_jax/models/registry.py."""
import json

import jax
import jax.numpy as jnp
import pytest

from vit_jax.models import flops
from vit_jax.models import registry

# Published parameter counts at 1000 classes and 224 px.
PUBLISHED_SIZES = {
    'ViT-Ti_16': 5_717_416,
    'ViT-S_16': 22_050_664,
    'ViT-S_32': 22_878_952,
    'ViT-B_8': 86_576_872,
    'ViT-B_16': 86_567_656,
    'ViT-B_32': 88_224_232,
    'ViT-L_16': 304_326_632,
    'ViT-L_32': 306_535_400,
    'ViT-H_14': 632_045_800,
    'ViT-S_16-gap': 22_049_896,
    'ViT-S_32-gap': 22_878_184,
    'ViT-B_16-gap': 86_566_120,
    'ViT-B_32-gap': 88_222_696,
    'R+ViT-Ti_16': 6_337_704,
    'R26+ViT-S_32': 36_431_912,
    'R26+ViT-B_32': 101_383_976,
    'R50+ViT-B_16': 98_659_112,
    'R50+ViT-L_32': 328_994_856,
}


@pytest.mark.parametrize('name,size', PUBLISHED_SIZES.items())
def test_parameter_count_matches_published(name, size):
  # Scanned, the blocks are traced once; their parameters are the unscanned ones, stacked (the
  # unscanned count: test_hybrid_r50_b16_has_14x14_tokens_at_224_and_its_published_count).
  model = registry.get_model(name, num_classes=1000, scan_layers=True)
  assert registry.count_params(model, image_size=224) == size


def test_registry_holds_every_published_model():
  assert set(PUBLISHED_SIZES) <= set(registry.MODEL_CONFIGS)


def test_unknown_model_lists_known_names_but_not_the_internal_testing_model():
  with pytest.raises(ValueError, match=r"Unknown model 'ViT-X_99'.*ViT-B_16.*R50\+ViT-B_16") as e:
    registry.get_model('ViT-X_99', num_classes=10)
  assert 'testing' not in str(e.value)
  assert 'testing' not in registry.LISTED_MODELS and 'testing' in registry.MODEL_CONFIGS


def test_overrides_replace_fields_and_unknown_ones_fail():
  model = registry.get_model('ViT-B_16', num_classes=10, dtype=jnp.bfloat16, classifier='gap')
  assert (model.dtype, model.classifier, model.num_classes) == (jnp.bfloat16, 'gap', 10)
  with pytest.raises(ValueError, match='Unknown model fields.*hidden_sizes'):
    registry.get_model('ViT-B_16', num_classes=10, hidden_sizes=3)


def test_hybrid_r50_b16_has_14x14_tokens_at_224_and_its_published_count():
  params = registry.param_shapes(registry.get_model('R50+ViT-B_16', num_classes=1000), 224)
  assert params['Transformer']['posembed_input']['pos_embedding'].shape == (1, 14 * 14 + 1, 768)
  assert params['embedding']['kernel'].shape == (1, 1, 1024, 768)
  assert params['block3']['unit9']['conv3']['kernel'].shape == (1, 1, 256, 1024)
  assert 'encoderblock_11' in params['Transformer']  # Unscanned, as the published files are.
  assert sum(x.size for x in jax.tree.leaves(params)) == PUBLISHED_SIZES['R50+ViT-B_16']


def xla_gflops(model, image_size):
  """GFLOPs of one image's forward pass as XLA:CPU's cost analysis counts them in the lowered
  (not compiled) unscanned model."""
  params = registry.param_shapes(model, image_size)
  images = jax.ShapeDtypeStruct((1, image_size, image_size, 3), jnp.float32)
  lowered = jax.jit(lambda p, x: model.apply({'params': p}, x, train=False)).lower(params, images)
  return lowered.cost_analysis()['flops'] / 1e9


# One block per model keeps the lowering fast; blocks then weigh least against stem, patch
# embedding and head, so these are checked the hardest.
@pytest.mark.parametrize('name', registry.MODEL_CONFIGS)
def test_gflops_match_xla_cost_analysis_within_one_percent(name):
  model = registry.get_model(name, num_classes=1000, num_layers=1)
  assert flops.gflops_per_image(model, 224) == pytest.approx(xla_gflops(model, 224), rel=0.01)


def test_gflops_match_xla_at_another_resolution_and_classifiers():
  for classifier in ('unpooled', 'token_unpooled'):
    model = registry.get_model('ViT-Ti_16', num_classes=10, num_layers=2, classifier=classifier,
                             representation_size=64)
    assert flops.gflops_per_image(model, 96) == pytest.approx(xla_gflops(model, 96), rel=0.01)


def test_gflops_of_b16_match_the_paper():
  # ~17.6 G multiply-adds per 224 px image, i.e. ~35 GFLOPs.
  gflops = flops.gflops_per_image(registry.get_model('ViT-B_16', num_classes=1000))
  assert 34 < gflops < 37


def test_spec_is_json_and_rebuilds_every_registry_model_but_its_execution_choices():
  for name in registry.MODEL_CONFIGS:
    model = registry.get_model(name, num_classes=10, dtype=jnp.bfloat16, scan_layers=True)
    spec = json.loads(json.dumps(registry.model_spec(model, name)))
    assert spec['name'] == name and 'dtype' not in spec['model']
    assert registry.model_from_spec(spec) == model.clone(dtype=jnp.float32, scan_layers=False)


def test_spec_of_unknown_or_missing_fields_is_a_clear_error():
  spec = registry.model_spec(registry.get_model('testing', num_classes=3), 'testing')
  with pytest.raises(ValueError, match=r"fields \['mask_token'\] that this vit_jax does not know"):
    registry.model_from_spec({**spec, 'model': {**spec['model'], 'mask_token': True}})
  del spec['model']['hidden_size']
  with pytest.raises(ValueError, match=r'Incomplete model spec: .*hidden_size'):
    registry.model_from_spec(spec)
  with pytest.raises(ValueError, match=r'Not a model spec: \[1, 2\]'):
    registry.model_from_spec([1, 2])

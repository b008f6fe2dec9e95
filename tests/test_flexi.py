"""Any patch size and any image shape: FlexiViT's pseudo-inverse resize of the patch kernel
(vit_jax.checkpoints.finetune), non-square images (config.pp.crop = (height, width)) and
position embeddings interpolated at apply time (VisionTransformer.any_size). The commands on a
non-square run are in test_commands.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_params
from helpers import tiny_config
from helpers import tiny_vit
from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import runs
from vit_jax.config import checks
from vit_jax.errors import ConfigError
from vit_jax.models import flops
from vit_jax.models import registry
from vit_jax.models import vit

TRAINED = 16  # tiny_vit's square training size: 4 x 4 patches of 4 px.
OTHER = (24, 36)  # Another size, not square: 6 x 9 patches.


def images(height, width, batch=2, seed=0):
  """(batch, height, width, 3) float32 images, uniform in [-1, 1]."""
  rng = np.random.default_rng(seed)
  return rng.uniform(-1, 1, (batch, height, width, 3)).astype(np.float32)


def logits(model, params, x, **kwargs):
  return np.asarray(model.apply({'params': params}, x, train=False, **kwargs))


def test_pi_resized_kernel_gives_an_upsampled_patch_its_original_token():
  """Beyer et al. (2023), Section 3.4: for the bilinear resize B of a patch from p to p* >= p,
  the kernel w* = pinv(B^T) w gives <B x, w*> = <x, w> for every patch x."""
  small = vit.PatchEmbedding(hidden_size=6, patch_size=(8, 8))
  patches = images(8, 8, batch=5)
  params = small.init(jax.random.key(0), patches)['params']
  large = vit.PatchEmbedding(hidden_size=6, patch_size=(12, 20))
  resized = {'kernel': finetune.resize_patch_kernel(params['kernel'], (12, 20)),
             'bias': params['bias']}
  upsampled = jax.image.resize(patches, (5, 12, 20, 3), 'bilinear')
  tokens = np.asarray(small.apply({'params': params}, patches))
  np.testing.assert_allclose(large.apply({'params': resized}, upsampled), tokens,
                             rtol=1e-5, atol=1e-5 * np.abs(tokens).max())


def test_published_layout_checkpoint_loads_at_another_patch_size_and_grid_and_runs(tmp_path):
  # As the published files are: no spec, the per-block layout.
  model = tiny_vit()
  npz.save(random_params(model, TRAINED, scale=0.3), tmp_path / 'published.npz')
  coarse = model.clone(patch_size=(6, 6))  # 6 x 9 patches of 6 px on 36 x 54 images.
  loaded = finetune.load_pretrained(tmp_path / 'published.npz',
                                    random_params(coarse, (36, 54), seed=1), coarse,
                                    grid=coarse.grid((36, 54)))
  assert loaded['embedding']['kernel'].shape == (6, 6, 3, 12)
  assert loaded['Transformer']['posembed_input']['pos_embedding'].shape == (1, 1 + 6 * 9, 12)
  assert np.isfinite(logits(coarse, loaded, images(36, 54))).all()


@pytest.mark.parametrize('posemb', ['learned_1d', 'learned_2d', 'sincos_2d', 'none'])
def test_any_size_interpolates_as_fine_tuning_does_at_load(tmp_path, posemb):
  model = tiny_vit(posemb=posemb)
  params = random_params(model, TRAINED, scale=0.3)
  npz.save(params, tmp_path / 'model.npz', spec=registry.model_spec(model))
  at_load = finetune.load_pretrained(tmp_path / 'model.npz', random_params(model, OTHER), model,
                                     grid=model.grid(OTHER), keep_head=True)
  x = images(*OTHER)
  np.testing.assert_allclose(logits(model.any_size(TRAINED), params, x),
                             logits(model, at_load, x), rtol=1e-5, atol=1e-5)


def test_any_size_of_a_non_square_run_reads_its_grid(tmp_path):
  model = tiny_vit()
  params = random_params(model, OTHER, scale=0.3)  # Trained at 24 x 36: 6 x 9 patches.
  npz.save(params, tmp_path / 'model.npz',
           spec={**registry.model_spec(model), 'image_size': list(OTHER)})
  loaded_model, loaded = runs.load_model(tmp_path / 'model.npz')
  assert runs.trained_image_size(tmp_path / 'model.npz', loaded, loaded_model) == OTHER
  at_load = finetune.load_pretrained(tmp_path / 'model.npz', random_params(model, 32), model,
                                     keep_head=True)
  x = images(32, 32)
  np.testing.assert_allclose(logits(model.any_size(OTHER), params, x),
                             logits(model, at_load, x), rtol=1e-5, atol=1e-5)


def test_any_size_at_the_trained_size_is_the_same_computation():
  model = tiny_vit()
  params = random_params(model, OTHER)
  x = images(*OTHER)
  program = lambda m: str(jax.make_jaxpr(lambda p: m.apply({'params': p}, x, train=False))(
      params))
  assert program(model.any_size(OTHER)) == program(model)


def test_features_and_intermediates_at_any_size():
  model = tiny_vit()
  params = random_params(model, TRAINED)
  flexible = model.any_size(TRAINED)
  x = images(*OTHER)
  found = flexible.apply({'params': params}, x, method='intermediates', blocks=(0, -1), maps=True)
  assert [t.shape for t in found.tokens] == [(2, 6, 9, 12)] * 2
  np.testing.assert_allclose(found.features, flexible.apply({'params': params}, x,
                                                            method='features'), rtol=1e-6)


def test_relative_posemb_refuses_any_size():
  with pytest.raises(ValueError, match="dynamic_img_size=True does not work with "
                                       "posemb='relative'"):
    tiny_vit(posemb='relative').any_size(TRAINED)


def test_non_square_crop_is_checked_against_the_patch_size():
  """What `python -m vit_jax.main` checks of a non-square crop before it compiles; the run
  itself is test_commands.py's."""
  config = tiny_config(pp=dict(crop=(28, 42)))
  checks.validate_config(config, 1)  # 7 px patches: 4 x 6 of them.
  config.model.patches.size = (14, 14)
  checks.validate_config(config, 1)
  with pytest.raises(ConfigError, match=r'config.pp.crop=\(28, 40\) is not divisible by the '
                                        r'patch size 14x14 of tiny: use e.g. \(28, 28\)\.'):
    checks.validate_config(tiny_config(pp=dict(crop=(28, 40)), model=config.model), 1)
  with pytest.raises(ConfigError, match=r'config.pp.crop=\(28, 0\) must be a side in pixels'):
    checks.validate_config(tiny_config(pp=dict(crop=(28, 0))), 1)


def xla_gflops(model, height, width):
  """GFLOPs of one image's forward pass as XLA's cost analysis counts the lowered model."""
  x = jax.ShapeDtypeStruct((1, height, width, 3), jnp.float32)
  lowered = jax.jit(lambda p, x: model.apply({'params': p}, x, train=False)).lower(
      registry.param_shapes(model, (height, width)), x)
  return lowered.cost_analysis()['flops'] / 1e9


@pytest.mark.parametrize('name', ['ViT-Ti_16', 'R26+ViT-S_32'])
def test_gflops_of_non_square_images_match_xla(name):
  model = registry.get_model(name, num_classes=10, num_layers=1)
  assert flops.gflops_per_image(model, (64, 128)) == pytest.approx(
      xla_gflops(model, 64, 128), rel=0.01)


def test_saved_model_export_of_a_non_square_model(tmp_path):
  import tensorflow as tf  # Only this test needs it.
  from vit_jax.tools import export
  model = tiny_vit()
  params = random_params(model, OTHER, scale=0.3)
  export.export(model, params, OTHER, 'saved_model', str(tmp_path / 'saved'), labels=[])
  pixels = np.random.default_rng(0).integers(0, 256, (3, *OTHER, 3), dtype=np.uint8)
  served = tf.saved_model.load(str(tmp_path / 'saved')).signatures['serving_default'](
      images=tf.constant(pixels))['logits']
  np.testing.assert_allclose(served.numpy(), logits(model, params, pixels / 127.5 - 1),
                             rtol=1e-4, atol=1e-5)

"""Tests of the Vision Transformer modules, vit_jax/models/vit.py."""
import contextlib
import io
import json
import os

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from helpers import DATA
from helpers import TINY_VIT as TINY
from helpers import images_of
from helpers import random_params
from helpers import tiny_vit
from vit_jax import sharding
from vit_jax.checkpoints import npz
from vit_jax.models import blank
from vit_jax.models import registry
from vit_jax.models import resnet
from vit_jax.models import attention
from vit_jax.tasks import mpp


# A hand-written reference of equations (1)-(4) of the paper, in numpy.

def np_layer_norm(x, p):
  mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + 1e-6) * p['scale'] + p['bias']


def np_gelu(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def np_msa(x, p):
  q, k, v = (np.einsum('td,dnh->nth', x, p[n]['kernel']) + p[n]['bias'][:, None]
             for n in ('query', 'key', 'value'))
  logits = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  heads = weights @ v  # (N, T, K)
  return np.einsum('nth,nhd->td', heads, p['out']['kernel']) + p['out']['bias']


def np_vit(image, params, patch):
  p = jax.tree.map(np.asarray, params)
  h, w, c = image.shape
  # Eq. (1): z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos, patches flattened row-major.
  patches = [image[i:i + patch, j:j + patch].reshape(-1)
             for i in range(0, h, patch) for j in range(0, w, patch)]
  e = p['embedding']['kernel'].reshape(-1, p['embedding']['kernel'].shape[-1])
  z = np.stack([p['cls'][0, 0]] + [x @ e + p['embedding']['bias'] for x in patches])
  z = z + p['Transformer']['posembed_input']['pos_embedding'][0]
  i = 0
  while f'encoderblock_{i}' in p['Transformer']:
    blk = p['Transformer'][f'encoderblock_{i}']
    z = np_msa(np_layer_norm(z, blk['LayerNorm_0']), blk['MultiHeadDotProductAttention_0']) + z
    mlp = blk['MlpBlock_0']
    y = np_layer_norm(z, blk['LayerNorm_1'])
    y = np_gelu(y @ mlp['Dense_0']['kernel'] + mlp['Dense_0']['bias'])
    z = y @ mlp['Dense_1']['kernel'] + mlp['Dense_1']['bias'] + z  # Eq. (2), (3)
    i += 1
  y = np_layer_norm(z, p['Transformer']['encoder_norm'])[0]  # Eq. (4): LN(z_L^0)
  return y @ p['head']['kernel'] + p['head']['bias']


def test_matches_equations_1_to_4():
  model, images = tiny_vit(), images_of()
  params = random_params(model, images.shape[1:3], scale=0.3)
  logits = model.apply({'params': params}, images, train=False)
  expected = np.stack([np_vit(np.asarray(x), params, patch=4) for x in images])
  np.testing.assert_allclose(logits, expected, rtol=2e-4, atol=2e-4)


def test_parameter_tree_is_the_published_one():
  params = tiny_vit(representation_size=7).init(jax.random.key(0), images_of(), train=False)
  params = params['params']
  shapes = jax.tree_util.tree_map_with_path(lambda path, x: x.shape, params)
  block = shapes['Transformer']['encoderblock_1']
  assert block['MultiHeadDotProductAttention_0']['query']['kernel'] == (12, 3, 4)
  assert block['MultiHeadDotProductAttention_0']['out']['kernel'] == (3, 4, 12)
  assert block['MlpBlock_0']['Dense_0']['kernel'] == (12, 20)
  assert set(block) == {'LayerNorm_0', 'MultiHeadDotProductAttention_0', 'LayerNorm_1',
                        'MlpBlock_0'}
  assert shapes['embedding']['kernel'] == (4, 4, 3, 12)
  assert shapes['cls'] == (1, 1, 12)
  assert shapes['Transformer']['posembed_input']['pos_embedding'] == (1, 17, 12)
  assert shapes['pre_logits']['kernel'] == (12, 7)
  assert set(shapes) == {'embedding', 'cls', 'Transformer', 'pre_logits', 'head'}
  np.testing.assert_array_equal(params['head']['kernel'], 0)
  np.testing.assert_array_equal(params['cls'], 0)


# The models of tests/data/param_layouts.json, by name: TINY_VIT's overrides, and for the
# MaskedPatchViTs their target.
LAYOUT_MODELS = {
    'plain': {}, 'representation': dict(representation_size=7),
    'scan_gap': dict(scan_layers=True, classifier='gap'),
    'hybrid': dict(patch_size=(1, 1), resnet_layers=(), resnet_width_factor=0.5),
    'hybrid_scan': dict(patch_size=(1, 1), resnet_layers=(1,), resnet_width_factor=0.5,
                        scan_layers=True),
    'learned_2d': dict(posemb='learned_2d'),
    'relative_scan': dict(posemb='relative', scan_layers=True)}
MPP_LAYOUT_MODELS = {'mpp': ({}, 'mean_color_3bit'),
                     'mpp_scan_gap': (dict(scan_layers=True, classifier='gap'), 'downsampled_3bit')}


def layout_model(name):
  """The model named `name` in tests/data/param_layouts.json."""
  if name in MPP_LAYOUT_MODELS:
    overrides, target = MPP_LAYOUT_MODELS[name]
    return mpp.with_mpp(tiny_vit(**overrides), target)
  return tiny_vit(**LAYOUT_MODELS[name])


@pytest.mark.parametrize('name', [*LAYOUT_MODELS, *MPP_LAYOUT_MODELS])
def test_parameter_paths_and_shapes_are_the_recorded_ones(name):
  # Checkpoints and model.npz files hold this layout: it must not change.
  with open(os.path.join(DATA, 'param_layouts.json')) as f:
    recorded = json.load(f)[name]
  shapes = blank.param_shapes(layout_model(name), 16)
  found = {'/'.join(sharding.path_names(path)): list(leaf.shape)
           for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)}
  assert found == recorded


def test_exact_gelu_differs_from_tanh_approximation():
  images = images_of()
  params = random_params(tiny_vit(), images.shape[1:3], scale=0.3)
  tanh = tiny_vit().apply({'params': params}, images, train=False)
  exact = tiny_vit(approximate_gelu=False).apply({'params': params}, images, train=False)
  assert not np.allclose(tanh, exact, atol=1e-6)
  np.testing.assert_allclose(tanh, exact, atol=5e-2)


@pytest.mark.parametrize('classifier,shape', [
    ('token', (2, 5)), ('gap', (2, 5)), ('unpooled', (2, 16, 5)), ('token_unpooled', (2, 17, 5))])
def test_output_shape_of_each_classifier(classifier, shape):
  model, images = tiny_vit(classifier=classifier), images_of()
  variables = model.init(jax.random.key(0), images, train=False)
  assert ('cls' in variables['params']) == classifier.startswith('token')
  assert model.apply(variables, images, train=False).shape == shape


def test_dropout_only_in_training_and_deterministic_per_rng():
  model, images = tiny_vit(dropout_rate=0.3, attention_dropout_rate=0.3), images_of()
  variables = {'params': random_params(model, images.shape[1:3], scale=0.3)}
  evals = [model.apply(variables, images, train=False) for _ in range(2)]
  np.testing.assert_array_equal(evals[0], evals[1])
  train = lambda seed: model.apply(variables, images, train=True,
                                   rngs={'dropout': jax.random.key(seed)})
  np.testing.assert_array_equal(train(1), train(1))
  assert not np.allclose(train(1), train(2))
  assert not np.allclose(train(1), evals[0])


def test_bfloat16_compute_is_close_to_float32():
  images = images_of()
  params = random_params(tiny_vit(), images.shape[1:3], scale=0.3)
  f32 = tiny_vit().apply({'params': params}, images, train=False)
  bf16_model = tiny_vit(dtype=jnp.bfloat16)
  bf16 = bf16_model.apply({'params': params}, images, train=False)
  assert bf16.dtype == jnp.float32  # logits are returned in float32
  init_dtypes = jax.tree.leaves(jax.tree.map(
      lambda x: x.dtype, bf16_model.init(jax.random.key(0), images, train=False)))
  assert set(init_dtypes) == {jnp.dtype('float32')}
  np.testing.assert_allclose(bf16, f32, atol=0.1 * float(jnp.abs(f32).max()))


def test_attention_weights_are_sown_on_request():
  model, images = tiny_vit(), images_of()
  variables = {'params': random_params(model, images.shape[1:3], scale=0.3)}
  logits, state = model.apply(variables, images, train=False, mutable=['intermediates'])
  np.testing.assert_allclose(logits, model.apply(variables, images, train=False), atol=1e-5)
  weights = state['intermediates']['Transformer']['encoderblock_1'][
      'MultiHeadDotProductAttention_0']['attention_weights'][0]
  assert weights.shape == (2, 3, 17, 17)
  np.testing.assert_allclose(weights.sum(-1), 1, rtol=1e-5)


def test_image_not_divisible_by_patch_size_is_a_clear_error():
  with pytest.raises(ValueError, match=r'Image size 18x18 is not divisible by the patch size '
                                       r'4x4.*Resize the images.*16x16'):
    tiny_vit().init(jax.random.key(0), images_of(size=18), train=False)


def test_uint8_images_are_a_clear_error():
  model, images = tiny_vit(), images_of()
  variables = {'params': random_params(model, images.shape[1:3], scale=0.3)}
  pixels = np.asarray((images + 1) * 127.5, np.uint8)
  with pytest.raises(ValueError, match=r'Expected float images with values in \[-1, 1\], got '
                                       r'uint8: scale them first, e.g. images / 127.5 - 1'):
    model.apply(variables, pixels, train=False)


def test_image_size_other_than_the_posemb_grid_is_a_clear_error():
  model = tiny_vit()
  variables = model.init(jax.random.key(0), images_of(size=16), train=False)
  with pytest.raises(ValueError, match=r'gives 37 tokens.*pos_embedding.*\(1, 17, 12\).*'
                                       r'resize the position embeddings'):
    model.apply(variables, images_of(size=24), train=False)


def test_unknown_classifier_is_a_clear_error():
  with pytest.raises(ValueError, match="classifier='cls'; choose one of"):
    tiny_vit(classifier='cls').init(jax.random.key(0), images_of(), train=False)


def test_hybrid_stem_divides_resolution_by_its_stride():
  for num_layers, stride in [((), 4), ((1, 1), 8), ((1, 1, 1), 16)]:
    assert resnet.stem_stride(num_layers) == stride
    model = tiny_vit(patch_size=(1, 1), resnet_layers=num_layers, resnet_width_factor=0.5)
    params = registry.param_shapes(model, image_size=64)  # Shapes only: nothing is computed.
    tokens = params['Transformer']['posembed_input']['pos_embedding'].shape[1]
    assert tokens == (64 // stride)**2 + 1


def test_hybrid_image_not_divisible_by_total_stride_is_a_clear_error():
  model = tiny_vit(patch_size=(2, 2), resnet_layers=(1, 1))
  with pytest.raises(ValueError, match=r'40x40 is not divisible by the patch size 16x16 '
                                       r'\(patches \(2, 2\) on a stem of stride 8\)'):
    model.init(jax.random.key(0), images_of(size=40), train=False)


@pytest.mark.parametrize('overrides, image_size, pixels, grid, class_token', [
    ({}, 16, (4, 4), (4, 4), True),
    ({'classifier': 'gap'}, (8, 12), (4, 4), (2, 3), False),
    ({'patch_size': (2, 2), 'resnet_layers': (1, 1)}, (64, 96), (16, 16), (4, 6), True),
])
def test_patch_pixels_grid_and_class_token_match_the_tokens_the_model_makes(
    overrides, image_size, pixels, grid, class_token):
  model = tiny_vit(**overrides)  # The hybrid's stem: root block and 2 stages, stride 8.
  assert (model.patch_pixels, model.grid(image_size), model.has_class_token) == (
      pixels, grid, class_token)
  h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
  images = jnp.zeros((1, h, w, 3))
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), images, train=False))['params']
  assert params['Transformer']['posembed_input']['pos_embedding'].shape[1] == (
      grid[0] * grid[1] + class_token)


def test_weight_standardisation_gives_zero_mean_unit_std_per_output_channel():
  kernel = jax.random.normal(jax.random.key(0), (3, 3, 4, 6)) * 5 + 2
  w = resnet.standardize_weight(kernel)
  np.testing.assert_allclose(w.mean(axis=(0, 1, 2)), 0, atol=1e-5)
  np.testing.assert_allclose(w.std(axis=(0, 1, 2)), 1, atol=1e-4)


def test_scanned_blocks_give_the_same_logits_from_stacked_params():
  images = images_of()
  params = random_params(tiny_vit(), images.shape[1:3], scale=0.3)
  scanned_model = tiny_vit(scan_layers=True)
  shapes = jax.eval_shape(lambda: scanned_model.init(jax.random.key(0), images, train=False))
  block = shapes['params']['Transformer']['encoderblock']
  assert block['MlpBlock_0']['Dense_0']['kernel'].shape == (2, 12, 20)  # (L, D, M)
  assert block['MultiHeadDotProductAttention_0']['query']['kernel'].shape == (2, 12, 3, 4)
  scanned = npz.scan_blocks(params)
  assert jax.tree.map(np.shape, scanned) == jax.tree.map(lambda x: x.shape, shapes['params'])
  np.testing.assert_allclose(scanned_model.apply({'params': scanned}, images, train=False),
                             tiny_vit().apply({'params': params}, images, train=False),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('overrides', [
    dict(classifier='token'), dict(classifier='gap'), dict(representation_size=7),
    dict(patch_size=(1, 1), resnet_layers=(), resnet_width_factor=0.5)])
def test_features_are_what_the_head_maps_to_the_logits(overrides):
  model, images = tiny_vit(**overrides), images_of()
  params = random_params(model, images.shape[1:3], scale=0.3)
  features = model.apply({'params': params}, images, method='features')
  assert features.shape == (2, overrides.get('representation_size', 12))
  head = params['head']
  np.testing.assert_allclose(features @ head['kernel'] + head['bias'],
                             model.apply({'params': params}, images, train=False),
                             rtol=1e-5, atol=1e-5)


def test_features_agree_between_scanned_and_unscanned_blocks_and_under_sharded_jit():
  images = images_of(batch=8)
  params = random_params(tiny_vit(), images.shape[1:3], scale=0.3)
  features = tiny_vit().apply({'params': params}, images, method='features')
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
  scanned = jax.jit(
      lambda p, x: tiny_vit(scan_layers=True).apply({'params': p}, x, method='features'),
      in_shardings=(NamedSharding(mesh, P()), NamedSharding(mesh, P('data'))))(
          npz.scan_blocks(params), images)
  assert scanned.sharding.spec == P('data')
  np.testing.assert_allclose(scanned, features, rtol=1e-5, atol=1e-5)


def test_scanned_blocks_sow_attention_weights_stacked_over_layers():
  images = images_of()
  params = random_params(tiny_vit(), images.shape[1:3], scale=0.3)
  _, state = tiny_vit().apply({'params': params}, images, train=False, mutable=['intermediates'])
  _, scanned_state = tiny_vit(scan_layers=True).apply(
      {'params': npz.scan_blocks(params)}, images, train=False, mutable=['intermediates'])
  stacked = scanned_state['intermediates']['Transformer']['encoderblock'][
      'MultiHeadDotProductAttention_0']['attention_weights'][0]
  assert stacked.shape == (2, 2, 3, 17, 17)  # (L, B, N, T, T)
  for i in range(2):
    per_block = state['intermediates']['Transformer'][f'encoderblock_{i}'][
        'MultiHeadDotProductAttention_0']['attention_weights'][0]
    np.testing.assert_allclose(stacked[i], per_block, rtol=1e-5, atol=1e-6)


# Dropout (slow to compile) in one case only: remat must replay the same masks.
@pytest.mark.parametrize('scan_layers,dropout_rate', [(False, 0.0), (True, 0.2)])
def test_remat_gives_the_same_loss_and_gradients(scan_layers, dropout_rate):
  model = tiny_vit(scan_layers=scan_layers, dropout_rate=dropout_rate,
                   attention_dropout_rate=dropout_rate)
  images = images_of()
  params = random_params(model, images.shape[1:3], scale=0.3)

  def loss_and_grads(model):
    loss = lambda p: jnp.sum(model.apply({'params': p}, images, train=True,
                                         rngs={'dropout': jax.random.key(1)})**2)
    return jax.jit(jax.value_and_grad(loss))(params)

  (loss, grads), (remat_loss, remat_grads) = (
      loss_and_grads(model), loss_and_grads(model.clone(remat_policy='nothing_saveable')))
  np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
  for expected, actual in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads)):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)


def saved_activations(model, params, images):
  """What the backward pass keeps from the forward pass, besides parameters and constants: one
  line (shape, operation, source) per array, as jax.ad_checkpoint.print_saved_residuals says."""
  output = io.StringIO()
  with contextlib.redirect_stdout(output):
    jax.ad_checkpoint.print_saved_residuals(
        lambda p: model.apply({'params': p}, images, train=False).sum(), params)
  return [line for line in output.getvalue().splitlines()
          if 'from the argument' not in line and 'from a constant' not in line]


@pytest.mark.parametrize('scan_layers', [False, True])
def test_remat_policies_keep_fewer_activations_for_the_backward_pass(scan_layers):
  images = images_of()
  params = random_params(tiny_vit(scan_layers=scan_layers), images.shape[1:3], scale=0.3)
  kept = {policy: saved_activations(tiny_vit(scan_layers=scan_layers, remat_policy=policy),
                                    params, images)
          for policy in (None, 'dots_saveable', 'nothing_saveable')}
  assert len(kept[None]) > len(kept['dots_saveable']) > len(kept['nothing_saveable'])
  inside_blocks = lambda lines: [line for line in lines if 'MlpBlock' in line
                                 or 'MultiHeadDotProductAttention' in line]
  if not scan_layers:  # (Under scan, everything kept is an output of the scan.)
    assert inside_blocks(kept[None])
    assert not inside_blocks(kept['nothing_saveable'])  # Only the blocks' inputs are kept.


def test_unknown_remat_policy_is_a_clear_error():
  with pytest.raises(ValueError, match=r"remat_policy='dots'; choose one of \('nothing_saveable', "
                                       r"'dots_saveable', .*\), or None"):
    tiny_vit(remat_policy='dots').init(jax.random.key(0), images_of(), train=False)


def plain_attention(q, k, v):
  """softmax(q k^T) v over (B, N, T, K), as the XLA path computes it."""
  return jnp.einsum('bnqt,bntk->bnqk', jax.nn.softmax(jnp.einsum('bnqk,bntk->bnqt', q, k)), v)


@pytest.mark.parametrize('tokens', [17, 16, 5])
def test_padded_and_masked_attention_equals_plain_attention_with_gradients(tokens):
  q, k, v = (jax.random.normal(key, (2, 3, tokens, 8))
             for key in jax.random.split(jax.random.key(0), 3))
  padded = lambda *a: attention.padded_attention(*a, multiple=16, implementation='xla')
  # f(q, k, v) and the gradients of sum(sin(f)), in one jitted program each.
  with_grads = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(
      lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(*a)))(q, k, v)
  (out, grads), (expected, expected_grads) = with_grads(padded), with_grads(plain_attention)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out, np_msa_heads(q, k, v), rtol=1e-4, atol=1e-5)
  for expected, actual in zip(expected_grads, grads):
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)


def np_msa_heads(q, k, v):
  """The numpy reference's attention (np_msa) on (B, N, T, K) inputs, q already scaled."""
  logits = np.einsum('bnqk,bntk->bnqt', q, k)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  return np.einsum('bnqt,bntk->bnqk', weights / weights.sum(-1, keepdims=True), v)


def test_auto_attention_is_cudnn_only_on_nvidia_gpus():
  assert attention.resolve_attention('auto', jax.devices()) == 'xla'  # The tests' CPU.
  assert attention.resolve_attention('cudnn', jax.devices()) == 'cudnn'
  with pytest.raises(ValueError, match=r"attention='splash' is a TPU kernel, and these are CPU"):
    attention.resolve_attention('splash', jax.devices())
  with pytest.raises(ValueError,
                     match=r"attention='auto'; choose one of \('xla', 'cudnn', 'splash'\)"):
    tiny_vit(attention='auto').init(jax.random.key(0), images_of(), train=False)


def test_cudnn_attention_where_it_does_not_fit_runs_xla_attention_on_cpu():
  # float32, and in bfloat16 a head size of 4: cuDNN takes neither, so nothing asks for it.
  images = images_of()
  params = random_params(tiny_vit(), images.shape[1:3], scale=0.3)
  for dtype in (jnp.float32, jnp.bfloat16):
    np.testing.assert_array_equal(
        tiny_vit(attention='cudnn', dtype=dtype).apply({'params': params}, images, train=True),
        tiny_vit(dtype=dtype).apply({'params': params}, images, train=True))


def mean_logit(model, images, train):
  """params -> the model's mean logit (its gradient when `train`), jitted."""
  def loss(params):
    logits = model.apply({'params': params}, images, train=train,
                         rngs={'dropout': jax.random.key(1)})
    return logits.astype(jnp.float32).mean()
  return jax.jit(jax.grad(loss) if train else loss)


def lowered_for_gpu(model, images, train):
  """The StableHLO text of `mean_logit`, lowered for a CUDA GPU on whatever host runs the
  test (the parameters' shapes are traced with XLA's attention)."""
  params = registry.param_shapes(model.clone(attention='xla'), images.shape[1])
  return mean_logit(model, images, train).trace(params).lower(
      lowering_platforms=('cuda',)).as_text()


def skip_without_cudnn(lower, *args):
  """lower(*args), skipping the test where JAX cannot find cuDNN (no jax-cuda12-plugin)."""
  try:
    return lower(*args)
  except RuntimeError as e:
    if 'cuDNN' not in str(e):
      raise
    pytest.skip(f'lowering cuDNN attention needs jax-cuda12-plugin and cuDNN installed ({e})')


CUDA_VIT = dict(hidden_size=32, num_heads=2, dtype=jnp.bfloat16, attention='cudnn')  # K = 16


def test_bfloat16_training_with_xla_attention_lowers_for_gpu_without_cudnn():
  text = lowered_for_gpu(tiny_vit(**{**CUDA_VIT, 'attention': 'xla'}), images_of(), True)
  assert 'cudnn' not in text
  assert 'bf16' in text


def test_bfloat16_inference_lowers_for_gpu_with_cudnn_attention():
  text = skip_without_cudnn(lowered_for_gpu, tiny_vit(**CUDA_VIT), images_of(), False)
  assert text.count('custom_call @__cudnn$fmhaSoftmax(') == TINY['num_layers']


@pytest.mark.parametrize('classifier', ['token', 'gap'])  # 17 tokens (padded to 32), 16.
def test_bfloat16_training_lowers_for_gpu_with_cudnn_attention(classifier):
  text = skip_without_cudnn(lowered_for_gpu, tiny_vit(classifier=classifier, **CUDA_VIT),
                            images_of(), True)
  assert text.count('custom_call @__cudnn$fmha') == 2 * TINY['num_layers']
  assert text.count('custom_call @__cudnn$fmhaSoftmaxBackward(') == TINY['num_layers']


# An NVIDIA H200 as XLA:GPU's compiler sees it (xla.gpu.TargetConfig in text format), for
# compiling without one: compute capability 9.0, 132 SMs, 141 GB, cuDNN 9.28, CUDA 12.9.
H200_TARGET_CONFIG = """
gpu_device_info {
  cuda_compute_capability { major: 9 minor: 0 }
  core_count: 132  fpus_per_core: 128  clock_rate_ghz: 1.98
  threads_per_block_limit: 1024  threads_per_warp: 32  threads_per_core_limit: 2048
  shared_memory_per_block: 49152  shared_memory_per_block_optin: 232448
  shared_memory_per_core: 233472  registers_per_core_limit: 65536
  registers_per_block_limit: 65536  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000  l2_cache_size: 52428800
  device_memory_size: 141000000000
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 28 }
runtime_version { major: 12 minor: 9 }
device_description_str: "NVIDIA H200"
"""


def compiled_for_h200(model, images, train):
  """The optimised HLO text of `mean_logit`, compiled by XLA:GPU for an H200 on
  whatever host runs the test (deviceless ahead-of-time compilation); skips the test where no
  JAX CUDA plugin is installed.

  Gradients compile with cuBLAS products instead of Triton's: without a device XLA cannot
  autotune, and the default tiling it keeps for the backward product of the Q/K/V
  projections fails ("Couldn't find output tile sizes", jax 0.10.2; benchmarks/README.md).
  """
  try:
    topology = topologies.get_topology_desc(platform='cuda', topology='1x1x1',
                                            target_config=H200_TARGET_CONFIG)
  except NotImplementedError as e:
    pytest.skip(f'compiling for a GPU needs jax-cuda12-plugin and cuDNN installed ({e})')
  replicated = NamedSharding(topologies.make_mesh(topology, (1,), ('data',)), P())
  init = model.clone(attention='xla').init  # The same parameters, traced without cuDNN.
  params = jax.eval_shape(lambda: init(jax.random.key(0), images, train=False)['params'])
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                        params)
  options = {'xla_gpu_enable_triton_gemm': False} if train else {}
  lowered = mean_logit(model, images, train).lower(params)
  return lowered.compile(compiler_options=options).as_text()


def test_bfloat16_inference_compiles_for_an_h200_with_cudnn_attention():
  text = compiled_for_h200(tiny_vit(**CUDA_VIT), images_of(), False)
  assert text.count('custom_call_target="__cudnn$fmhaSoftmax"') == TINY['num_layers']


def test_bfloat16_training_with_a_class_token_compiles_for_an_h200_with_cudnn_attention():
  text = compiled_for_h200(tiny_vit(**CUDA_VIT), images_of(), True)  # 17 tokens, padded.
  assert text.count('custom_call_target="__cudnn$fmhaSoftmaxBackward"') == TINY['num_layers']

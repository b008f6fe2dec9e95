"""Tests of the PyTorch-layout converter, vit_jax/convert.py.

The state dicts are built by hand, following the documented timm and Hugging Face layouts, and
the converted model is checked against a numpy re-implementation of the PyTorch layer math.
"""
import os

import jax
import numpy as np
import pytest
import safetensors.numpy
import scipy.special

from helpers import images_of
from vit_jax.checkpoints import convert
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import runs
from vit_jax.models import vit

# Hidden size D, heads N, MLP size M, layers, patch P, classes, image size.
D, N, M, LAYERS, P, CLASSES, SIZE = 12, 3, 20, 2, 4, 5, 16
TIMM_EPS, HUGGING_FACE_EPS = 1e-6, 1e-12


def torch_weights(seed=0, hidden=D, mlp=M, layers=LAYERS, patch=P, classes=CLASSES, size=SIZE):
  """Random weights of a ViT in PyTorch's layout: Linear (out, in), conv (out, in, kh, kw)."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: (0.3 * rng.normal(size=shape)).astype(np.float32)
  tokens = (size // patch)**2 + 1
  linear = lambda n_out, n_in: {'weight': normal(n_out, n_in), 'bias': normal(n_out)}
  norm = lambda: {'weight': 1 + normal(hidden), 'bias': normal(hidden)}
  blocks = [{'norm1': norm(), 'q': linear(hidden, hidden), 'k': linear(hidden, hidden),
             'v': linear(hidden, hidden), 'proj': linear(hidden, hidden), 'norm2': norm(),
             'fc1': linear(mlp, hidden), 'fc2': linear(hidden, mlp)} for _ in range(layers)]
  return {'patch': {'weight': normal(hidden, 3, patch, patch), 'bias': normal(hidden)},
          'cls': normal(1, 1, hidden), 'pos': normal(1, tokens, hidden), 'blocks': blocks,
          'norm': norm(), 'head': linear(classes, hidden)}


def timm_state_dict(w):
  """timm's VisionTransformer keys; query, key and value fused in `attn.qkv`."""
  sd = {'cls_token': w['cls'], 'pos_embed': w['pos'],
        'patch_embed.proj.weight': w['patch']['weight'],
        'patch_embed.proj.bias': w['patch']['bias'],
        'norm.weight': w['norm']['weight'], 'norm.bias': w['norm']['bias'],
        'head.weight': w['head']['weight'], 'head.bias': w['head']['bias']}
  for i, b in enumerate(w['blocks']):
    for ours, theirs in [('norm1', 'norm1'), ('proj', 'attn.proj'), ('norm2', 'norm2'),
                         ('fc1', 'mlp.fc1'), ('fc2', 'mlp.fc2')]:
      sd[f'blocks.{i}.{theirs}.weight'] = b[ours]['weight']
      sd[f'blocks.{i}.{theirs}.bias'] = b[ours]['bias']
    for kind in ('weight', 'bias'):
      sd[f'blocks.{i}.attn.qkv.{kind}'] = np.concatenate([b[n][kind] for n in 'qkv'])
  return sd


def hugging_face_state_dict(w, prefix='vit.'):
  """transformers' ViTForImageClassification keys (ViTModel's without the `vit.` prefix)."""
  sd = {f'{prefix}embeddings.cls_token': w['cls'],
        f'{prefix}embeddings.position_embeddings': w['pos'],
        f'{prefix}embeddings.patch_embeddings.projection.weight': w['patch']['weight'],
        f'{prefix}embeddings.patch_embeddings.projection.bias': w['patch']['bias'],
        f'{prefix}layernorm.weight': w['norm']['weight'],
        f'{prefix}layernorm.bias': w['norm']['bias'],
        'classifier.weight': w['head']['weight'], 'classifier.bias': w['head']['bias']}
  names = [('norm1', 'layernorm_before'), ('q', 'attention.attention.query'),
           ('k', 'attention.attention.key'), ('v', 'attention.attention.value'),
           ('proj', 'attention.output.dense'), ('norm2', 'layernorm_after'),
           ('fc1', 'intermediate.dense'), ('fc2', 'output.dense')]
  for i, b in enumerate(w['blocks']):
    for ours, theirs in names:
      for kind in ('weight', 'bias'):
        sd[f'{prefix}encoder.layer.{i}.{theirs}.{kind}'] = b[ours][kind]
  return sd


# PyTorch's layer math, in numpy, on the weights of `torch_weights`.

def torch_linear(x, p):
  return x @ p['weight'].T + p['bias']


def torch_layer_norm(x, p, eps):
  mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p['weight'] + p['bias']


def torch_attention(x, b, num_heads):
  t, d = x.shape
  q, k, v = (torch_linear(x, b[n]).reshape(t, num_heads, -1).transpose(1, 0, 2) for n in 'qkv')
  logits = q @ k.transpose(0, 2, 1) / np.sqrt(d // num_heads)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return torch_linear((weights @ v).transpose(1, 0, 2).reshape(t, d), b['proj'])


def torch_vit_logits(image_chw, w, num_heads, eps):
  """Logits of one (C, H, W) image: conv patch embedding, pre-LN blocks with exact GELU."""
  c, h, wd = image_chw.shape
  p = w['patch']['weight'].shape[-1]
  grid = image_chw.reshape(c, h // p, p, wd // p, p)
  tokens = np.einsum('crasb,dcab->rsd', grid, w['patch']['weight'])  # (H/P, W/P, D), row-major
  tokens = tokens.reshape(-1, tokens.shape[-1]) + w['patch']['bias']
  x = np.concatenate([w['cls'][0], tokens]) + w['pos'][0]
  for b in w['blocks']:
    x = x + torch_attention(torch_layer_norm(x, b['norm1'], eps), b, num_heads)
    y = torch_linear(torch_layer_norm(x, b['norm2'], eps), b['fc1'])
    x = x + torch_linear(0.5 * y * (1 + scipy.special.erf(y / np.sqrt(2))), b['fc2'])
  return torch_linear(torch_layer_norm(x, w['norm'], eps)[0], w['head'])


def our_logits(params, images, approximate_gelu=False):
  model = vit.VisionTransformer(
      num_classes=CLASSES, patch_size=(P, P), hidden_size=D, mlp_dim=M, num_heads=N,
      num_layers=LAYERS, approximate_gelu=approximate_gelu)
  apply = jax.jit(lambda x: model.apply({'params': params}, x, train=False))
  return np.asarray(apply(images))


@pytest.mark.parametrize('state_dict,layout,eps', [
    (timm_state_dict, convert.TIMM, TIMM_EPS),
    (hugging_face_state_dict, convert.HUGGING_FACE, HUGGING_FACE_EPS)])
def test_converted_model_computes_the_pytorch_logits(state_dict, layout, eps):
  w = torch_weights()
  params, found_layout = convert.convert_state_dict(state_dict(w), num_heads=N)
  assert found_layout == layout
  images = images_of(SIZE)
  expected = np.stack([torch_vit_logits(x.transpose(2, 0, 1), w, N, eps) for x in images])
  np.testing.assert_allclose(our_logits(params, images), expected, rtol=1e-4, atol=1e-4)


def test_timm_and_hugging_face_layouts_convert_to_the_same_tree():
  w = torch_weights()
  timm, _ = convert.convert_state_dict(timm_state_dict(w), num_heads=N)
  hugging_face, _ = convert.convert_state_dict(hugging_face_state_dict(w), num_heads=N)
  assert jax.tree.structure(timm) == jax.tree.structure(hugging_face)
  jax.tree.map(np.testing.assert_array_equal, timm, hugging_face)
  attention = timm['Transformer']['encoderblock_1']['MultiHeadDotProductAttention_0']
  assert attention['key']['kernel'].shape == (D, N, D // N)
  assert attention['out']['kernel'].shape == (N, D // N, D)
  np.testing.assert_array_equal(  # Head 1 of the key: rows K..2K of torch's weight.
      attention['key']['kernel'][:, 1], w['blocks'][1]['k']['weight'][4:8].T)


def test_hugging_face_pooler_becomes_pre_logits():
  w = torch_weights()
  sd = hugging_face_state_dict(w, prefix='')
  del sd['classifier.weight'], sd['classifier.bias']
  pooler = torch_weights(seed=1)['norm']
  sd['pooler.dense.weight'] = np.outer(pooler['weight'], pooler['bias'])
  sd['pooler.dense.bias'] = pooler['bias']
  params, _ = convert.convert_state_dict(sd, num_heads=N)
  assert 'head' not in params
  np.testing.assert_array_equal(params['pre_logits']['kernel'], sd['pooler.dense.weight'].T)
  assert convert.describe(params) == ('patch 4, hidden 12, MLP 20, 2 layers, 4x4 patches '
                                      '(16 px), no head, pre_logits')


def test_cli_writes_a_published_layout_npz_whose_spec_computes_the_pytorch_logits(tmp_path,
                                                                                  capsys):
  w = torch_weights()
  safetensors.numpy.save_file(timm_state_dict(w), tmp_path / 'vit.safetensors')
  assert convert.main([str(tmp_path / 'vit.safetensors'), str(tmp_path / 'vit.npz'),
                       '--num_heads', str(N)]) == 0
  assert 'Converted the timm state dict' in capsys.readouterr().out
  assert 'Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel' in np.load(tmp_path / 'vit.npz')
  assert not os.path.exists(tmp_path / 'vit.overrides.json')
  model, params = runs.load_model(tmp_path / 'vit.npz')  # The spec alone: no name.
  assert not model.approximate_gelu
  image = images_of(SIZE, batch=1)
  expected = torch_vit_logits(image[0].transpose(2, 0, 1), w, N, TIMM_EPS)
  logits = jax.jit(lambda x: model.apply({'params': params}, x, train=False))(image)
  np.testing.assert_allclose(logits[0], expected, rtol=1e-4, atol=1e-4)


def test_cli_checks_the_shapes_of_a_registry_model(tmp_path, capsys):
  # The registry's 'testing' model: patch 16, hidden 16, MLP 32, 2 heads, 1 layer.
  sd = timm_state_dict(torch_weights(hidden=16, mlp=32, layers=1, patch=16, size=32))
  safetensors.numpy.save_file(sd, tmp_path / 'vit.safetensors')
  args = [str(tmp_path / 'vit.safetensors'), str(tmp_path / 'vit.npz')]
  assert convert.main(args + ['--model', 'testing']) == 0
  assert '2 heads' in capsys.readouterr().out
  args[1] = str(tmp_path / 'other.npz')  # vit.npz exists now, and is never overwritten.
  assert convert.main(args + ['--model', 'ViT-L_16']) == 1  # 16 heads, hidden size 1024.
  error = capsys.readouterr().err
  assert 'vit.safetensors (as ViT-L_16) does not fit the model: ' in error
  assert 'Transformer/encoder_norm/bias is (16,) in the file but (1024,) in the model' in error
  assert convert.main(args + ['--model', 'ViT-Ti_16']) == 1
  assert 'Hidden size 16 is not divisible by num_heads=3: the weights' in capsys.readouterr().err


def test_tensors_a_plain_vit_lacks_are_an_error_not_dropped():
  sd = timm_state_dict(torch_weights())
  sd['fc_norm.weight'] = np.ones(D, np.float32)
  sd['blocks.0.ls1.gamma'] = np.ones(D, np.float32)
  with pytest.raises(ValueError, match=r'holds tensors a plain ViT does not have: '
                                       r'blocks.0.ls1.gamma, fc_norm.weight\. Only plain ViTs'):
    convert.convert_state_dict(sd, num_heads=N)


def test_missing_tensor_is_named():
  sd = timm_state_dict(torch_weights())
  del sd['blocks.1.norm2.bias']
  with pytest.raises(ValueError, match=r"has no 'blocks.1.norm2.bias': only plain ViTs"):
    convert.convert_state_dict(sd, num_heads=N)


def test_unknown_layout_and_bad_heads_are_errors():
  with pytest.raises(ValueError, match=r'neither a timm ViT state dict .* its keys start '
                                       r'conv1.weight, fc.weight'):
    convert.convert_state_dict({'conv1.weight': np.ones(3), 'fc.weight': np.ones(3)}, 2)
  with pytest.raises(ValueError, match='Hidden size 12 is not divisible by num_heads=5: '
                                       'the weights are not of a model with 5 heads'):
    convert.convert_state_dict(timm_state_dict(torch_weights()), num_heads=5)


def test_cli_reports_missing_and_invalid_files(tmp_path, capsys):
  out = str(tmp_path / 'out.npz')
  assert convert.main([str(tmp_path / 'nope.safetensors'), out, '--num_heads', '3']) == 1
  assert f'error: No such .safetensors file: {tmp_path}/nope.safetensors' in capsys.readouterr().err
  (tmp_path / 'junk.safetensors').write_text('junk')
  assert convert.main([str(tmp_path / 'junk.safetensors'), out, '--num_heads', '3']) == 1
  assert f'{tmp_path}/junk.safetensors is not a valid .safetensors file' in capsys.readouterr().err


@pytest.mark.parametrize('key,value,message', [
    ('blocks.0.attn.proj.weight', np.ones((D, D, 1), np.float32),
     r'blocks.0.attn.proj.weight has shape \(12, 12, 1\), where a plain ViT has a tensor of 2 '),
    ('patch_embed.proj.weight', np.ones((D, 3, P), np.float32),
     r'patch_embed.proj.weight has shape \(12, 3, 4\), where a plain ViT has a tensor of 4 '),
    ('blocks.1.mlp.fc1.bias', np.ones(M + 1, np.float32),
     r'blocks.1.mlp.fc1.weight has 20 outputs but blocks.1.mlp.fc1.bias 21 entries'),
    ('blocks.0.attn.qkv.weight', np.ones((3 * D + 1, D), np.float32),
     r'attn.qkv weight has 37 outputs, which do not split into query, key and value'),
    ('blocks.0.attn.proj.weight', np.ones((D, D + 1), np.float32),
     r'Attention output input size 13 is not divisible by num_heads=3'),
])
def test_tensors_of_wrong_shapes_are_named(key, value, message):
  sd = timm_state_dict(torch_weights())
  sd[key] = value
  if key.endswith('qkv.weight'):
    sd['blocks.0.attn.qkv.bias'] = np.ones(3 * D + 1, np.float32)
  with pytest.raises(npz.CheckpointError, match=message) as error:
    convert.convert_state_dict(sd, num_heads=N)
  assert '\n' not in str(error.value)


def test_nan_weights_are_an_error(tmp_path, capsys):
  sd = timm_state_dict(torch_weights())
  sd['blocks.1.mlp.fc2.weight'][0, 0] = np.nan
  sd['pos_embed'][0, 0, 0] = np.inf
  path = str(tmp_path / 'nan.safetensors')
  safetensors.numpy.save_file(sd, path)
  assert convert.main([path, str(tmp_path / 'out.npz'), '--num_heads', str(N)]) == 1
  assert capsys.readouterr().err == (
      f'error: {path} has NaN or infinite values in blocks.1.mlp.fc2.weight, pos_embed: the '
      'weights are damaged; convert an intact copy.\n')
  assert not (tmp_path / 'out.npz').exists()

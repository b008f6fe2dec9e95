"""Converts ViT weights in the PyTorch layout into our parameter tree and a published-layout .npz.

    python -m vit_jax.convert vit_base_patch16_224.safetensors ViT-B_16_timm.npz --model ViT-B_16

Reads a timm or Hugging Face `transformers` state dict from a local .safetensors file (no torch
needed) of a plain ViT: class token, learned position embeddings, pre-LayerNorm blocks. The
layouts differ from ours in that
- torch Linear weights are (out, in): our Dense kernels are their transpose, and the attention
  kernels split the out or in dimension into heads, (D, N, K) and (N, K, D);
- timm fuses query, key and value into one `attn.qkv` Linear of (3D, D), rows [q; k; v];
- the patch-embedding convolution weight is (D, C, P, P), our kernel (P, P, C, D);
- both use exact GELU, so the converted model must run with `approximate_gelu=False`: the
  converter records it in the model spec it saves in the output (`checkpoint.load_model`,
  vit_jax.predict, visualize and fine-tuning read it);
- timm's LayerNorm epsilon is ours, 1e-6; Hugging Face configs use 1e-12, which changes the
  outputs by a relative ~1e-6 for activations of unit variance.
The number of heads is not in the weights: give --model (a registry name, whose shapes are then
checked) or --num_heads.
"""
import argparse
import math
import os
import re
import sys
from typing import Optional

import numpy as np
import safetensors
import safetensors.numpy

from vit_jax import checkpoint
from vit_jax import models
from vit_jax import models_vit

TIMM = 'timm'
HUGGING_FACE = 'Hugging Face'


class StateDict:
  """Tensors of a PyTorch state dict, taken out one by one by key; `leftover` lists the rest."""

  def __init__(self, tensors: dict[str, np.ndarray], source: str):
    self.tensors = dict(tensors)
    self.source = source

  def __contains__(self, key: str) -> bool:
    return key in self.tensors

  def take(self, key: str) -> np.ndarray:
    if key not in self.tensors:
      raise checkpoint.CheckpointError(
          f'{self.source} has no {key!r}: only plain ViTs (class token, learned position '
          'embeddings, pre-LayerNorm blocks) convert.')
    return np.asarray(self.tensors.pop(key), np.float32)

  def take_dense(self, prefix: str) -> dict[str, np.ndarray]:
    """A torch Linear (out, in) as a Dense {'kernel': (in, out), 'bias': (out,)}."""
    return {'kernel': self.take(f'{prefix}.weight').T, 'bias': self.take(f'{prefix}.bias')}

  def take_layer_norm(self, prefix: str) -> dict[str, np.ndarray]:
    return {'scale': self.take(f'{prefix}.weight'), 'bias': self.take(f'{prefix}.bias')}

  def take_patch_embedding(self, prefix: str) -> dict[str, np.ndarray]:
    """The (D, C, P, P) convolution as our (P, P, C, D) kernel."""
    return {'kernel': self.take(f'{prefix}.weight').transpose(2, 3, 1, 0),
            'bias': self.take(f'{prefix}.bias')}

  def count_blocks(self, prefix: str) -> int:
    """Number of `{prefix}{i}.` blocks; 0 when there are none."""
    indices = {int(m.group(1)) for key in self.tensors
               if (m := re.match(re.escape(prefix) + r'(\d+)\.', key))}
    return max(indices) + 1 if indices else 0

  def check_all_taken(self) -> None:
    if self.tensors:
      keys = sorted(self.tensors)
      listed = ', '.join(keys[:6]) + (f' and {len(keys) - 6} more' if len(keys) > 6 else '')
      raise checkpoint.CheckpointError(
          f'{self.source} holds tensors a plain ViT does not have: {listed}. '
          'Only plain ViTs (class token, learned position embeddings) convert.')


def split_heads(dense: dict[str, np.ndarray], num_heads: int) -> dict[str, np.ndarray]:
  """A query/key/value Dense, kernel (D, N*K), bias (N*K,) -> kernel (D, N, K), bias (N, K)."""
  d = dense['kernel'].shape[0]
  if d % num_heads:
    raise checkpoint.CheckpointError(f'Hidden size {d} is not divisible by num_heads={num_heads}: '
                                     f'the weights are not of a model with {num_heads} heads.')
  return {'kernel': dense['kernel'].reshape(d, num_heads, -1),
          'bias': dense['bias'].reshape(num_heads, -1)}


def merge_heads(dense: dict[str, np.ndarray], num_heads: int) -> dict[str, np.ndarray]:
  """The attention's output Dense, kernel (N*K, D) -> kernel (N, K, D); bias (D,) as it is."""
  kernel = dense['kernel']
  return {'kernel': kernel.reshape(num_heads, -1, kernel.shape[1]), 'bias': dense['bias']}


def encoder_block(ln0, qkv, out, ln1, fc1, fc2, num_heads: int) -> dict:
  """Our `encoderblock_{i}` from its LayerNorms and Denses in the torch (unsplit) layout."""
  attention = {name: split_heads(dense, num_heads)
               for name, dense in zip(('query', 'key', 'value'), qkv)}
  attention['out'] = merge_heads(out, num_heads)
  return {'LayerNorm_0': ln0, 'MultiHeadDotProductAttention_0': attention, 'LayerNorm_1': ln1,
          'MlpBlock_0': {'Dense_0': fc1, 'Dense_1': fc2}}


def _split_fused_qkv(dense: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
  """timm's fused qkv Dense, kernel (D, 3D), into the query, key and value Denses."""
  kernels = np.split(dense['kernel'], 3, axis=1)
  biases = np.split(dense['bias'], 3)
  return [{'kernel': k, 'bias': b} for k, b in zip(kernels, biases)]


def _from_timm(sd: StateDict, num_heads: int) -> dict:
  blocks = {}
  for i in range(sd.count_blocks('blocks.')):
    b = f'blocks.{i}.'
    blocks[f'encoderblock_{i}'] = encoder_block(
        sd.take_layer_norm(b + 'norm1'), _split_fused_qkv(sd.take_dense(b + 'attn.qkv')),
        sd.take_dense(b + 'attn.proj'), sd.take_layer_norm(b + 'norm2'),
        sd.take_dense(b + 'mlp.fc1'), sd.take_dense(b + 'mlp.fc2'), num_heads)
  params = {
      'embedding': sd.take_patch_embedding('patch_embed.proj'),
      'cls': sd.take('cls_token'),
      'Transformer': {'posembed_input': {'pos_embedding': sd.take('pos_embed')},
                      'encoder_norm': sd.take_layer_norm('norm'), **blocks},
  }
  if 'pre_logits.fc.weight' in sd:
    params['pre_logits'] = sd.take_dense('pre_logits.fc')
  if 'head.weight' in sd:
    params['head'] = sd.take_dense('head')
  return params


def _from_hugging_face(sd: StateDict, num_heads: int) -> dict:
  blocks = {}
  for i in range(sd.count_blocks('encoder.layer.')):
    b = f'encoder.layer.{i}.'
    blocks[f'encoderblock_{i}'] = encoder_block(
        sd.take_layer_norm(b + 'layernorm_before'),
        [sd.take_dense(f'{b}attention.attention.{name}') for name in ('query', 'key', 'value')],
        sd.take_dense(b + 'attention.output.dense'), sd.take_layer_norm(b + 'layernorm_after'),
        sd.take_dense(b + 'intermediate.dense'), sd.take_dense(b + 'output.dense'), num_heads)
  params = {
      'embedding': sd.take_patch_embedding('embeddings.patch_embeddings.projection'),
      'cls': sd.take('embeddings.cls_token'),
      'Transformer': {
          'posembed_input': {'pos_embedding': sd.take('embeddings.position_embeddings')},
          'encoder_norm': sd.take_layer_norm('layernorm'), **blocks},
  }
  if 'pooler.dense.weight' in sd:  # tanh(Dense(class token)): the published pre_logits.
    params['pre_logits'] = sd.take_dense('pooler.dense')
  if 'classifier.weight' in sd:
    params['head'] = sd.take_dense('classifier')
  return params


def detect_layout(tensors: dict[str, np.ndarray], source: str) -> str:
  """TIMM or HUGGING_FACE, from the key names; a CheckpointError for anything else."""
  if 'blocks.0.attn.qkv.weight' in tensors:
    return TIMM
  if any(key.endswith('encoder.layer.0.attention.attention.query.weight') for key in tensors):
    return HUGGING_FACE
  keys = ', '.join(sorted(tensors)[:4])
  raise checkpoint.CheckpointError(
      f'{source} is neither a timm ViT state dict (blocks.0.attn.qkv.weight) nor a Hugging Face '
      f'one (vit.encoder.layer.0.attention.attention.query.weight); its keys start {keys}.')


def convert_state_dict(tensors: dict[str, np.ndarray], num_heads: int,
                       source: str = 'The state dict') -> tuple[dict, str]:
  """Our parameter tree (float32 numpy) of a timm or Hugging Face ViT state dict, and its layout.

  Every tensor must find its place: leftovers (layer scale, a `fc_norm`, a mask token...) are an
  error, not silently dropped. `head` and `pre_logits` appear only when the state dict has them.
  """
  layout = detect_layout(tensors, source)
  if layout == TIMM:
    sd = StateDict(tensors, source)
    params = _from_timm(sd, num_heads)
  else:  # Hugging Face's ViTModel keys have no prefix, ViTForImageClassification's have `vit.`.
    sd = StateDict({key.removeprefix('vit.'): v for key, v in tensors.items()}, source)
    params = _from_hugging_face(sd, num_heads)
  sd.check_all_taken()
  return params, layout


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """The tensors of a local .safetensors file, by key."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No such .safetensors file: {path}')
  try:
    return safetensors.numpy.load_file(path)
  except (safetensors.SafetensorError, ValueError, OSError) as e:
    raise checkpoint.CheckpointError(
        f'{path} is not a valid .safetensors file ({type(e).__name__}: {e}).') from None


def describe(params: dict) -> str:
  """The architecture the converted weights imply, in words."""
  patch = params['embedding']['kernel'].shape[0]
  hidden = params['embedding']['kernel'].shape[-1]
  blocks = [k for k in params['Transformer'] if k.startswith('encoderblock_')]
  mlp = params['Transformer']['encoderblock_0']['MlpBlock_0']['Dense_0']['kernel'].shape[1]
  tokens = params['Transformer']['posembed_input']['pos_embedding'].shape[1] - 1
  side = math.isqrt(tokens)
  grid = f'{side}x{side} patches ({side * patch} px)' if side**2 == tokens else f'{tokens} patches'
  classes = f'{params["head"]["kernel"].shape[1]} classes' if 'head' in params else 'no head'
  return (f'patch {patch}, hidden {hidden}, MLP {mlp}, {len(blocks)} layers, {grid}, {classes}'
          + (', pre_logits' if 'pre_logits' in params else ''))


def converted_model(params: dict, num_heads: int, model_name: Optional[str] = None):
  """The VisionTransformer, with exact GELU, that the converted `params` are: the registry's
  `model_name`, or without a name the plain ViT of their shapes with `num_heads` heads; classes
  and representation size follow the params (0 classes without a head: features only)."""
  head, representation = (params.get(name, {}).get('kernel') for name in ('head', 'pre_logits'))
  fields = dict(num_classes=0 if head is None else head.shape[1], approximate_gelu=False,
                representation_size=None if representation is None else representation.shape[1])
  if model_name:
    return models.get_model(model_name, **fields)
  kernel = params['embedding']['kernel']  # (P, P, C, D).
  return models_vit.VisionTransformer(
      patch_size=kernel.shape[:2], hidden_size=kernel.shape[-1], num_heads=num_heads,
      mlp_dim=params['Transformer']['encoderblock_0']['MlpBlock_0']['Dense_0']['kernel'].shape[1],
      num_layers=sum(k.startswith('encoderblock_') for k in params['Transformer']), **fields)


def _check_against_registry(params: dict, model, model_name: str, source: str) -> None:
  """A CheckpointError, naming paths and shapes, unless `params` fit `model`, the registry's
  `model_name`."""
  shapes = models.param_shapes(model, checkpoint.native_image_size(params, model))
  if 'head' not in params:
    shapes = {k: v for k, v in shapes.items() if k != 'head'}
  checkpoint.check_matches(params, shapes, source=f'{source} (as {model_name})')


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('input', help='timm or Hugging Face ViT state dict, .safetensors')
  parser.add_argument('output', help='the .npz to write (published layout), with the model spec '
                      '(approximate_gelu=False)')
  heads = parser.add_mutually_exclusive_group(required=True)
  heads.add_argument('--model', help='registry name (e.g. ViT-B_16): gives the number of heads '
                     'and checks every shape')
  heads.add_argument('--num_heads', type=int, help='number of attention heads')
  parser.add_argument('--linen_names', action='store_true',
                      help='write linen module numbering instead of the published pre-linen one')
  return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
  args = parse_args(argv)
  try:
    num_heads = args.num_heads
    if args.model:
      num_heads = models.get_model_config(args.model).transformer.num_heads
    params, layout = convert_state_dict(read_safetensors(args.input), num_heads, args.input)
    model = converted_model(params, num_heads, args.model)
    if args.model:
      _check_against_registry(params, model, args.model, args.input)
    checkpoint.save(params, args.output, linen_names=args.linen_names,
                    spec=models.model_spec(model, args.model))
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  print(f'Converted the {layout} state dict {args.input} ({describe(params)}, {num_heads} heads) '
        f'to {args.output}. It runs with approximate_gelu=False, recorded in its model spec.')
  return 0


if __name__ == '__main__':
  sys.exit(main())

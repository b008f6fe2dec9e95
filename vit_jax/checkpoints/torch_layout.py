"""Where each ViT parameter sits, and in what layout, in timm's and Hugging Face's state dicts.

One table serves both directions: `vit_jax.convert` reads state dicts through it and
`vit_jax.export` writes them. The layouts differ from ours in that
- torch Linear weights are (out, in): our Dense kernels are their transpose, and the attention
  kernels split the out or in dimension into heads, (D, N, K) and (N, K, D);
- timm fuses query, key and value into one `attn.qkv` Linear of (3D, D), rows [q; k; v];
- convolution weights are (out, in, kh, kw), our kernels (kh, kw, in, out).
The number of heads N is not in the torch tensors: reading them needs it.
"""
import dataclasses
import re
from typing import Callable, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from vit_jax.checkpoints import npz

TIMM = 'timm'
HUGGING_FACE = 'Hugging Face'

Path = tuple[str, ...]
POS_EMBEDDING = ('Transformer', 'posembed_input', 'pos_embedding')
# The GELU by `approximate_gelu`: timm's `act_layer`; Hugging Face's `hidden_act`, where
# `gelu_new` and `gelu_pytorch_tanh` are both the tanh approximation (flax's default).
TIMM_GELU = {False: 'gelu', True: 'gelu_tanh'}
HUGGING_FACE_GELU = {False: 'gelu', True: 'gelu_new'}
HUGGING_FACE_TANH_GELUS = ('gelu_new', 'gelu_pytorch_tanh')
# The weights and the config of a Hugging Face model folder (what `save_pretrained` writes).
HUGGING_FACE_WEIGHTS = 'model.safetensors'
HUGGING_FACE_CONFIG = 'config.json'


def _check_heads(size: int, num_heads: int, what: str = 'Hidden size') -> int:
  """`num_heads`, or a CheckpointError unless `size` features of `what` split into them."""
  if size % num_heads:
    raise npz.CheckpointError(
        f'{what} {size} is not divisible by num_heads={num_heads}: the weights are not of a '
        f'model with {num_heads} heads.')
  return num_heads


# Per layout: (ours -> torch, (torch, num_heads) -> ours). Both are exact (transposes, reshapes).
_LAYOUTS: dict[str, tuple[Callable, Callable]] = {
    'as_is': (lambda x: x, lambda x, n: x),
    # Dense kernel (in, out) <-> Linear weight (out, in).
    'linear': (lambda x: x.T, lambda x, n: x.T),
    # Conv kernel (kh, kw, in, out) <-> weight (out, in, kh, kw).
    'conv': (lambda x: x.transpose(3, 2, 0, 1), lambda x, n: x.transpose(2, 3, 1, 0)),
    # Query/key/value kernel (D, N, K) <-> Linear weight (N*K, D).
    'heads_in': (lambda x: x.reshape(x.shape[0], -1).T,
                 lambda x, n: x.T.reshape(x.shape[1], _check_heads(x.shape[0], n), -1)),
    # Query/key/value bias (N, K) <-> (N*K,).
    'heads_bias': (lambda x: x.reshape(-1), lambda x, n: x.reshape(n, -1)),
    # Output kernel (N, K, D) <-> Linear weight (D, N*K).
    'heads_out': (lambda x: x.reshape(-1, x.shape[-1]).T,
                  lambda x, n: x.T.reshape(
                      _check_heads(x.shape[1], n, 'Attention output input size'), -1, x.shape[0])),
}
# The number of dimensions of a torch tensor in each layout ('as_is' tensors vary).
LAYOUT_NDIM = {'linear': 2, 'conv': 4, 'heads_in': 2, 'heads_bias': 1, 'heads_out': 2}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One state-dict tensor: its `key`, the parameters of ours it holds (`paths`; several when
  fused, stacked along torch's first axis) and the `layout` (a _LAYOUTS name) of each part."""
  key: str
  paths: tuple[Path, ...]
  layout: str = 'as_is'

  def to_torch(self, params: dict):
    """The torch tensor from our parameter tree (numpy, jax arrays or tracers)."""
    parts = [_LAYOUTS[self.layout][0](get(params, path)) for path in self.paths]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

  @property
  def ndim(self) -> Optional[int]:
    """The torch tensor's number of dimensions; None where it varies."""
    return LAYOUT_NDIM.get(self.layout)

  def from_torch(self, tensor: np.ndarray, num_heads: int) -> dict[Path, np.ndarray]:
    """Our parameters, by path, from the torch tensor."""
    if tensor.shape[0] % len(self.paths):
      module, kind = self.key.rsplit('.', 1)
      raise npz.CheckpointError(
          f'A fused {module} {kind} has {tensor.shape[0]} outputs, which do not split into query, '
          'key and value: the file is damaged or holds another architecture.')
    parts = np.split(tensor, len(self.paths))
    return {path: _LAYOUTS[self.layout][1](part, num_heads)
            for path, part in zip(self.paths, parts)}


def get(tree: dict, path: Path):
  for name in path:
    tree = tree[name]
  return tree


def _affine(key: str, path: Path, layout: str = 'linear', scale: str = 'kernel') -> list[Tensor]:
  """A module's `{key}.weight` (our `scale`, e.g. a kernel) and `{key}.bias`."""
  return [Tensor(f'{key}.weight', (path + (scale,),), layout),
          Tensor(f'{key}.bias', (path + ('bias',),))]


def _norm(key: str, path: Path) -> list[Tensor]:
  return _affine(key, path, 'as_is', 'scale')


@dataclasses.dataclass(frozen=True)
class Structure:
  """What of a ViT is there: the tables depend on it, not on the sizes.

  `resnet_units` is None without a ResNet stem, else the units per stage (() for the root only).
  """
  num_layers: int
  class_token: bool = True
  pre_logits: bool = False
  head: bool = True
  resnet_units: Optional[Sequence[int]] = None


def _block(key: str, path: Path, attention: list[Tensor], names: dict[str, str]) -> list[Tensor]:
  """One encoder block: `attention`'s query/key/value tensors and the rest, named by `names`."""
  mlp = path + ('MlpBlock_0',)
  out = path + ('MultiHeadDotProductAttention_0', 'out')
  return (_norm(key + names['norm1'], path + ('LayerNorm_0',)) + attention
          + _affine(key + names['proj'], out, 'heads_out')
          + _norm(key + names['norm2'], path + ('LayerNorm_1',))
          + _affine(key + names['fc1'], mlp + ('Dense_0',))
          + _affine(key + names['fc2'], mlp + ('Dense_1',)))


def _qkv_paths(path: Path, kind: str) -> tuple[Path, ...]:
  attention = path + ('MultiHeadDotProductAttention_0',)
  return tuple(attention + (name, kind) for name in ('query', 'key', 'value'))


def _timm_resnet(units: Sequence[int]) -> list[Tensor]:
  """timm's ResNetV2 backbone of a hybrid (`patch_embed.backbone`); () is the root block alone."""
  key = 'patch_embed.backbone.' + ('stem.' if units else '')
  tensors = [Tensor(key + 'conv.weight', (('conv_root', 'kernel'),), 'conv'),
             *_norm(key + 'norm', ('gn_root',))]
  for i, num_units in enumerate(units):
    for j in range(num_units):
      key, path = f'patch_embed.backbone.stages.{i}.blocks.{j}.', (f'block{i + 1}', f'unit{j + 1}')
      convs = [(f'conv{r}', f'norm{r}', f'conv{r}', f'gn{r}') for r in (1, 2, 3)]
      if j == 0:  # The first unit of a stage changes the width (and stride): a projection.
        convs.append(('downsample.conv', 'downsample.norm', 'conv_proj', 'gn_proj'))
      for conv, norm, our_conv, our_norm in convs:
        tensors += [Tensor(f'{key}{conv}.weight', (path + (our_conv, 'kernel'),), 'conv'),
                    *_norm(key + norm, path + (our_norm,))]
  return tensors


def _timm(s: Structure) -> list[Tensor]:
  names = dict(norm1='norm1', proj='attn.proj', norm2='norm2', fc1='mlp.fc1', fc2='mlp.fc2')
  tensors = [] if s.resnet_units is None else _timm_resnet(s.resnet_units)
  tensors += _affine('patch_embed.proj', ('embedding',), 'conv')
  tensors += [Tensor('cls_token', (('cls',),))] if s.class_token else []
  tensors += [Tensor('pos_embed', (POS_EMBEDDING,))]
  for i in range(s.num_layers):
    key, path = f'blocks.{i}.', ('Transformer', f'encoderblock_{i}')
    attention = [Tensor(key + 'attn.qkv.weight', _qkv_paths(path, 'kernel'), 'heads_in'),
                 Tensor(key + 'attn.qkv.bias', _qkv_paths(path, 'bias'), 'heads_bias')]
    tensors += _block(key, path, attention, names)
  tensors += _norm('norm', ('Transformer', 'encoder_norm'))
  tensors += _affine('pre_logits.fc', ('pre_logits',)) if s.pre_logits else []
  return tensors + (_affine('head', ('head',)) if s.head else [])


def _hugging_face(s: Structure) -> list[Tensor]:
  """ViTForImageClassification's keys (ViTModel's, as in `vit_jax.convert`, lack `vit.`)."""
  names = dict(norm1='layernorm_before', proj='attention.output.dense', norm2='layernorm_after',
               fc1='intermediate.dense', fc2='output.dense')
  e = 'vit.embeddings.'
  tensors = _affine(e + 'patch_embeddings.projection', ('embedding',), 'conv')
  tensors += [Tensor(e + 'cls_token', (('cls',),)),
              Tensor(e + 'position_embeddings', (POS_EMBEDDING,))]
  for i in range(s.num_layers):
    key, path = f'vit.encoder.layer.{i}.', ('Transformer', f'encoderblock_{i}')
    attention = []
    for name, kernel, bias in zip(('query', 'key', 'value'), _qkv_paths(path, 'kernel'),
                                  _qkv_paths(path, 'bias')):
      attention += [Tensor(f'{key}attention.attention.{name}.weight', (kernel,), 'heads_in'),
                    Tensor(f'{key}attention.attention.{name}.bias', (bias,), 'heads_bias')]
    tensors += _block(key, path, attention, names)
  tensors += _norm('vit.layernorm', ('Transformer', 'encoder_norm'))
  tensors += _affine('vit.pooler.dense', ('pre_logits',)) if s.pre_logits else []
  return tensors + (_affine('classifier', ('head',)) if s.head else [])


def tensors(layout: str, structure: Structure) -> list[Tensor]:
  """The state-dict tensors of a ViT of `structure` in `layout` (TIMM or HUGGING_FACE)."""
  return (_timm if layout == TIMM else _hugging_face)(structure)


def structure_of(params: dict) -> Structure:
  """The Structure of our (unscanned) parameter tree."""
  stages = sorted((k for k in params if re.fullmatch(r'block\d+', k)), key=lambda k: int(k[5:]))
  return Structure(
      num_layers=sum(k.startswith('encoderblock_') for k in params['Transformer']),
      class_token='cls' in params, pre_logits='pre_logits' in params, head='head' in params,
      resnet_units=(tuple(len(params[k]) for k in stages) if 'conv_root' in params else None))


def to_state_dict(params: dict, layout: str) -> dict:
  """Our parameter tree as a state dict of `layout`, keys in the table's order."""
  return {t.key: t.to_torch(params) for t in tensors(layout, structure_of(params))}

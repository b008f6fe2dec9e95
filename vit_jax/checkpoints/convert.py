"""Converts ViT weights in the PyTorch layout into our parameter tree and a published-layout .npz.

    python -m vit_jax.convert vit_base_patch16_224.safetensors ViT-B_16_timm.npz --model ViT-B_16

Reads a timm or Hugging Face `transformers` state dict from a local .safetensors file, or from
a Hugging Face model folder (no torch needed), of a ViT: class token, or token mean (timm's
`class_token=False, global_pool='avg', fc_norm=False`), learned position embeddings, pre-LayerNorm
blocks, and for timm also the hybrid's ResNet-v2 stem. `vit_jax.torch_layout` holds the names
and layouts; besides,
- both use exact GELU, so the converted model must run with `approximate_gelu=False`, unless
  the file records the tanh approximation as vit_jax.export writes it (timm: `act_layer` in the
  metadata's `timm_model_args`; Hugging Face: `hidden_act` in the config.json beside it); the
  converter records the choice in the model spec it saves in the output (`runs.load_model`,
  vit_jax.predict, visualize and fine-tuning read it);
- timm's LayerNorm epsilon is ours, 1e-6; Hugging Face configs use 1e-12, which changes the
  outputs by a relative ~1e-6 for activations of unit variance.
The number of heads is not in the weights: it is read from the file's timm metadata or the
Hugging Face config.json beside it (vit_jax.export writes both), or give --model (a registry
name, whose shapes are then checked; hybrids need it) or --num_heads. An existing output is
never overwritten.
"""
import argparse
import json
import math
import os
import re
import sys
from typing import Optional

import numpy as np
import safetensors
import safetensors.numpy
from flax import traverse_util

from vit_jax import console
from vit_jax import errors
from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import runs
from vit_jax.checkpoints import torch_layout
from vit_jax.models import registry
from vit_jax.models import vit

TIMM = torch_layout.TIMM
HUGGING_FACE = torch_layout.HUGGING_FACE


class StateDict:
  """Tensors of a PyTorch state dict, taken out one by one by key; `leftover` lists the rest."""

  def __init__(self, tensors: dict[str, np.ndarray], source: str):
    self.tensors = dict(tensors)
    self.source = source

  def __contains__(self, key: str) -> bool:
    return key in self.tensors

  def take(self, key: str, ndim: Optional[int]) -> np.ndarray:
    """The tensor `key`, float32, which must have `ndim` dimensions (any number where None)."""
    if key not in self.tensors:
      raise npz.CheckpointError(
          f'{self.source} has no {key!r}: only plain ViTs (class token, learned position '
          'embeddings, pre-LayerNorm blocks) convert.')
    tensor = np.asarray(self.tensors.pop(key), np.float32)
    if ndim is not None and tensor.ndim != ndim:
      raise npz.CheckpointError(
          f'{self.source}: {key} has shape {tensor.shape}, where a plain ViT has a tensor of '
          f'{ndim} dimensions: the file is damaged or holds another architecture.')
    return tensor

  def count_blocks(self, prefix: str) -> int:
    """Number of `{prefix}{i}.` blocks; 0 when there are none."""
    indices = {int(m.group(1)) for key in self.tensors
               if (m := re.match(re.escape(prefix) + r'(\d+)\.', key))}
    return max(indices) + 1 if indices else 0

  def check_all_taken(self) -> None:
    if self.tensors:
      keys = sorted(self.tensors)
      listed = ', '.join(keys[:6]) + (f' and {len(keys) - 6} more' if len(keys) > 6 else '')
      raise npz.CheckpointError(
          f'{self.source} holds tensors a plain ViT does not have: {listed}. '
          'Only plain ViTs (class token, learned position embeddings) convert.')


def _structure(sd: StateDict, layout: str) -> torch_layout.Structure:
  """What of a ViT the state dict holds, from its key names."""
  if layout == HUGGING_FACE:
    return torch_layout.Structure(sd.count_blocks('vit.encoder.layer.'),
                                  pre_logits='vit.pooler.dense.weight' in sd,
                                  head='classifier.weight' in sd)
  stages, resnet_units = 'patch_embed.backbone.stages.', None
  if any(key.startswith('patch_embed.backbone.') for key in sd.tensors):
    resnet_units = tuple(sd.count_blocks(f'{stages}{i}.blocks.')
                         for i in range(sd.count_blocks(stages)))
  return torch_layout.Structure(
      sd.count_blocks('blocks.'), class_token='cls_token' in sd,
      pre_logits='pre_logits.fc.weight' in sd, head='head.weight' in sd,
      resnet_units=resnet_units)


def detect_layout(tensors: dict[str, np.ndarray], source: str) -> str:
  """TIMM or HUGGING_FACE, from the key names; a CheckpointError for anything else."""
  if 'blocks.0.attn.qkv.weight' in tensors:
    return TIMM
  if any(key.endswith('encoder.layer.0.attention.attention.query.weight') for key in tensors):
    return HUGGING_FACE
  keys = ', '.join(sorted(tensors)[:4])
  raise npz.CheckpointError(
      f'{source} is neither a timm ViT state dict (blocks.0.attn.qkv.weight) nor a Hugging Face '
      f'one (vit.encoder.layer.0.attention.attention.query.weight); its keys start {keys}.')


def _check_biases(tensors: dict[str, np.ndarray], source: str) -> None:
  """A CheckpointError unless each torch module's `.bias` has one entry per output (the first
  dimension of its `.weight`)."""
  for key, weight in tensors.items():
    prefix = key.removesuffix('.weight')
    bias = tensors.get(prefix + '.bias')
    if key.endswith('.weight') and bias is not None and np.shape(bias)[:1] != np.shape(weight)[:1]:
      raise npz.CheckpointError(
          f'{source}: {key} has {np.shape(weight)[0]} outputs but {prefix}.bias '
          f'{np.shape(bias)[0]} entries: the file is damaged or holds another architecture.')


def convert_state_dict(tensors: dict[str, np.ndarray], num_heads: int,
                       source: str = 'The state dict') -> tuple[dict, str]:
  """Our parameter tree (float32 numpy) of a timm or Hugging Face ViT state dict, and its layout.

  Every tensor must find its place: leftovers (layer scale, a `fc_norm`, a mask token...) are an
  error, not silently dropped. `head` and `pre_logits` appear only when the state dict has them.
  Tensors of unexpected ranks and non-finite values are errors too.
  """
  damaged = sorted(key for key, value in tensors.items() if not np.isfinite(value).all())
  if damaged:
    listed = ', '.join(damaged[:4]) + (f' and {len(damaged) - 4} more' if len(damaged) > 4 else '')
    raise npz.CheckpointError(f'{source} has NaN or infinite values in {listed}: the '
                                     'weights are damaged; convert an intact copy.')
  _check_biases(tensors, source)
  layout = detect_layout(tensors, source)
  if layout == HUGGING_FACE:  # ViTModel's keys lack the `vit.` of ViTForImageClassification's.
    tensors = {key if key.startswith(('vit.', 'classifier.')) else 'vit.' + key: value
               for key, value in tensors.items()}
  sd = StateDict(tensors, source)
  flat = {}
  for tensor in torch_layout.tensors(layout, _structure(sd, layout)):
    flat.update(tensor.from_torch(sd.take(tensor.key, tensor.ndim), num_heads))
  sd.check_all_taken()
  return traverse_util.unflatten_dict(flat), layout


def safetensors_file(path: str) -> str:
  """`path`, or where it is a Hugging Face model folder (`save_pretrained`'s, or
  `vit_jax.export --format hf`'s) the weights file in it."""
  if not os.path.isdir(path):
    return path
  weights = os.path.join(path, torch_layout.HUGGING_FACE_WEIGHTS)
  if not os.path.isfile(weights):
    raise FileNotFoundError(f'{path} is a folder without a {torch_layout.HUGGING_FACE_WEIGHTS}: '
                            'give a .safetensors file, or a Hugging Face model folder.')
  return weights


def read_safetensors(path: str) -> dict[str, np.ndarray]:
  """The tensors of a local .safetensors file, by key."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No such .safetensors file: {path}')
  try:
    return safetensors.numpy.load_file(path)
  except (safetensors.SafetensorError, ValueError, OSError) as e:
    raise npz.CheckpointError(
        f'{path} is not a valid .safetensors file ({type(e).__name__}: {e}).') from None


def describe(params: dict) -> str:
  """The architecture the converted weights imply, in words."""
  patch = params['embedding']['kernel'].shape[0]
  hidden = params['embedding']['kernel'].shape[-1]
  blocks = [k for k in params['Transformer'] if k.startswith('encoderblock_')]
  mlp = params['Transformer']['encoderblock_0']['MlpBlock_0']['Dense_0']['kernel'].shape[1]
  tokens = params['Transformer']['posembed_input']['pos_embedding'].shape[1] - ('cls' in params)
  side = math.isqrt(tokens)
  grid = f'{side}x{side} patches ({side * patch} px)' if side**2 == tokens else f'{tokens} patches'
  classes = f'{params["head"]["kernel"].shape[1]} classes' if 'head' in params else 'no head'
  return (f'patch {patch}, hidden {hidden}, MLP {mlp}, {len(blocks)} layers, {grid}, {classes}'
          + (', pre_logits' if 'pre_logits' in params else ''))


# (timm model arguments, Hugging Face config) that come with a .safetensors file, each None where
# absent (`recorded_settings`).
Settings = tuple[Optional[dict], Optional[dict]]


def recorded_settings(path: str) -> Settings:
  """The Settings that come with the .safetensors at `path`: the `timm_model_args` of its metadata
  (vit_jax.export writes them), and the config.json beside it."""
  with safetensors.safe_open(path, 'numpy') as f:
    metadata = f.metadata() or {}
  if 'timm_model_args' in metadata:
    return json.loads(metadata['timm_model_args']), None
  config = os.path.join(os.path.dirname(path), torch_layout.HUGGING_FACE_CONFIG)
  if not os.path.isfile(config):
    return None, None
  try:
    with open(config) as f:
      return None, json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise npz.CheckpointError(f'{config}, the Hugging Face config beside {path}, is not '
                                     f'valid JSON ({e}): repair or remove it.') from None


def approximate_gelu(settings: Settings) -> bool:
  """Whether the weights that come with `settings` run with the tanh-approximate GELU."""
  timm_args, hf_config = settings
  if timm_args is not None:
    return timm_args.get('act_layer') == torch_layout.TIMM_GELU[True]
  return (hf_config or {}).get('hidden_act') in torch_layout.HUGGING_FACE_TANH_GELUS


def recorded_num_heads(settings: Settings, path: str) -> int:
  """The number of heads that the .safetensors at `path` records in its `settings`; a
  CheckpointError saying what to give where it records none."""
  timm_args, hf_config = settings
  heads = (timm_args or {}).get('num_heads') or (hf_config or {}).get('num_attention_heads')
  if not heads:
    raise npz.CheckpointError(
        f'{path} does not record its number of attention heads (neither in its timm metadata nor '
        'in a Hugging Face config.json beside it): give --num_heads N, or --model NAME.')
  return int(heads)


def recorded_label_names(settings: Settings, num_classes: int) -> Optional[list[str]]:
  """The class names, in label order, of the Hugging Face config in `settings` (its id2label, one
  for each of `num_classes`); None where it records none."""
  _, hf_config = settings
  names = (hf_config or {}).get('id2label') or {}
  if not num_classes or set(names) != {str(i) for i in range(num_classes)}:
    return None
  return [names[str(i)] for i in range(num_classes)]


def converted_model(params: dict, num_heads: int, model_name: Optional[str] = None,
                    approximate: bool = False):
  """The VisionTransformer that the converted `params` are: the registry's `model_name`, or
  without a name the ViT of their shapes with `num_heads` heads (class token or token mean);
  classes and representation size follow the params (0 classes without a head: features only),
  the GELU `approximate` (see `approximate_gelu`)."""
  head, representation = (params.get(name, {}).get('kernel') for name in ('head', 'pre_logits'))
  fields = dict(num_classes=0 if head is None else head.shape[1], approximate_gelu=approximate,
                representation_size=None if representation is None else representation.shape[1])
  if model_name:
    return registry.get_model(model_name, **fields)
  if 'conv_root' in params:
    raise npz.CheckpointError('A hybrid (ResNet stem) converts only with --model NAME: '
                                     'its stem is not described by --num_heads.')
  kernel = params['embedding']['kernel']  # (P, P, C, D).
  return vit.VisionTransformer(
      patch_size=kernel.shape[:2], hidden_size=kernel.shape[-1], num_heads=num_heads,
      mlp_dim=params['Transformer']['encoderblock_0']['MlpBlock_0']['Dense_0']['kernel'].shape[1],
      num_layers=sum(k.startswith('encoderblock_') for k in params['Transformer']),
      classifier='token' if 'cls' in params else 'gap', **fields)


def _check_against_registry(params: dict, model, model_name: str, source: str) -> None:
  """A CheckpointError, naming paths and shapes, unless `params` fit `model`, the registry's
  `model_name`."""
  shapes = registry.param_shapes(model, runs.native_image_size(params, model))
  if 'head' not in params:
    shapes = {k: v for k, v in shapes.items() if k != 'head'}
  finetune.check_matches(params, shapes, source=f'{source} (as {model_name})')


def check_output(path: str) -> None:
  """A FileExistsError or errors.OutputError unless `path` is free for the converted .npz:
  an existing file or folder is never overwritten."""
  if os.path.isdir(path):
    raise FileExistsError(f'{path} is a folder: give the path of the .npz file to write, e.g. '
                          f'{os.path.join(path, "model.npz")}.')
  errors.prepare_new_output(path, 'output')


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
  parser = console.command_parser(
      'convert', description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('input', help='timm or Hugging Face ViT state dict, .safetensors, or a '
                      'Hugging Face model folder (its model.safetensors and config.json)')
  parser.add_argument('output', help='the .npz to write (published layout), with the model spec '
                      '(which records approximate_gelu)')
  heads = parser.add_mutually_exclusive_group()
  heads.add_argument('--model', help='registry name (e.g. ViT-B_16): gives the number of heads '
                     'and checks every shape; needed for hybrids')
  heads.add_argument('--num_heads', type=int, help='number of attention heads; default: the one '
                     "recorded in the file's timm metadata or the Hugging Face config.json "
                     'beside it (vit_jax.export writes both)')
  parser.add_argument('--linen_names', action='store_true',
                      help='write linen module numbering instead of the published pre-linen one')
  return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
  args = parse_args(argv)
  try:
    check_output(args.output)
    source = safetensors_file(args.input)
    tensors = read_safetensors(source)
    settings = recorded_settings(source)
    num_heads = args.num_heads
    if args.model:
      num_heads = registry.get_model_config(args.model).transformer.num_heads
    elif num_heads is None:
      num_heads = recorded_num_heads(settings, source)
    params, layout = convert_state_dict(tensors, num_heads, source)
    model = converted_model(params, num_heads, args.model, approximate_gelu(settings))
    if args.model:
      _check_against_registry(params, model, args.model, source)
    spec = registry.model_spec(model, args.model)
    names = recorded_label_names(settings, model.num_classes)
    npz.save(params, args.output, linen_names=args.linen_names,
             spec={**spec, 'label_names': names} if names else spec)
  except (ValueError, OSError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  print(f'Converted the {layout} state dict {source} ({describe(params)}, {num_heads} heads) '
        f'to {args.output}. It runs with approximate_gelu={model.approximate_gelu}, recorded in '
        'its model spec.')
  return 0


if __name__ == '__main__':
  console.run(main)

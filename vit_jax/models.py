"""The model registry: `get_model(name, num_classes=...)` builds any model of `MODEL_CONFIGS`.

`python -m vit_jax.models` prints the registry with parameter counts and GFLOPs per image.
"""
import argparse
from typing import Optional, Union

import jax
import ml_collections

from vit_jax import config as default_config
from vit_jax import console
from vit_jax import model_init
from vit_jax import models_vit
from vit_jax.registry import MODEL_CONFIGS, TRANSFORMER_DEFAULTS

__all__ = ['MODEL_CONFIGS', 'LISTED_MODELS', 'get_model', 'model_spec', 'model_from_spec',
           'count_params', 'forward_flops', 'gflops_per_image']

# The registry names shown to users: all but the tiny 'testing' model the tests build.
LISTED_MODELS = tuple(name for name in MODEL_CONFIGS if name != 'testing')
# VisionTransformer fields that choose how the model runs, not what it computes: left out of
# its spec, and chosen anew by whoever loads it.
EXECUTION_FIELDS = ('dtype', 'scan_layers', 'remat_policy', 'attention')


def get_model_config(name: str) -> ml_collections.ConfigDict:
  """A copy of the registry's config `name`; a ValueError that lists the known names if unknown."""
  if name not in MODEL_CONFIGS:
    raise ValueError(f'Unknown model {name!r}. Known models: {", ".join(LISTED_MODELS)}.')
  return MODEL_CONFIGS[name].copy_and_resolve_references()


def model_kwargs(config: ml_collections.ConfigDict) -> dict:
  """VisionTransformer's arguments from a registry-style config; a field of
  registry.TRANSFORMER_DEFAULTS that `config.transformer` lacks takes its value from there."""
  transformer = ml_collections.ConfigDict({**TRANSFORMER_DEFAULTS, **config.transformer})
  resnet = config.get('resnet')
  return dict(
      patch_size=tuple(config.patches.size),
      hidden_size=config.hidden_size,
      mlp_dim=transformer.mlp_dim,
      num_heads=transformer.num_heads,
      num_layers=transformer.num_layers,
      dropout_rate=transformer.dropout_rate,
      attention_dropout_rate=transformer.attention_dropout_rate,
      stochastic_depth=transformer.stochastic_depth,
      stochastic_depth_schedule=transformer.stochastic_depth_schedule,
      classifier=config.classifier,
      representation_size=config.representation_size,
      resnet_layers=None if resnet is None else tuple(resnet.num_layers),
      resnet_width_factor=1 if resnet is None else resnet.width_factor,
  )


def get_model(name_or_config: Union[str, ml_collections.ConfigDict], *, num_classes: int,
              **overrides) -> models_vit.VisionTransformer:
  """Builds a VisionTransformer from a registry name (e.g. 'ViT-B_16') or a model config.

  `overrides` replace any VisionTransformer field, e.g. `dtype=jnp.bfloat16`,
  `classifier='gap'`, `dropout_rate=0.1`, `stochastic_depth=0.1`, `approximate_gelu=False`.
  """
  config = (get_model_config(name_or_config) if isinstance(name_or_config, str)
            else name_or_config)
  kwargs = model_kwargs(config)
  unknown = set(overrides) - set(models_vit.VisionTransformer.__dataclass_fields__)
  if unknown:
    raise ValueError(f'Unknown model fields {sorted(unknown)}; VisionTransformer takes '
                     f'{sorted(models_vit.VisionTransformer.__dataclass_fields__)}.')
  kwargs.update(overrides)
  return models_vit.VisionTransformer(num_classes=num_classes, **kwargs)


def spec_fields() -> tuple[str, ...]:
  """The VisionTransformer fields a model spec holds: all but flax's and EXECUTION_FIELDS."""
  return tuple(f for f in models_vit.VisionTransformer.__dataclass_fields__
               if f not in ('parent', 'name') + EXECUTION_FIELDS)


def model_spec(model: models_vit.VisionTransformer, name: Optional[str] = None) -> dict:
  """The model as plain, JSON-serialisable data: {'name': name, 'model': {field: value}}.

  The fields are those of `spec_fields()` (tuples become lists); `model_from_spec` inverts it.
  `name` is a label for messages (e.g. the registry or config name), not used to rebuild.
  """
  plain = lambda v: list(v) if isinstance(v, tuple) else v
  return {'name': name, 'model': {f: plain(getattr(model, f)) for f in spec_fields()}}


def model_from_spec(spec: dict, **overrides) -> models_vit.VisionTransformer:
  """The VisionTransformer of a `model_spec`, with `overrides` for other fields (e.g. dtype).

  A ValueError says why `spec` is not a spec this version reads: not one, unknown fields (a newer
  version's), or required fields missing.
  """
  fields = spec.get('model') if isinstance(spec, dict) else None
  if not isinstance(fields, dict):
    raise ValueError(f'Not a model spec: {str(spec)[:200]}; expected '
                     "{'name': ..., 'model': {field: value}}.")
  if unknown := sorted(set(fields) - set(spec_fields())):
    raise ValueError(f'The model spec has fields {unknown} that this vit_jax does not know '
                     f'(written by a newer version?); it knows {list(spec_fields())}.')
  kwargs = {f: tuple(v) if isinstance(v, list) else v for f, v in fields.items()}
  try:
    return models_vit.VisionTransformer(**{**kwargs, **overrides})
  except TypeError as e:  # Required fields missing.
    raise ValueError(f'Incomplete model spec: {e}.') from None


def param_shapes(model: models_vit.VisionTransformer, image_size: int = 224):
  """The parameter tree as ShapeDtypeStructs, computed without allocating memory."""
  return model_init.param_shapes(model, image_size)


def count_params(model: models_vit.VisionTransformer, image_size: int = 224) -> int:
  """Number of parameters at `image_size` (the position embeddings depend on it).

  Counted on the model with scanned blocks, which holds the same parameters stacked and traces
  one block instead of every one."""
  scanned = model.clone(scan_layers=True)
  return sum(x.size for x in jax.tree.leaves(param_shapes(scanned, image_size)))


# FLOPs per element of the element-wise parts, as XLA's cost analysis counts them (exp, tanh
# and rsqrt count as transcendentals, not FLOPs): LayerNorm and GroupNorm (mean, variance,
# centre, scale, shift), softmax over each logit (max, subtract, sum, divide), tanh-approximated
# GELU, a max-pool output (one comparison per window element but the first), and the
# weight standardisation of each kernel element of the stem (once per forward pass, whatever the
# batch: counted here for a batch of one).
NORM_FLOPS = 5
SOFTMAX_FLOPS = 4
GELU_FLOPS = 8
STANDARDIZE_FLOPS = 7


def same_conv_taps(size: int, kernel: int, stride: int) -> tuple[int, int]:
  """(kernel taps that fall inside the input, summed over the outputs; output size) along one
  side of a 'SAME'-padded convolution or pool (padding taps do no work)."""
  out = -(-size // stride)
  before = max((out - 1) * stride + kernel - size, 0) // 2
  taps = sum(min(o * stride - before + kernel, size) - max(o * stride - before, 0)
             for o in range(out))
  return taps, out


def conv_flops(size: int, cin: int, cout: int, kernel: int, stride: int = 1) -> tuple[int, int]:
  """(FLOPs of models_resnet.StdConv, bias-free and 'SAME', on a size x size x cin map, with
  its weight standardisation; its output size)."""
  taps, out = same_conv_taps(size, kernel, stride)
  return (2 * taps * taps + STANDARDIZE_FLOPS * kernel * kernel) * cin * cout, out


def residual_unit_flops(size: int, cin: int, features: int, stride: int) -> tuple[int, int]:
  """(FLOPs of models_resnet.ResidualUnit on a size x size x cin map, its output size)."""
  conv1, _ = conv_flops(size, cin, features, 1)
  conv2, out = conv_flops(size, features, features, 3, stride)
  conv3, _ = conv_flops(out, features, 4 * features, 1)
  flops = conv1 + conv2 + conv3 + (NORM_FLOPS + 1) * (size**2 + out**2) * features  # gn, ReLU.
  flops += (NORM_FLOPS + 2) * out**2 * 4 * features  # gn3, residual add, ReLU.
  if cin != 4 * features or stride != 1:
    flops += conv_flops(size, cin, 4 * features, 1, stride)[0] + NORM_FLOPS * out**2 * 4 * features
  return flops, out


def stem_flops(model: models_vit.VisionTransformer, image_size: int) -> tuple[int, int, int]:
  """(FLOPs of the hybrid's ResNet stem on one image, side and channels of the map it gives);
  (0, image_size, 3) without a stem."""
  if model.resnet_layers is None:
    return 0, image_size, 3
  width = int(64 * model.resnet_width_factor)
  flops, size = conv_flops(image_size, 3, width, 7, 2)
  flops += (NORM_FLOPS + 1) * size**2 * width  # gn_root, ReLU.
  taps, size = same_conv_taps(size, 3, 2)
  flops += (taps**2 - size**2) * width  # Max-pool comparisons.
  channels = width
  for i, num_units in enumerate(model.resnet_layers):
    for j in range(num_units):
      unit, size = residual_unit_flops(size, channels, width * 2**i, 2 if i and not j else 1)
      flops, channels = flops + unit, 4 * width * 2**i
  return flops, size, channels


def block_flops(tokens: int, hidden: int, mlp: int, heads: int) -> int:
  """FLOPs of one Encoder1DBlock on (tokens, hidden): Q/K/V/out projections, both attention
  products (logits, weighted values), the MLP, and the element-wise parts."""
  t, d = tokens, hidden
  products = 2 * t * d * (4 * d + 2 * mlp) + 4 * t * t * d
  elementwise = (t * d * (2 * NORM_FLOPS + 8) + t * mlp * (GELU_FLOPS + 1)  # Biases, scale, adds.
                 + SOFTMAX_FLOPS * heads * t * t)
  return products + elementwise


def forward_flops(model: models_vit.VisionTransformer, image_size: int = 224) -> int:
  """FLOPs of the forward pass of one image_size x image_size image, counted from the model's
  shapes (a multiply-add is 2 FLOPs): the hybrid stem's convolutions, the patch embedding, each
  block (vit_jax.models.block_flops), the head. Matches XLA's cost analysis on CPU to within
  1% for every registry model, and needs no backend."""
  flops, size, channels = stem_flops(model, image_size)
  (ph, pw), d = model.patch_size, model.hidden_size
  patches = (size // ph) * (size // pw)
  tokens = patches + (model.classifier in ('token', 'token_unpooled'))
  flops += 2 * patches * ph * pw * channels * d + patches * d + tokens * d  # Bias, posemb.
  flops += model.num_layers * block_flops(tokens, d, model.mlp_dim, model.num_heads)
  flops += NORM_FLOPS * tokens * d  # encoder_norm.
  outputs = tokens if model.classifier.endswith('unpooled') else 1
  if model.classifier == 'gap':
    flops += tokens * d + d
  if model.representation_size is not None:
    flops += outputs * (2 * d + 1) * model.representation_size
    d = model.representation_size
  return flops + outputs * (2 * d + 1) * model.num_classes


def gflops_per_image(model: models_vit.VisionTransformer, image_size: int = 224) -> float:
  """Forward-pass GFLOPs of one image (`forward_flops` / 1e9)."""
  return forward_flops(model, image_size) / 1e9


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--image_size', type=int, default=224)
  parser.add_argument('--num_classes', type=int, default=1000)
  args = parser.parse_args()
  print(f'{"model":<18} {"params":>13} {"GFLOPs/image":>13}   at {args.image_size} px, '
        f'{args.num_classes} classes')
  for name, config in listed_model_configs():
    model = get_model(config, num_classes=args.num_classes)
    size = args.image_size
    print(f'{name:<18} {count_params(model, size):>13,} {gflops_per_image(model, size):>13.2f}',
          flush=True)
  print(f'The last row, {default_config.get_config().model_name}, is the model of the default '
        'run, python -m vit_jax.main (vit_jax/config.py; it trains at 28 px).')


def listed_model_configs() -> list[tuple[str, ml_collections.ConfigDict]]:
  """(name, model config) of each of LISTED_MODELS, then of the default run's model (a model of
  its own, not a registry name)."""
  default = default_config.get_config()
  return [(name, MODEL_CONFIGS[name]) for name in LISTED_MODELS] + [
      (default.model_name, default.model)]


if __name__ == '__main__':
  console.run(main)

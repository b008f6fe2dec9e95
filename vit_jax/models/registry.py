"""The model registry: the configurations of the published models, by name (`MODEL_CONFIGS`),
the short names that the configs/ files take for them (`SHORT_NAMES`), and the models built from
a name or a config (`get_model`) or from the spec saved with them (`model_spec`,
`model_from_spec`), with their parameter shapes and counts.

Sizes follow Table 1 of the paper (hidden size D, MLP size, heads, layers):
Ti 192/768/3/12, S 384/1536/6/12, B 768/3072/12/12, L 1024/4096/16/24, H 1280/5120/16/32.
Each config holds: `name`, `patches.size`, `hidden_size`, `transformer` (mlp_dim, num_heads,
num_layers, dropout_rate, attention_dropout_rate, stochastic_depth and its schedule: see
VisionTransformer), `classifier`, `representation_size`
and `resnet` (None, or num_layers and width_factor of the hybrid's ResNet stem).
"""
import dataclasses
from typing import Optional, Union

import jax
import ml_collections

from vit_jax.models import blank
from vit_jax.models.vit import VisionTransformer


MODEL_CONFIGS: dict[str, ml_collections.ConfigDict] = {}
# {short name: registry name}: the MODEL of `--config=configs/vit.py:MODEL,DATASET` (b16 for
# ViT-B_16), which the configs/ files read through `full_name`.
SHORT_NAMES: dict[str, str] = {}


def _register(config: ml_collections.ConfigDict,
              short_name: str | None = None) -> ml_collections.ConfigDict:
  MODEL_CONFIGS[config.name] = config
  if short_name is not None:
    SHORT_NAMES[short_name] = config.name
  return config


def full_name(name: str) -> str:
  """The registry name of a short name (b16 -> ViT-B_16); any other name as it is."""
  return SHORT_NAMES.get(name, name)


# The transformer fields that `vit` takes no argument for, each with VisionTransformer's default
# (the value every registry model has). A model config without one (an older run's config.json
# has no stochastic depth) behaves as with this value: `model_kwargs` and
# training.resume.resume_mismatches read it from here.
TRANSFORMER_DEFAULTS = {field.name: field.default for field in dataclasses.fields(VisionTransformer)
                        if field.name in ('attention_dropout_rate', 'stochastic_depth',
                                          'stochastic_depth_schedule')}


def vit(name, patch, hidden, mlp, heads, layers, dropout=0.0, classifier='token'):
  """A plain ViT with square `patch` x `patch` patches."""
  return ml_collections.ConfigDict({
      'name': name,
      'patches': {'size': (patch, patch)},
      'hidden_size': hidden,
      'transformer': {
          'mlp_dim': mlp, 'num_heads': heads, 'num_layers': layers, 'dropout_rate': dropout,
          **TRANSFORMER_DEFAULTS,
      },
      'classifier': classifier,
      'representation_size': None,
      'resnet': None,
  })


def hybrid(name, base, patch, num_layers, dropout=None):
  """`base` fed by a ResNet-v2 stem with `num_layers` units per stage, on `patch` patches."""
  config = base.copy_and_resolve_references()
  config.name = name
  config.patches.size = (patch, patch)
  config.resnet = ml_collections.ConfigDict({'num_layers': num_layers, 'width_factor': 1})
  if dropout is not None:
    config.transformer.dropout_rate = dropout
  return config


def gap(base):
  """`base` classifying the mean of the patch tokens (no class token)."""
  config = base.copy_and_resolve_references()
  config.name = base.name + '-gap'
  config.classifier = 'gap'
  return config


TI16 = _register(vit('ViT-Ti_16', 16, 192, 768, 3, 12), 'ti16')
S16 = _register(vit('ViT-S_16', 16, 384, 1536, 6, 12), 's16')
S32 = _register(vit('ViT-S_32', 32, 384, 1536, 6, 12), 's32')
B8 = _register(vit('ViT-B_8', 8, 768, 3072, 12, 12), 'b8')
B16 = _register(vit('ViT-B_16', 16, 768, 3072, 12, 12), 'b16')
B32 = _register(vit('ViT-B_32', 32, 768, 3072, 12, 12), 'b32')
L16 = _register(vit('ViT-L_16', 16, 1024, 4096, 16, 24, dropout=0.1), 'l16')
L32 = _register(vit('ViT-L_32', 32, 1024, 4096, 16, 24), 'l32')
H14 = _register(vit('ViT-H_14', 14, 1280, 5120, 16, 32, dropout=0.1), 'h14')
for _short_name, _base in (('s16', S16), ('s32', S32), ('b16', B16), ('b32', B32)):
  _register(gap(_base), _short_name + '_gap')

# The stem alone (root block, stride 4) under 8x8 patches; the others stack stages.
_register(hybrid('R+ViT-Ti_16', TI16, 8, ()), 'r_ti16')
_register(hybrid('R26+ViT-S_32', S32, 1, (2, 2, 2, 2)), 'r26_s32')
_register(hybrid('R26+ViT-B_32', B32, 1, (2, 2, 2, 2)), 'r26_b32')
# ResNet-50 with (3, 4, 9) instead of (3, 4, 6, 3) units: the third stage is extended so the
# feature map keeps stride 16.
_register(hybrid('R50+ViT-B_16', B16, 1, (3, 4, 9), dropout=0.1), 'r50_b16')
_register(hybrid('R50+ViT-L_32', L32, 1, (3, 4, 6, 3)), 'r50_l32')

# A tiny model for tests and quick experiments.
_register(vit('testing', 16, 16, 32, 2, 1))


# The registry names shown to users: all but the tiny 'testing' model the tests build.
LISTED_MODELS = tuple(name for name in MODEL_CONFIGS if name != 'testing')


# VisionTransformer fields that choose how the model runs, not what it computes: left out of
# its spec, and chosen anew by whoever loads it (the apply-time size: `VisionTransformer.any_size`).
EXECUTION_FIELDS = ('dtype', 'scan_layers', 'remat_policy', 'attention', 'dynamic_img_size',
                    'posemb_grid')


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
              **overrides) -> VisionTransformer:
  """Builds a VisionTransformer from a registry name (e.g. 'ViT-B_16') or a model config.

  `overrides` replace any VisionTransformer field, e.g. `dtype=jnp.bfloat16`,
  `classifier='gap'`, `dropout_rate=0.1`, `stochastic_depth=0.1`, `approximate_gelu=False`.
  """
  config = (get_model_config(name_or_config) if isinstance(name_or_config, str)
            else name_or_config)
  kwargs = model_kwargs(config)
  unknown = set(overrides) - set(VisionTransformer.__dataclass_fields__)
  if unknown:
    raise ValueError(f'Unknown model fields {sorted(unknown)}; VisionTransformer takes '
                     f'{sorted(VisionTransformer.__dataclass_fields__)}.')
  kwargs.update(overrides)
  return VisionTransformer(num_classes=num_classes, **kwargs)


def spec_fields() -> tuple[str, ...]:
  """The VisionTransformer fields a model spec holds: all but flax's and EXECUTION_FIELDS."""
  return tuple(f for f in VisionTransformer.__dataclass_fields__
               if f not in ('parent', 'name') + EXECUTION_FIELDS)


def model_spec(model: VisionTransformer, name: Optional[str] = None) -> dict:
  """The model as plain, JSON-serialisable data: {'name': name, 'model': {field: value}}.

  The fields are those of `spec_fields()` (tuples become lists); `model_from_spec` inverts it.
  `name` is a label for messages (e.g. the registry or config name), not used to rebuild.
  """
  plain = lambda v: list(v) if isinstance(v, tuple) else v
  return {'name': name, 'model': {f: plain(getattr(model, f)) for f in spec_fields()}}


def model_from_spec(spec: dict, **overrides) -> VisionTransformer:
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
    return VisionTransformer(**{**kwargs, **overrides})
  except TypeError as e:  # Required fields missing.
    raise ValueError(f'Incomplete model spec: {e}.') from None


def param_shapes(model: VisionTransformer, image_size: int = 224):
  """The parameter tree as ShapeDtypeStructs, computed without allocating memory."""
  return blank.param_shapes(model, image_size)


def count_leaves(params) -> int:
  """Number of parameters in a tree of arrays or ShapeDtypeStructs."""
  return sum(x.size for x in jax.tree.leaves(params))


def count_params(model: VisionTransformer, image_size: int = 224) -> int:
  """Number of parameters at `image_size` (the position embeddings depend on it).

  Counted on the model with scanned blocks, which holds the same parameters stacked and traces
  one block instead of every one."""
  return count_leaves(param_shapes(model.clone(scan_layers=True), image_size))

"""Per-parameter learning rates and frozen parameters: config.lr_mults, config.layer_decay and
config.frozen (docs/finetuning.md, "Layer-wise learning rates and freezing").

Parameters are named by their '/'-joined paths in the published layout,
'Transformer/encoderblock_3/MlpBlock_0/Dense_0/kernel'. With `scan_layers` the blocks are one
stacked `Transformer/encoderblock` whose leaves carry a leading layer axis (L, ...): its layer i
is named as the unscanned block i would be, 'Transformer/encoderblock_{i}/...', so that the same
regexes select the same weights in both layouts, and its multiplier is a vector along that axis.

A multiplier scales a parameter's update, and so its learning rate (and with AdamW its decoupled
weight decay, which the learning rate scales too), as timm's and BEiT's `lr_scale` of a
parameter group does. Frozen parameters get no update, no optimiser state and no weight decay.
Pure functions of the parameter tree (arrays or jax.ShapeDtypeStructs) and the config fields;
`transform` wraps an optax optimiser with them.
"""
import re
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vit_jax.models import blank
from vit_jax.models import registry

SCANNED_BLOCKS = 'Transformer/encoderblock'
_BLOCK = re.compile(r'^Transformer/encoderblock_(\d+)/')
# What the layer decay counts as the embeddings, below block 0: the patch embedding, the class
# token, the position embeddings (every posemb kind), a hybrid's ResNet stem (conv_root, gn_root,
# block{i}/unit{j}) and masked patch prediction's [mask] embedding.
_EMBEDDINGS = re.compile(
    r'^(embedding|cls|Transformer/posembed_input|conv_root|gn_root|block\d+|mpp_mask_embedding)'
    r'(/|$)')
TRAINABLE, FROZEN = 'trainable', 'frozen'


def path_name(path) -> str:
  """'/'-joined name of a jax key path: ('Transformer', 'encoder_norm', 'scale') ->
  'Transformer/encoder_norm/scale'."""
  return '/'.join(str(getattr(key, 'key', getattr(key, 'name', getattr(key, 'idx', key))))
                  for key in path)


def is_scanned(name: str) -> bool:
  """Whether parameter `name` belongs to the stacked blocks of `scan_layers`."""
  return name.startswith(SCANNED_BLOCKS + '/')


def num_layers(params) -> int:
  """L, the transformer blocks of the parameter tree `params`: the leading axis of the scanned
  blocks, or the number of Transformer/encoderblock_{i}."""
  blocks = set()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = path_name(path)
    if is_scanned(name):
      return int(leaf.shape[0])
    if match := _BLOCK.match(name):
      blocks.add(int(match.group(1)))
  return len(blocks)


def layer_names(name: str, layers: int) -> list[str]:
  """The names regexes see for parameter `name`: L per-layer names 'Transformer/encoderblock_{i}/
  ...' for a scanned leaf (its layer axis), else [name]."""
  if not is_scanned(name):
    return [name]
  rest = name[len(SCANNED_BLOCKS):]
  return [f'{SCANNED_BLOCKS}_{i}{rest}' for i in range(layers)]


def all_layer_names(params) -> list[str]:
  """Every name regexes see in `params` (`layer_names` of each leaf), in tree order."""
  layers = num_layers(params)
  return [layer_name for path, _ in jax.tree_util.tree_leaves_with_path(params)
          for layer_name in layer_names(path_name(path), layers)]


def layer_decay_multiplier(name: str, layers: int, decay: float | None) -> float:
  """The multiplier of unscanned parameter `name` under `layer_decay = decay` for L = `layers`
  blocks: decay^(L - i) for block i (0-based), decay^(L + 1) for the embeddings (_EMBEDDINGS), 1
  for the rest (final norm, pre_logits, head); 1 everywhere when decay is None or 0 (off)."""
  if not decay:
    return 1.0
  if match := _BLOCK.match(name):
    return float(decay ** (layers - int(match.group(1))))
  if _EMBEDDINGS.match(name):
    return float(decay ** (layers + 1))
  return 1.0


def lr_mult(name: str, lr_mults: Sequence[tuple[str, float]] | None) -> float:
  """The multiplier of the first (regex, multiplier) of `lr_mults` whose regex `re.search`es
  `name`; 1 where none does."""
  for pattern, mult in lr_mults or ():
    if re.search(pattern, name):
      return float(mult)
  return 1.0


def multiplier(name: str, layers: int, lr_mults, decay) -> float:
  """`lr_mult` times `layer_decay_multiplier` of unscanned parameter `name`."""
  return lr_mult(name, lr_mults) * layer_decay_multiplier(name, layers, decay)


def leaf_multipliers(name: str, layers: int, lr_mults, decay) -> np.ndarray:
  """The multiplier of the leaf `name`: a float32 scalar, or for a scanned leaf a float32 vector
  (L,) of its layers' multipliers."""
  return np.array([multiplier(n, layers, lr_mults, decay) for n in layer_names(name, layers)],
                  np.float32).reshape(() if not is_scanned(name) else (layers,))


def is_frozen(name: str, frozen: str | None) -> bool:
  """Whether the (unscanned) parameter `name` matches the regex `frozen` (re.search); None or ''
  freezes nothing."""
  return bool(frozen) and re.search(frozen, name) is not None


def frozen_labels(params, frozen: str | None, layers: int | None = None):
  """The tree of `params` with each leaf labelled FROZEN (every one of its layers matches
  `frozen`) or TRAINABLE; optax.multi_transform's labels. Raises a ValueError for a scanned leaf
  frozen in some layers only (the stacked array is one optimiser leaf)."""
  layers = num_layers(params) if layers is None else layers

  def label(path, _):
    names = layer_names(path_name(path), layers)
    matched = [is_frozen(n, frozen) for n in names]
    if any(matched) and not all(matched):
      raise ValueError(f'config.frozen={frozen!r} freezes some layers of the scanned '
                       f'{path_name(path)} only: freeze whole layers of all blocks, or set '
                       '--config.scan_layers=False.')
    return FROZEN if all(matched) else TRAINABLE

  return jax.tree_util.tree_map_with_path(label, params)


def is_set(config) -> bool:
  """Whether `config` sets any of lr_mults, layer_decay, frozen."""
  return bool(config.get('lr_mults') or config.get('layer_decay') or config.get('frozen'))


def scale_updates(updates, lr_mults, decay, layers: int):
  """`updates` with each leaf multiplied by its `leaf_multipliers` (a scanned leaf (L, ...) by a
  vector along its layer axis). Leaves are named by their paths, so it works on the masked
  trees of optax.masked / multi_transform too, which keep the paths."""

  def scale(path, u):
    mults = leaf_multipliers(path_name(path), layers, lr_mults, decay)
    if np.all(mults == 1):
      return u
    return u * jnp.asarray(mults, u.dtype).reshape(mults.shape + (1,) * (u.ndim - mults.ndim))

  return jax.tree_util.tree_map_with_path(scale, updates)


def transform(inner: optax.GradientTransformation, config) -> optax.GradientTransformation:
  """`inner` (clipping and the optimiser) with config.lr_mults and config.layer_decay scaling
  its updates (`scale_updates`; the state stays `inner`'s, so that checkpoints resume with other
  multipliers), and config.frozen's parameters split off to optax.set_to_zero, so that `inner`
  (its clipping norm, its state, its weight decay) sees the trainable parameters only; `inner`
  itself when none of the three is set."""
  if not is_set(config):
    return inner
  lr_mults, decay = config.get('lr_mults'), config.get('layer_decay')
  layers = config.model.transformer.num_layers

  def update(updates, state, params=None):
    updates, state = inner.update(updates, state, params)
    return scale_updates(updates, lr_mults, decay, layers), state

  scaled = optax.GradientTransformation(inner.init, update)
  if not config.get('frozen'):
    return scaled
  return optax.multi_transform({TRAINABLE: scaled, FROZEN: optax.set_to_zero()},
                               lambda params: frozen_labels(params, config.frozen, layers))


def stop_frozen_gradients(params, config):
  """`params` with jax.lax.stop_gradient on config.frozen's; `params` itself if none is frozen.
  Applied inside the function that is differentiated (training.step's loss), backpropagation
  then skips what only they need (for a linear probe, the whole backbone); applied to its
  argument instead, it changes nothing."""
  if not config.get('frozen'):
    return params
  labels = frozen_labels(params, config.frozen, config.model.transformer.num_layers)
  return jax.tree.map(lambda p, label: jax.lax.stop_gradient(p) if label == FROZEN else p,
                      params, labels)


def config_error(config, params) -> str | None:
  """Why config.lr_mults, config.layer_decay or config.frozen cannot work on `params` (shapes
  suffice), in one line, or None: a malformed or negative entry, a regex that does not compile
  or matches no parameter, a layer_decay outside (0, 1], everything frozen."""
  lr_mults, decay, frozen = (config.get('lr_mults'), config.get('layer_decay'),
                             config.get('frozen'))
  if decay is not None and decay != 0 and (isinstance(decay, bool) or
                                           not isinstance(decay, (int, float)) or
                                           not 0 < decay <= 1):
    return (f'config.layer_decay={decay!r} must be in (0, 1], e.g. 0.75 (block i of L gets '
            'layer_decay^(L - i)); None or 0: off.')
  names = all_layer_names(params)
  for entry in lr_mults or ():
    if (not isinstance(entry, (tuple, list)) or len(entry) != 2 or
        not isinstance(entry[0], str) or isinstance(entry[1], bool) or
        not isinstance(entry[1], (int, float))):
      return (f'config.lr_mults entry {entry!r} must be a (regex, multiplier) pair, e.g. '
              "('^head', 10.0).")
    pattern, mult = entry
    if not mult >= 0 or mult == float('inf'):
      return f'config.lr_mults entry {entry!r}: the multiplier must be a finite number >= 0.'
    if error := _regex_error(f'config.lr_mults entry {entry!r}', pattern, names):
      return error
  if frozen:
    if not isinstance(frozen, str):
      return f'config.frozen={frozen!r} must be a regex over parameter paths, e.g. "^(?!head)".'
    if error := _regex_error(f'config.frozen={frozen!r}', frozen, names):
      return error
    if all(is_frozen(n, frozen) for n in names):
      return (f'config.frozen={frozen!r} freezes every parameter: leave some trainable, e.g. '
              "'^(?!head)' trains the head only.")
    try:
      frozen_labels(params, frozen)
    except ValueError as e:
      return str(e)
  return None


def _regex_error(field: str, pattern: str, names: list[str]) -> str | None:
  """Why `pattern` of `field` cannot select parameters among `names`, or None."""
  try:
    compiled = re.compile(pattern)
  except re.error as e:
    return f'{field} is not a valid regex ({e}).'
  if not any(compiled.search(n) for n in names):
    return (f'{field} matches no parameter: parameters are named like {names[0]!r} (blocks '
            "'Transformer/encoderblock_{i}/...', scanned or not).")
  return None


def summary(config, params) -> str:
  """One line on the groups: parameters frozen and trainable, and the range of the
  multipliers of the trainable ones."""
  layers = num_layers(params)
  frozen = trainable = 0
  mults = []
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = path_name(path)
    per_layer = int(np.prod(leaf.shape)) // len(layer_names(name, layers))
    for layer_name in layer_names(name, layers):
      if is_frozen(layer_name, config.get('frozen')):
        frozen += per_layer
      else:
        trainable += per_layer
        mults.append(multiplier(layer_name, layers, config.get('lr_mults'),
                                config.get('layer_decay')))
  return (f'Parameter groups: {frozen:,} parameters frozen, {trainable:,} trainable, learning-'
          f'rate multipliers from {min(mults):.4g} to {max(mults):.4g}.')


def table(params, lr_mults=None, decay=None, frozen=None) -> list[tuple[str, int, float]]:
  """(group, parameters, multiplier) rows: the embeddings, each block, and every other
  top-level parameter (encoder_norm, head), for docs and the console; frozen groups get 0."""
  layers = num_layers(params)
  rows: dict[str, list] = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    name = path_name(path)
    per_layer = int(np.prod(leaf.shape)) // len(layer_names(name, layers))
    for layer_name in layer_names(name, layers):
      if match := _BLOCK.match(layer_name):
        group = f'Transformer/encoderblock_{match.group(1)}'
      elif _EMBEDDINGS.match(layer_name):
        group = 'embeddings'
      else:
        group = '/'.join(layer_name.split('/')[:2 if layer_name.startswith('Transformer/') else 1])
      mult = 0.0 if is_frozen(layer_name, frozen) else multiplier(layer_name, layers, lr_mults,
                                                                  decay)
      row = rows.setdefault(group, [0, set()])
      row[0] += per_layer
      row[1].add(mult)
  order = lambda group: (group != 'embeddings', _block_index(group), group)
  return [(group, count, mults.pop() if len(mults) == 1 else float('nan'))
          for group, (count, mults) in sorted(rows.items(), key=lambda kv: order(kv[0]))]


def _block_index(group: str) -> int:
  match = _BLOCK.match(group + '/')
  return int(match.group(1)) if match else 1 << 30


def main(argv: Sequence[str] | None = None) -> None:
  """`python -m vit_jax.training.param_groups MODEL_NAME LAYER_DECAY [CROP]`: prints the
  Markdown table of each parameter group's multiplier (shapes only: nothing is allocated or
  compiled)."""
  args = list(sys.argv[1:] if argv is None else argv)
  model_name, decay = args[0], float(args[1])
  crop = int(args[2]) if len(args) > 2 else 224
  model = registry.get_model(registry.MODEL_CONFIGS[model_name], num_classes=1000)
  params = blank.param_shapes(model, crop)
  print(f'| {model_name} group | parameters | multiplier (layer_decay = {decay:g}) |')
  print('|---|---:|---:|')
  for group, count, mult in table(params, decay=decay):
    print(f'| `{group}` | {count:,} | {mult:.4g} |')


if __name__ == '__main__':
  main()

"""How the train state and activations are laid out on the ('data', 'model') mesh.

Each parameter declares the logical name of every one of its dimensions where it is made
(`with_axes` around its initializer), e.g. an MLP's first kernel is ('embed', 'mlp'). Rules,
(logical name, mesh axis or None) pairs in priority order, map those names to mesh axes:
`config.logical_axis_rules` first, then LOGICAL_AXIS_RULES. `config.sharding` chooses the mesh
axes the parameters may be split over:

- `data`: none; parameters and optimiser state replicated, batches split over 'data'.
- `fsdp`: 'data'; each parameter (and its optimiser state) split over 'data' along the
  dimension the first matching rule names, where it divides evenly; tensors under
  `FSDP_MIN_SIZE` elements stay replicated.
- `tensor`: 'model'; attention heads and the MLP hidden dimension split over 'model';
  'data' still splits the batch.
- `fsdp+tensor`: both, on a 2-D mesh.

Activations are constrained at block boundaries with `nn.with_logical_constraint`; the
constraints act only inside a function wrapped by `with_rules` (the train step), and do
nothing elsewhere.
"""
import contextvars
import math
from typing import Callable, Optional, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from vit_jax.models import blank

STRATEGIES = ('data', 'fsdp', 'tensor', 'fsdp+tensor')
FSDP_MIN_SIZE = 2**14

# (logical axis, mesh axis): the first rule whose mesh axis the strategy allows, is not yet
# used by another dimension, and divides the dimension, places it; a None rule keeps it whole.
LOGICAL_AXIS_RULES = (
    ('batch', 'data'),  # Activations.
    ('heads', 'model'),  # Tensor parallelism (Megatron-style attention and MLP).
    ('mlp', 'model'),
    ('mlp', 'data'),  # FSDP: one dimension per tensor, in this order of preference.
    ('embed', 'data'),
    ('conv_out', 'data'),
    ('conv_in', 'data'),
    ('classes', 'data'),
    ('repr', 'data'),
    ('head_dim', None),  # Never split.
    ('seq', None),
    ('offset', None),  # posemb='relative': the 2P - 1 offsets, an odd number.
    ('layers', None),
    ('conv_height', None),
    ('conv_width', None),
)

_DECLARING = contextvars.ContextVar('declaring_axes', default=False)

LogicalNames = tuple[Optional[str], ...]


def with_axes(init: Callable, *names: Optional[str]) -> Callable:
  """`init`, declaring the logical name of each dimension of the parameter it makes (None for
  a dimension never split). The names reach the parameter, as an `nn.LogicallyPartitioned`
  box, only while `declared_params` traces the model; otherwise `init` gives the plain array, so
  that parameter trees stay those of the published checkpoints."""
  boxed = nn.with_logical_partitioning(init, names)
  return lambda *args: boxed(*args) if _DECLARING.get() else init(*args)


def path_names(path) -> tuple[str, ...]:
  """The dict keys and attribute names along a pytree key path."""
  names = []
  for entry in path:
    name = getattr(entry, 'key', None) or getattr(entry, 'name', None)
    if isinstance(name, str):
      names.append(name)
  return tuple(names)


def declared_params(model: nn.Module, image_size: int):
  """`model`'s parameters on square `image_size` images as ShapeDtypeStructs, each one that
  was made with `with_axes` in an `nn.LogicallyPartitioned` box holding its logical names."""
  token = _DECLARING.set(True)
  try:
    return blank.param_shapes(model, image_size)
  finally:
    _DECLARING.reset(token)


def param_axes(declared) -> dict[tuple[str, ...], LogicalNames]:
  """{parameter path: its logical names} of the `declared_params` tree `declared`.

  Raises a ValueError naming the first parameter made without `with_axes`.
  """
  is_box = lambda leaf: isinstance(leaf, nn.LogicallyPartitioned)
  axes = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(declared, is_leaf=is_box)[0]:
    if not is_box(leaf):
      raise ValueError(f'Parameter {"/".join(path_names(path))} declares no logical axes: '
                       'make it with an initializer wrapped in vit_jax.sharding.with_axes.')
    axes[path_names(path)] = tuple(leaf.names)
  return axes


def check_rules(axes: dict[tuple[str, ...], LogicalNames], rules: Sequence[tuple]):
  """Raises a ValueError naming the first parameter with a logical axis that no rule names."""
  ruled = {name for name, _ in rules}
  for path, names in axes.items():
    for name in names:
      if name is not None and name not in ruled:
        raise ValueError(
            f'Parameter {"/".join(path)} has logical axis {name!r}, which no rule names: add '
            f'({name!r}, MESH_AXIS or None) to config.logical_axis_rules.')


def mesh_axes(names: LogicalNames, shape: Sequence[int], rules: Sequence[tuple], mesh: Mesh,
              allowed: Sequence[str]) -> list:
  """Per-dimension mesh axis (or None) of an array with logical `names` and `shape` under
  `rules`, using only the mesh axes in `allowed` that have more than one device."""
  spec, settled = [None] * len(names), set()
  for name, mesh_axis in rules:
    i = names.index(name) if name in names else None
    if i is None or i in settled:
      continue
    if mesh_axis is None:
      settled.add(i)
    elif (mesh_axis in allowed and mesh_axis not in spec and mesh.shape[mesh_axis] > 1
          and shape[i] % mesh.shape[mesh_axis] == 0):
      spec[i] = mesh_axis
      settled.add(i)
  return spec


def leaf_names(path: tuple[str, ...], shape: tuple[int, ...],
               axes: dict[tuple[str, ...], LogicalNames]) -> LogicalNames:
  """Logical names of a state leaf: those of the parameter whose path ends its own, of the
  same rank (optimiser state mirrors the params, e.g. `opt_state...mu/.../query/kernel`);
  unnamed otherwise (step, rng, counts)."""
  for start in range(len(path)):
    names = axes.get(path[start:])
    if names is not None and len(names) == len(shape):
      return names
  return (None,) * len(shape)


def full_rules(rules: Sequence[tuple] = ()) -> tuple[tuple, ...]:
  """`rules` (config.logical_axis_rules) ahead of LOGICAL_AXIS_RULES; a ValueError names a
  rule that is not a (logical axis, mesh axis or None) pair."""
  rules = tuple(tuple(rule) for rule in rules)
  for rule in rules:
    if len(rule) != 2 or not isinstance(rule[0], str) or rule[1] not in ('data', 'model', None):
      raise ValueError(f'config.logical_axis_rules has {rule!r}; each rule is a pair '
                       "(logical axis, 'data' | 'model' | None), e.g. ('mlp', None).")
  return rules + LOGICAL_AXIS_RULES


def state_shardings(abstract_state, axes: dict[tuple[str, ...], LogicalNames], mesh: Mesh,
                    strategy: str = 'data', rules: Sequence[tuple] = ()):
  """A NamedSharding for every leaf of `abstract_state` (params and optimiser state alike).

  `axes` are the params' logical names (`param_axes`); `rules` take precedence over
  LOGICAL_AXIS_RULES. Raises a ValueError for an unknown strategy or an unruled logical axis.
  """
  if strategy not in STRATEGIES:
    raise ValueError(f'config.sharding={strategy!r} is not one of {STRATEGIES}.')
  rules = full_rules(rules)
  check_rules(axes, rules)
  allowed = tuple(axis for axis, part in (('data', 'fsdp'), ('model', 'tensor'))
                  if part in strategy)

  def sharding(path, leaf):
    shape = tuple(getattr(leaf, 'shape', ()))
    leaf_allowed = [axis for axis in allowed
                    if axis != 'data' or math.prod(shape) >= FSDP_MIN_SIZE]
    spec = mesh_axes(leaf_names(path_names(path), shape, axes), shape, rules, mesh, leaf_allowed)
    while spec and spec[-1] is None:  # P('data', None) -> P('data'): one spelling per layout.
      spec = spec[:-1]
    return NamedSharding(mesh, P(*spec))

  return jax.tree_util.tree_map_with_path(sharding, abstract_state)


def with_rules(fn: Callable, mesh: Mesh, rules: Sequence[tuple] = ()) -> Callable:
  """`fn`, run under `mesh` and the full rules, so that the models' activation constraints
  (`nn.with_logical_constraint`) take effect when it is traced inside `jax.jit`."""
  rules = full_rules(rules)

  def constrained(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
      return fn(*args, **kwargs)

  return constrained


def bytes_per_device(tree) -> int:
  """Bytes that the first device holds of the arrays in `tree`."""
  device = jax.devices()[0]
  return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
             for shard in leaf.addressable_shards if shard.device == device)

"""How the train state is laid out on the ('data', 'model') mesh: `config.sharding`.

- `data`: parameters and optimiser state replicated; batches split over 'data'.
- `fsdp`: each parameter (and its optimiser state) split over 'data' along its largest
  dimension that divides evenly; tensors under `FSDP_MIN_SIZE` elements stay replicated.
- `tensor`: attention heads and the MLP hidden dimension split over 'model', through the
  logical axis names below and `config.logical_axis_rules`; 'data' still splits the batch.
- `fsdp+tensor`: both, on a 2-D mesh.
"""
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

STRATEGIES = ('data', 'fsdp', 'tensor', 'fsdp+tensor')
FSDP_MIN_SIZE = 2**14

# Logical names of each dimension of the encoder's parameters, by the last two path names.
LOGICAL_AXES = {
    ('query', 'kernel'): ('embed', 'heads', 'head_dim'),
    ('key', 'kernel'): ('embed', 'heads', 'head_dim'),
    ('value', 'kernel'): ('embed', 'heads', 'head_dim'),
    ('query', 'bias'): ('heads', 'head_dim'),
    ('key', 'bias'): ('heads', 'head_dim'),
    ('value', 'bias'): ('heads', 'head_dim'),
    ('out', 'kernel'): ('heads', 'head_dim', 'embed'),
    ('Dense_0', 'kernel'): ('embed', 'mlp'),
    ('Dense_0', 'bias'): ('mlp',),
    ('Dense_1', 'kernel'): ('mlp', 'embed'),
}


def path_names(path) -> tuple[str, ...]:
  """The dict keys and attribute names along a pytree key path."""
  names = []
  for entry in path:
    name = getattr(entry, 'key', None) or getattr(entry, 'name', None)
    if isinstance(name, str):
      names.append(name)
  return tuple(names)


def logical_axes(names: tuple[str, ...], ndim: int) -> tuple[Any, ...]:
  """Logical axis names of a leaf (None for unnamed dims); a scanned leading layer axis is None."""
  axes = LOGICAL_AXES.get(names[-2:], ())
  return (None,) * (ndim - len(axes)) + tuple(axes) if len(axes) <= ndim else (None,) * ndim


def tensor_spec(names, shape, rules: dict[str, str], mesh: Mesh) -> list:
  """Per-dim mesh axes from the logical names and `rules`, where the dimension divides."""
  spec = []
  for axis, size in zip(logical_axes(names, len(shape)), shape):
    mesh_axis = rules.get(axis)
    spec.append(mesh_axis if mesh_axis and size % mesh.shape[mesh_axis] == 0 else None)
  return spec


def fsdp_spec(shape, spec: list, mesh: Mesh) -> list:
  """`spec` with the largest free dimension divisible by the 'data' axis split over it."""
  data = mesh.shape['data']
  if data == 1 or math.prod(shape) < FSDP_MIN_SIZE:
    return spec
  free = [i for i, size in enumerate(shape) if spec[i] is None and size % data == 0]
  if free:
    spec = list(spec)
    spec[max(free, key=lambda i: shape[i])] = 'data'
  return spec


def state_shardings(abstract_state, mesh: Mesh, strategy: str = 'data',
                    rules=(('heads', 'model'), ('mlp', 'model'))):
  """A NamedSharding for every leaf of `abstract_state` (params and optimiser state alike).

  Optimiser state mirrors the params' paths (e.g. `opt_state...mu/.../query/kernel`), so it is
  laid out like the parameter it belongs to.
  """
  if strategy not in STRATEGIES:
    raise ValueError(f'config.sharding={strategy!r} is not one of {STRATEGIES}.')
  rules = dict(rules) if 'tensor' in strategy else {}

  def sharding(path, leaf):
    shape = tuple(getattr(leaf, 'shape', ()))
    spec = tensor_spec(path_names(path), shape, rules, mesh)
    if 'fsdp' in strategy:
      spec = fsdp_spec(shape, spec, mesh)
    while spec and spec[-1] is None:  # P('data', None) -> P('data'): one spelling per layout.
      spec = spec[:-1]
    return NamedSharding(mesh, P(*spec))

  return jax.tree_util.tree_map_with_path(sharding, abstract_state)


def bytes_per_device(tree) -> int:
  """Bytes that the first device holds of the arrays in `tree`."""
  device = jax.devices()[0]
  return sum(shard.data.nbytes for leaf in jax.tree.leaves(tree)
             for shard in leaf.addressable_shards if shard.device == device)

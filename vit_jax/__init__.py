"""vit_jax: the Vision Transformer in JAX/Flax.

The subpackages: models, data, checkpoints, training, tasks, evaluators, config, tools
(docs/design.md draws how they import each other).
"""
import importlib
import warnings

from vit_jax import moved


def __getattr__(name: str):
  """The modules of their old, flat names (`moved.MOVED`), with a DeprecationWarning."""
  if name not in moved.MOVED:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  new = moved.MOVED[name]
  warnings.warn(f'vit_jax.{name} is now {new}; import it from there.', DeprecationWarning,
                stacklevel=2)
  return importlib.import_module(new)

"""The Vision Transformer and its hybrid stem as Flax modules, the registry of models, their
FLOPs, what the attention looks at; `python -m vit_jax.models` lists them."""
import importlib
import importlib.util
import warnings

# Where the names that `vit_jax.models` offered as a module now live.
_FORMERLY_HERE = ('vit_jax.models.registry', 'vit_jax.models.flops')


def __getattr__(name: str):
  """The old module's names (e.g. `vit_jax.models.{name}`), with a DeprecationWarning."""
  if importlib.util.find_spec(f'{__name__}.{name}') is not None:
    raise AttributeError(name)  # A submodule, not yet imported: the import system takes it.
  for source in _FORMERLY_HERE:
    module = importlib.import_module(source)
    if not name.startswith('_') and hasattr(module, name):
      warnings.warn(f'vit_jax.models.{name} is now {source}.{name}.', DeprecationWarning,
                    stacklevel=2)
      return getattr(module, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')

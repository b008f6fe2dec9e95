"""The default run, the help and ranges of config fields, and the checks run before compiling."""
import importlib
import importlib.util
import warnings

# Where the names that `vit_jax.config` offered as a module now live.
_FORMERLY_HERE = ('vit_jax.config.defaults',)


def __getattr__(name: str):
  """The old module's names (e.g. `vit_jax.config.{name}`), with a DeprecationWarning."""
  if importlib.util.find_spec(f'{__name__}.{name}') is not None:
    raise AttributeError(name)  # A submodule, not yet imported: the import system takes it.
  for source in _FORMERLY_HERE:
    module = importlib.import_module(source)
    if not name.startswith('_') and hasattr(module, name):
      warnings.warn(f'vit_jax.config.{name} is now {source}.{name}.', DeprecationWarning,
                    stacklevel=2)
      return getattr(module, name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')

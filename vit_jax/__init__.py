"""vit_jax: the Vision Transformer in JAX/Flax.

The subpackages: models, data, checkpoints, training, tasks, evaluators, config, distributed,
tools
(docs/design.md draws how they import each other).

The library modules that moved into them keep their old names here (MOVED): `from vit_jax
import train` still works, through `__getattr__`, with a DeprecationWarning that names the new
module. The commands that moved keep a module of their old name (vit_jax/predict.py and its
like, through `command_moved`), so that `python -m vit_jax.predict` runs as before;
`vit_jax.models` and `vit_jax.config`, now packages, forward their old names
(`vit_jax.models.get_model`).

Imported by a program, the package changes nothing in its process. Imported as the start of
`python -m vit_jax.COMMAND`, it makes a Ctrl-C during the command's imports one line instead of a
traceback (vit_jax/interrupts.py).
"""
import importlib
import importlib.util
import runpy
import sys
import warnings

from vit_jax import interrupts

interrupts.stop_quietly_while_a_command_imports()

# {old name: new module}
MOVED = {
    'analysis': 'vit_jax.models.analysis',
    'fit': 'vit_jax.training.fit',
    'gone_process': 'vit_jax.distributed.gone_process',
    'heartbeats': 'vit_jax.distributed.heartbeats',
    'input_pipeline': 'vit_jax.data.pipeline',
    'input_pipeline_sources': 'vit_jax.data.sources',
    'model_init': 'vit_jax.models.blank',
    'models_resnet': 'vit_jax.models.resnet',
    'models_vit': 'vit_jax.models.vit',
    'mpp': 'vit_jax.tasks.mpp',
    'positions': 'vit_jax.models.positions',
    'published': 'vit_jax.checkpoints.published',
    'randaugment': 'vit_jax.data.randaugment',
    'registry': 'vit_jax.models.registry',
    'summaries': 'vit_jax.training.summaries',
    'torch_layout': 'vit_jax.checkpoints.torch_layout',
    'train': 'vit_jax.training.trainer',
    'train_checkpoints': 'vit_jax.training.state_checkpoints',
    'train_setup': 'vit_jax.training.setup',
    'train_step': 'vit_jax.training.step',
    'validation': 'vit_jax.config.checks',
}


def command_moved(name: str, target: str, library: str | None = None) -> None:
  """For the module `name` of a command that moved to `target`: run as `python -m`, it runs
  `target` as `python -m target` would; imported, it becomes the module `library` (default
  `target`), so that the old import gives what the old module held."""
  if name == '__main__':
    runpy.run_module(target, run_name='__main__', alter_sys=True)
  else:
    sys.modules[name] = importlib.import_module(library or target)


def forward_old_names(package: str, sources: tuple[str, ...]):
  """The `__getattr__` of `package` (vit_jax.models, vit_jax.config), once a module: it finds
  an old name in the modules `sources` that now hold it, with a DeprecationWarning; submodules
  stay the import system's."""

  def getattr_(name: str):
    if importlib.util.find_spec(f'{package}.{name}') is not None:
      raise AttributeError(name)  # A submodule not yet imported: the import system takes it.
    for source in sources:
      module = importlib.import_module(source)
      if not name.startswith('_') and hasattr(module, name):
        warnings.warn(f'{package}.{name} is now {source}.{name}.', DeprecationWarning,
                      stacklevel=2)
        return getattr(module, name)
    raise AttributeError(f'module {package!r} has no attribute {name!r}')

  return getattr_


def __getattr__(name: str):
  """A module of its old, flat name (MOVED), with a DeprecationWarning."""
  if name not in MOVED:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  warnings.warn(f'vit_jax.{name} is now {MOVED[name]}; import it from there.',
                DeprecationWarning, stacklevel=2)
  return importlib.import_module(MOVED[name])

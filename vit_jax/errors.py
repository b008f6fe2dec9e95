"""The errors vit_jax raises for what a user gave it, and `prepare_new_output`, which keeps every
command from overwriting a file; this module imports nothing of vit_jax, so any module can raise
them without importing the others."""
import os


class ConfigError(ValueError):
  """A config value that cannot work; the message is one line naming the field and the fix."""


class OutputError(ValueError):
  """An output path that a command cannot write anew: it holds something already (no command
  overwrites what a user has), or its folder cannot be made."""


def prepare_new_output(path: str, option: str = '--out') -> None:
  """Makes the folder that is to hold `path` (the command's `option`) where it is missing, and
  raises an OutputError where `path` is a file, folder or link already, or where that folder
  cannot be made or written. Commands call it before they load or compute anything."""
  if os.path.lexists(path):
    raise OutputError(f'{path} exists: give another {option}, or move it away first (nothing is '
                      'overwritten).')
  folder = os.path.dirname(os.path.abspath(path))
  cannot = f'The folder of {option} {path} cannot be made ({{}}): give another {option}.'
  existing = folder
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise OutputError(cannot.format(f'{existing} is a file, not a folder'))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise OutputError(cannot.format(f'{e.strerror}: {e.filename}')) from None
  if not os.access(folder, os.W_OK):
    raise OutputError(f'The folder of {option} {path} cannot be written: give another {option}.')


class WorkdirError(ValueError):
  """A --workdir that cannot be used (in use by another run, not a writable folder); the message
  is one line naming it and the fix."""

"""The errors vit_jax raises for what a user gave it, `prepare_new_output`, which keeps every
command from overwriting a file, and `make_folder`, which makes an output folder or says in one
line why it cannot; this module imports nothing of vit_jax, so any module can raise them without
importing the others."""
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
  make_folder(os.path.dirname(os.path.abspath(path)), f'The folder of {option} {path}', option)


def make_folder(folder: str, named: str, option: str) -> None:
  """Makes `folder` where it is missing; raises an OutputError, in which `named` names it (e.g.
  '--output DIR') and the fix is another `option`, where it cannot be made (a file in its path,
  say) or written."""
  existing = os.path.abspath(folder)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  cannot = f'{named} cannot be made ({{}}): give another {option}.'
  if not os.path.isdir(existing):
    raise OutputError(cannot.format(f'{existing} is a file, not a folder'))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise OutputError(cannot.format(f'{e.strerror}: {e.filename}')) from None
  if not os.access(folder, os.W_OK):
    raise OutputError(f'{named} cannot be written: give another {option}.')


class WorkdirError(ValueError):
  """A --workdir that cannot be used (in use by another run, not a writable folder); the message
  is one line naming it and the fix."""

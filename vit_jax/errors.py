"""The errors vit_jax raises for what a user gave it, and the check that keeps every command from
overwriting a file; this module imports nothing of vit_jax, so any module can raise them without
importing the others."""
import os


class ConfigError(ValueError):
  """A config value that cannot work; the message is one line naming the field and the fix."""


class OutputExistsError(ValueError):
  """An output path that holds something already: no command overwrites what a user has."""


def check_new_output(path: str, option: str = '--out') -> None:
  """Raises an OutputExistsError where `path` (the command's `option`) is a file, folder or link
  already. Commands call it before they load or compute anything."""
  if os.path.lexists(path):
    raise OutputExistsError(f'{path} exists: give another {option}, or move it away first '
                            '(nothing is overwritten).')


class WorkdirError(ValueError):
  """A --workdir that cannot be used (in use by another run, not a writable folder); the message
  is one line naming it and the fix."""

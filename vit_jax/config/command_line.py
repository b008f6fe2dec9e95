"""The --config flag of the commands that train or plan a run (vit_jax.main, vit_jax.plan): its
definition, the config it names, `--help`'s list of the config fields, and one-line errors for
a --config file or a --config.FIELD that is not there.

`parse_flags` is the flag parser of those commands, each calling it from a `parse_flags` of its
own that it gives `app.run`: absl counts --config as a flag of the first module outside this
one, and of absl's and ml_collections', that defines it, so `--help` lists it with the
command's own flags.
"""
import contextlib
import difflib
import os
import re
import sys

from absl import app
from absl import flags
import ml_collections
from ml_collections import config_flags

from vit_jax.config import checks
from vit_jax.config import defaults
from vit_jax.config import fields

DEFAULT_CONFIG = defaults.__file__  # Its get_config() is the default run.
# Flags that ask for help: absl's (which would exit with status 1), and -h.
HELP_FLAGS = ('help', 'helpshort', 'helpfull', '?', 'h')

# The --config that this module defines belongs to the command that calls it, in --help.
flags.disclaim_key_flags()


def define_config_flag() -> None:
  """Defines --config. Without --config on the command line, this already reads the default
  config and applies the --config.FIELD overrides of sys.argv."""
  config_flags.DEFINE_config_file(
      'config', DEFAULT_CONFIG,
      'Config file, optionally with an argument: configs/vit.py:b16,cifar10', lock_config=True)


def given_config(argv: list[str]) -> str | None:
  """The value of the last --config in `argv` (--config=FILE[:ARG] or --config FILE[:ARG])."""
  given = [arg.split('=', 1)[1] if '=' in arg else following
           for arg, following in zip(argv, argv[1:] + [''])
           if re.fullmatch(r'--?config(=.*)?', arg)]
  return given[-1] if given else None


def load_config(argv: list[str]) -> ml_collections.ConfigDict:
  """The config that --config in `argv` names (or the default), without the overrides."""
  parser = config_flags.config_flags.ConfigFileFlagParser('config')
  return parser.parse(given_config(argv) or DEFAULT_CONFIG)


def overridden_dataset(config: ml_collections.ConfigDict, argv: list[str]) -> str | None:
  """config.dataset where the command line (`argv`) changed it from its config file's, else
  None."""
  return config.dataset if config.dataset != load_config(argv).dataset else None


# The checkout vit_jax runs from, where it was installed from one (`pip install -e .`), holds
# configs/ beside the package.
REPOSITORY = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config_file_error(argv: list[str]) -> str | None:
  """Why the file of --config in `argv` cannot be read, in one line; None where it can (or
  there is no --config). A relative path that names a file of the checkout vit_jax runs from,
  given from another folder, gets the --config that names it."""
  argument = given_config(argv)
  path, colon, config_argument = (argument or '').partition(':')
  if argument is None or os.path.isfile(path):
    return None
  in_repository = os.path.join(REPOSITORY, path)
  if not os.path.isabs(path) and os.path.isfile(in_repository):
    return (f'--config={argument}: no such file {path} in {os.getcwd()}; the repository\'s is '
            f'{in_repository}: give --config={in_repository}{colon}{config_argument}.')
  what = f'{path} is a folder' if os.path.isdir(path) else f'no such file {path}'
  return (f'--config={argument}: {what}. Give a config file, e.g. '
          '--config=configs/vit.py:b16,cifar10 (the configs/ folder of the repository), or leave '
          'out --config for the default run.')


def config_help(config: ml_collections.ConfigDict) -> str:
  """The fields of `config`, one a line: `--config.FIELD=VALUE  meaning`."""
  lines = ['Config fields, with the values of this config (set one with --config.FIELD=VALUE):']
  for field, meaning in fields.FIELD_HELP.items():
    value = checks.field_at(config, field)
    lines.append(f'  {f"--config.{field}={value!r}":<36} {meaning}')
  return '\n'.join(lines)


def unknown_field_error(config: ml_collections.ConfigDict, field: str) -> str | None:
  """What is wrong with `--config.FIELD=...` when dotted `field` is not in `config`, in one line
  with the close match or the valid names; None when it is."""
  parent, path = config, 'config'
  for key in field.split('.'):
    if not isinstance(parent, ml_collections.ConfigDict):
      return f'--{path} is not a group of fields, so --config.{field} cannot be set.'
    if key not in parent:
      close = difflib.get_close_matches(key, list(parent), n=1)
      if close:
        return f'--{path}.{key} is not a config field. Did you mean "{close[0]}"?'
      return (f'--{path}.{key} is not a config field. The fields of {path}: '
              f'{", ".join(parent)} (--help says what each does).')
    parent, path = parent[key], f'{path}.{key}'
  return None


@contextlib.contextmanager
def one_line_config_errors(argv: list[str]):
  """Turns the error ml_collections raises for an unknown --config.FIELD in `argv` into one
  `Config error:` line."""
  try:
    yield
  except (AttributeError, KeyError):
    config = load_config(argv)
    overrides = [re.match(r'--?(?:no)?config\.([^=]+)', arg) for arg in argv]
    errors = [unknown_field_error(config, match[1]) for match in overrides if match]
    if not any(errors):
      raise
    sys.exit(f'Config error: {next(e for e in errors if e)}')


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, except that --help exits 0 and lists the config fields, that an
  unknown --config.FIELD, or a --config file that does not exist, is a one-line error (exit
  status 1), and that a flag that does not parse exits with 2, as argparse's commands do."""
  if error := config_file_error(argv):
    sys.exit(f'Config error: {error}')
  with one_line_config_errors(argv):
    define_config_flag()
  if any(arg.lstrip('-').split('=')[0] in HELP_FLAGS for arg in argv[1:]):
    app.usage(shorthelp='--helpfull' not in argv, writeto_stdout=True)
    print(config_help(load_config(argv)))
    sys.exit(0)
  with one_line_config_errors(argv):
    try:
      return app.parse_flags_with_usage(argv)
    except SystemExit as e:  # absl's exit for a flag that does not parse: 2, as argparse's.
      sys.exit(2 if e.code == 1 else e.code)

"""Trains or fine-tunes a ViT: `python -m vit_jax.main [--config=FILE[:ARG]] [--workdir=DIR]`.

Without `--config`, trains the default small ViT on the embedded Fashion-MNIST (the package's
vit_jax/config/defaults.py, the same as `--config=configs/default.py`). Every config field can be
overridden: `--config.base_lr=0.01`; `--help` lists the fields of the config with their values
and meanings.
"""
import atexit
import contextlib
import difflib
import fcntl
import functools
import gc
import logging
import os
import re
import shlex
import socket
import sys

from absl import app
from absl import flags
import jax
import ml_collections
from ml_collections import config_flags

from vit_jax import console
from vit_jax import gone_process
from vit_jax import hardware
from vit_jax import heartbeats
from vit_jax.config import checks
from vit_jax.config import defaults as default_config
from vit_jax.config import fields

DEFAULT_CONFIG = default_config.__file__  # Its get_config() is the default run.
# Flags that ask for help: absl's (which would exit with status 1), and -h.
HELP_FLAGS = ('help', 'helpshort', 'helpfull', '?', 'h')
flags.DEFINE_string('coordinator_address', os.environ.get('JAX_COORDINATOR_ADDRESS'),
                    'host:port of process 0, for multi-process runs that JAX does not detect '
                    'by itself (env JAX_COORDINATOR_ADDRESS).')
flags.DEFINE_integer('num_processes', int(os.environ.get('JAX_NUM_PROCESSES', 0)) or None,
                     'Number of processes (env JAX_NUM_PROCESSES).')
flags.DEFINE_integer('process_id', int(os.environ.get('JAX_PROCESS_ID', -1)),
                     'This process\'s index (env JAX_PROCESS_ID).')
flags.DEFINE_string('workdir', None, 'Where checkpoints, metrics and model.npz go. A workdir '
                    'holding a checkpoint resumes from it. Default: workdirs/NAME, named after '
                    '--config and an overridden --config.dataset (see default_workdir), so that '
                    'the same command resumes.')
flags.DEFINE_bool('log_all', False, 'Show every library\'s INFO lines in absl\'s format (as '
                  '--verbosity=1 does), on every process; by default the console shows vit_jax\'s '
                  'lines and other libraries\' warnings (processes other than 0: warnings only), '
                  'and a live progress bar on a terminal.')


def default_workdir(config_argument: str, dataset: str | None = None) -> str:
  """`workdirs/NAME` for `--config=config_argument`: the file's name, then its argument, then
  `dataset` (an overridden --config.dataset) where given, with characters other than letters,
  digits, '.' and '-' as '_'.

  No --config (the package's default run) or `configs/default.py` -> `workdirs/default`;
  `configs/vit.py:b16,cifar10` -> `workdirs/vit_b16_cifar10`; no --config and
  `--config.dataset=/data/my_photos` -> `workdirs/default_data_my_photos`. Other overrides
  (`--config.base_lr=...`) do not change it.
  """
  path, _, argument = config_argument.partition(':')
  stem = 'default' if path == DEFAULT_CONFIG else os.path.splitext(os.path.basename(path))[0]
  name = _safe_name('_'.join(filter(None, (stem, argument))))
  if dataset:
    name += '_' + _safe_name(dataset).strip('_.')  # '~/photos', './photos/' -> 'photos'.
  return os.path.join('workdirs', name)


def _safe_name(text: str) -> str:
  """`text` with each run of characters other than letters, digits, '.' and '-' as one '_'."""
  return re.sub(r'[^\w.-]+', '_', text, flags=re.ASCII)


def overridden_dataset(config: ml_collections.ConfigDict, argv: list[str]) -> str | None:
  """config.dataset where the command line (`argv`) changed it from its config file's, else
  None."""
  return config.dataset if config.dataset != load_config(argv).dataset else None


def lock_workdir(workdir: str):
  """Takes `WORKDIR/lock` (an flock, released when the process ends, holding 'process PID on
  HOST'); exits naming the holder if another run holds it, or in one line if the folder cannot
  be made or written. Returns the open lock file."""
  path = os.path.join(workdir, 'lock')
  try:
    os.makedirs(workdir, exist_ok=True)
    lock = open(path, 'a+')  # No `with`: held until the process ends.
  except OSError as e:
    why = 'is a file, not a folder' if os.path.isfile(workdir) else (
        f'cannot be written ({e.strerror}: {e.filename})')
    sys.exit(f'--workdir={workdir} {why}: give a folder that can be written (it is made if '
             'missing).')
  lock.seek(0)
  try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    sys.exit(f'{workdir} is in use by {lock.read().strip() or "another run"} (lock {path}): '
             'wait for that run to end, or use another --workdir.')
  if previous := lock.read().strip():  # Its holder ended without releasing it: killed.
    logging.warning('Taking over %s from %s, which no longer runs.', path, previous)
  lock.truncate(0)
  lock.write(f'process {os.getpid()} on {socket.gethostname()}\n')
  lock.flush()
  return lock


def release_workdir(lock) -> None:
  """Empties and releases the lock of `lock_workdir` (an emptied lock is a free one)."""
  lock.truncate(0)
  lock.close()


def resume_command(workdir: str) -> str:
  """This process's command line with `--workdir=WORKDIR` (absolute) in place of any given."""
  args = sys.argv[1:]
  kept = [arg for i, arg in enumerate(args) if not arg.startswith('--workdir=')
          and arg != '--workdir' and (i == 0 or args[i - 1] != '--workdir')]
  return shlex.join(['python', '-m', 'vit_jax.main', *kept,
                     f'--workdir={os.path.abspath(workdir)}'])


# Variables by which clusters that jax.distributed.initialize() detects by itself announce
# more than one process (Slurm, Open MPI, multi-host TPU slices).
CLUSTER_SIZE_VARIABLES = ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE')


def initialize_distributed() -> bool:
  """Starts JAX's multi-process runtime when this is one of several processes; returns whether
  it did."""
  if flags.FLAGS.coordinator_address:
    jax.distributed.initialize(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes,
                               flags.FLAGS.process_id)
  elif (any(int(os.environ.get(v, 1)) > 1 for v in CLUSTER_SIZE_VARIABLES)
        or ',' in os.environ.get('TPU_WORKER_HOSTNAMES', '')):
    jax.distributed.initialize()
  else:
    return False
  return True


def exit_for_gone_process(workdir: str, process: int, seconds: float) -> None:
  """heartbeats.PeerWatch's `on_gone`: says in one line which process is gone and how to
  resume, and ends this process at once (its collectives would wait for the gone one until
  JAX's runtime aborts it)."""
  for handler in logging.getLogger().handlers:
    handler.flush()
  sys.stderr.write(gone_process.gone_line(
      f'process {process} of {jax.process_count()} sent no heartbeat for {seconds:.0f} s',
      workdir, jax.process_count(), jax.process_index(), resume_command(workdir)) + '\n')
  sys.stderr.flush()
  os._exit(1)


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


def config_file_error(argv: list[str]) -> str | None:
  """Why the file of --config in `argv` cannot be read, in one line; None where it can (or
  there is no --config)."""
  argument = given_config(argv)
  path = (argument or '').partition(':')[0]
  if argument is None or os.path.isfile(path):
    return None
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
    fields = [re.match(r'--?(?:no)?config\.([^=]+)', arg) for arg in argv]
    errors = [unknown_field_error(config, match[1]) for match in fields if match]
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


def drop_closed_event_loop_errors(unraisable) -> None:
  """sys.unraisablehook: drops the 'Event loop is closed' errors that TensorStore callbacks raise
  after Orbax gave up a failed save or restore (dozens of tracebacks, each error already
  reported in one line); passes every other one on."""
  if not (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == 'Event loop is closed'):
    sys.__unraisablehook__(unraisable)


def evaluation_summary(metrics: dict[str, float]) -> str:
  """The evaluations among a run's last `metrics` (test, minival, few-shot), on one line."""
  shown = {name.removeprefix('fewshot/'): value for name, value in metrics.items()
           if name.startswith(('test_', 'val_', 'fewshot/'))}
  return ', '.join(f'{name} {value:.4g}' for name, value in sorted(shown.items()))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  log_all = flags.FLAGS.log_all or flags.FLAGS.verbosity >= 1
  console.setup(log_all)
  config = flags.FLAGS.config
  if not initialize_distributed():  # One process: on a CPU host, one device per core.
    hardware.use_one_device_per_core(functools.partial(checks.fits_devices, config))
  if jax.process_count() > 1:
    if not flags.FLAGS.workdir:
      sys.exit('--workdir is required with several processes: they must share one folder.')
    if jax.process_index() > 0:  # Process 0 speaks for all; these say if it is gone.
      gone_process.filter_stderr(flags.FLAGS.workdir, jax.process_count(), jax.process_index(),
                                 resume_command(flags.FLAGS.workdir))
      if not log_all:
        logging.getLogger().setLevel(logging.WARNING)
  workdir = flags.FLAGS.workdir or default_workdir(flags.FLAGS['config'].config_filename,
                                                   overridden_dataset(config, sys.argv))
  logging.info('Workdir: %s', os.path.abspath(workdir))
  try:  # Before TensorFlow is imported: a bad value is reported in seconds.
    checks.validate_config(config, jax.device_count())
  except checks.ConfigError as e:
    sys.exit(f'Config error: {e}')
  lock = lock_workdir(workdir) if jax.process_index() == 0 else None
  from vit_jax.data import shards
  from vit_jax.training import state_checkpoints
  from vit_jax.training import trainer  # It imports TensorFlow.
  peers = (heartbeats.PeerWatch(functools.partial(exit_for_gone_process, workdir)).start()
           if jax.process_count() > 1 else None)
  try:
    metrics = trainer.train_and_evaluate(config, workdir)
  except checks.ConfigError as e:
    sys.exit(f'Config error: {e}')
  except shards.DataError as e:  # A training image that does not decode.
    sys.exit(f'Data error: {e}')
  except trainer.NonFiniteError as e:
    sys.exit(f'Training stopped: {e}')
  except state_checkpoints.CheckpointSaveError as e:
    sys.exit(f'Checkpoint error: {e}')
  except KeyboardInterrupt:
    sys.exit(f'Stopped at once (second Ctrl-C). To resume from the last checkpoint: '
             f'{resume_command(workdir)}')
  except Exception:  # E.g. a collective's "Connection reset by peer": a process may be gone.
    if peers:
      peers.wait_for_gone()
    raise
  finally:
    if peers:  # Done, or an error this process reports itself: the others need not wait.
      peers.stop()
    if lock:
      release_workdir(lock)
  if 'preempted_at_step' in metrics:
    logging.warning('Stopped at step %d and wrote its checkpoint. To resume: %s',
                    metrics['preempted_at_step'], resume_command(workdir))
    return
  logging.info('Done: %s', evaluation_summary(metrics))


if __name__ == '__main__':
  hardware.skip_absent_tpu()
  hardware.use_compilation_cache()
  # Registered first, so run last: at exit the interpreter's garbage collection then skips the
  # objects of the imported libraries (TensorFlow's, JAX's), which take seconds to collect.
  # Files are closed and saves finished before that.
  atexit.register(gc.freeze)
  hardware.keep_freed_host_memory()
  sys.unraisablehook = drop_closed_event_loop_errors
  app.run(main, flags_parser=parse_flags)

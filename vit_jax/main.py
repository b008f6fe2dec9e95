"""Trains or fine-tunes a ViT: `python -m vit_jax.main [--config=FILE[:ARG]] [--workdir=DIR]`.

Without `--config`, trains the default small ViT on the embedded Fashion-MNIST
(configs/default.py). Every config field can be overridden: `--config.base_lr=0.01`.
"""
import fcntl
import functools
import logging
import os
import re
import shlex
import socket
import sys

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

import configs
from vit_jax import hardware

DEFAULT_CONFIG = os.path.join(os.path.dirname(configs.__file__), 'default.py')

config_flags.DEFINE_config_file(
    'config', DEFAULT_CONFIG, 'Config file, optionally with an argument: configs/vit.py:b16,cifar10',
    lock_config=True)
flags.DEFINE_string('coordinator_address', os.environ.get('JAX_COORDINATOR_ADDRESS'),
                    'host:port of process 0, for multi-process runs that JAX does not detect '
                    'by itself (env JAX_COORDINATOR_ADDRESS).')
flags.DEFINE_integer('num_processes', int(os.environ.get('JAX_NUM_PROCESSES', 0)) or None,
                     'Number of processes (env JAX_NUM_PROCESSES).')
flags.DEFINE_integer('process_id', int(os.environ.get('JAX_PROCESS_ID', -1)),
                     'This process\'s index (env JAX_PROCESS_ID).')
flags.DEFINE_string('workdir', None, 'Where checkpoints, metrics and model.npz go. A workdir '
                    'holding a checkpoint resumes from it. Default: workdirs/NAME, named after '
                    '--config (see default_workdir), so that the same command resumes.')


def default_workdir(config_argument: str) -> str:
  """`workdirs/NAME` for `--config=config_argument`: the file's name, then its argument, with
  characters other than letters, digits, '.' and '-' as '_'.

  `configs/default.py` (no --config) -> `workdirs/default`; `configs/vit.py:b16,cifar10` ->
  `workdirs/vit_b16_cifar10`. Overrides (`--config.base_lr=...`) do not change it.
  """
  path, _, argument = config_argument.partition(':')
  name = '_'.join(filter(None, (os.path.splitext(os.path.basename(path))[0], argument)))
  return os.path.join('workdirs', re.sub(r'[^\w.-]+', '_', name, flags=re.ASCII))


def lock_workdir(workdir: str):
  """Takes `WORKDIR/lock` (an flock, released when the process ends, holding 'process PID on
  HOST'); exits naming the holder if another run holds it. Returns the open lock file."""
  path = os.path.join(workdir, 'lock')
  os.makedirs(workdir, exist_ok=True)
  lock = open(path, 'a+')  # pylint: disable=consider-using-with  (held until the process ends)
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


def drop_closed_event_loop_errors(unraisable) -> None:
  """sys.unraisablehook: drops the 'Event loop is closed' errors that TensorStore callbacks raise
  after Orbax gave up a failed save or restore (dozens of tracebacks, each error already
  reported in one line); passes every other one on."""
  if not (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == 'Event loop is closed'):
    sys.__unraisablehook__(unraisable)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  logging.getLogger().setLevel(logging.INFO)
  from vit_jax import train  # pylint: disable=g-import-not-at-top  (it imports TensorFlow)
  if not initialize_distributed():  # One process: on a CPU host, one device per core.
    hardware.use_one_device_per_core(functools.partial(train.fits_devices, flags.FLAGS.config))
  if jax.process_count() > 1:
    if not flags.FLAGS.workdir:
      sys.exit('--workdir is required with several processes: they must share one folder.')
    if jax.process_index() > 0:  # Process 0 speaks for all.
      logging.getLogger().setLevel(logging.WARNING)
  workdir = flags.FLAGS.workdir or default_workdir(flags.FLAGS['config'].config_filename)
  logging.info('Workdir: %s', os.path.abspath(workdir))
  lock = lock_workdir(workdir) if jax.process_index() == 0 else None
  try:
    metrics = train.train_and_evaluate(flags.FLAGS.config, workdir)
  except train.ConfigError as e:
    sys.exit(f'Config error: {e}')
  except train.NonFiniteError as e:
    sys.exit(f'Training stopped: {e}')
  except train.CheckpointSaveError as e:
    sys.exit(f'Checkpoint error: {e}')
  except KeyboardInterrupt:
    sys.exit(f'Stopped at once (second Ctrl-C). To resume from the last checkpoint: '
             f'{resume_command(workdir)}')
  finally:
    if lock:
      release_workdir(lock)
  if 'preempted_at_step' in metrics:
    logging.warning('Stopped at step %d and wrote its checkpoint. To resume: %s',
                    metrics['preempted_at_step'], resume_command(workdir))
    return
  logging.info('Done: %s', ', '.join(f'{k} {v:.4g}' for k, v in sorted(metrics.items())))


if __name__ == '__main__':
  hardware.keep_freed_host_memory()
  sys.unraisablehook = drop_closed_event_loop_errors
  app.run(main)

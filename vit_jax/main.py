"""Trains or fine-tunes a ViT: `python -m vit_jax.main [--config=FILE[:ARG]] [--workdir=DIR]`.

Without `--config`, trains the default small ViT on the embedded Fashion-MNIST (the package's
vit_jax/config/defaults.py, the same as `--config=configs/default.py`). Every config field can be
overridden: `--config.base_lr=0.01`; `--help` lists the fields of the config with their values
and meanings.
"""
import atexit
import functools
import gc
import importlib.util
import logging
import os
import re
import signal
import sys
import traceback
from typing import NoReturn

from absl import app
from absl import flags
import jax
import ml_collections

from vit_jax import console
from vit_jax import errors
from vit_jax import hardware
from vit_jax import interrupts
from vit_jax.config import checks
from vit_jax.config import command_line
from vit_jax.distributed import gone_process
from vit_jax.distributed import heartbeats
from vit_jax.distributed import startup
from vit_jax.training import workdirs

flags.DEFINE_string('coordinator_address', os.environ.get('JAX_COORDINATOR_ADDRESS'),
                    'host:port of process 0, for multi-process runs that JAX does not detect '
                    'by itself (env JAX_COORDINATOR_ADDRESS).')
flags.DEFINE_integer('num_processes', int(os.environ.get('JAX_NUM_PROCESSES', 0)) or None,
                     'Number of processes (env JAX_NUM_PROCESSES).')
flags.DEFINE_integer('process_id', int(os.environ.get('JAX_PROCESS_ID', -1)),
                     'This process\'s index (env JAX_PROCESS_ID).')
flags.DEFINE_float('peer_timeout', heartbeats.GONE_AFTER_S,
                   'Seconds a process of a multi-process run may send no heartbeat (one every '
                   f'{heartbeats.HEARTBEAT_S:g} s) before the others name it gone, in one line '
                   'with how to resume, and stop. Raise it where hosts may stall longer.')
flags.DEFINE_string('workdir', None, 'Where checkpoints, metrics and model.npz go. A workdir '
                    'holding a checkpoint resumes from it. Default: workdirs/NAME, named after '
                    '--config and an overridden --config.dataset (see default_workdir), so that '
                    'the same command resumes.')
# One --log_all per process: main and plan each define it, and a process may import both.
if 'log_all' not in flags.FLAGS:
  flags.DEFINE_bool('log_all', False, 'Show every library\'s INFO lines in absl\'s format (as '
                    '--verbosity=1 does), on every process; by default the console shows '
                    'vit_jax\'s lines and other libraries\' warnings (processes other than 0: '
                    'warnings only), and a live progress bar on a terminal.')


def parse_flags(argv: list[str]) -> list[str]:
  """command_line.parse_flags, called from this module so that --config is its flag in --help."""
  return command_line.parse_flags(argv)


def start_processes(config: ml_collections.ConfigDict, log_all: bool) -> None:
  """Starts JAX's multi-process runtime where this is one of several processes, else gives a
  CPU host one device per core. Several processes need --workdir, one folder for all; those
  other than 0 send their stderr through gone_process's filter and, unless `log_all`, log
  warnings only: process 0 speaks for all. On CPUs, unless `log_all`, every process sends its
  stdout through the filter too, which keeps Gloo's connection lines off the console."""
  if not startup.initialize(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes,
                            flags.FLAGS.process_id):
    hardware.use_one_device_per_core(functools.partial(checks.fits_devices, config))
  if jax.process_count() == 1:
    return
  if not flags.FLAGS.workdir:
    sys.exit('--workdir is required with several processes: they must share one folder.')
  filter_output = functools.partial(
      gone_process.filter_output, workdir=flags.FLAGS.workdir,
      process_count=jax.process_count(), process_index=jax.process_index(),
      command=workdirs.resume_command(flags.FLAGS.workdir))
  if jax.default_backend() == 'cpu' and not log_all:
    filter_output(1)
  if jax.process_index() > 0:
    filter_output(2)
    if not log_all:
      logging.getLogger().setLevel(logging.WARNING)


def train(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains `config` in `workdir`, which process 0 locks, with the heartbeats of several
  processes; returns the run's last metrics. Exits with one line for an error a user can act
  on; with several processes, the others stop with that line too, and any other error is its
  traceback and then such a line (`unexpected_error_line`). A Ctrl-C that stops it at once
  (`interrupted_line`) ends it by SIGINT after its line."""
  on_gone = functools.partial(startup.exit_for_gone_process, workdir,
                              workdirs.resume_command(workdir))
  peers = (heartbeats.PeerWatch(on_gone, startup.exit_for_failed_process,
                                gone_after_s=flags.FLAGS.peer_timeout).start()
           if jax.process_count() > 1 else None)
  lock, error, signum = None, None, None
  made = not os.path.isdir(workdir)  # By this run, which removes it if it writes nothing there.
  try:
    interrupts.command_started()  # A Ctrl-C from here on is interrupted_line's.
    # Locked before the trainer (and TensorFlow, seconds) is imported: a workdir in use is
    # refused at once. Its imports (Flax, Orbax, clu, tfds besides TensorFlow) run without the
    # cyclic collector, whose collections would free nothing there.
    lock = workdirs.lock_workdir(workdir) if jax.process_index() == 0 else None
    with console.collector_paused():
      from vit_jax.training import trainer
    return trainer.train_and_evaluate(config, workdir)
  except KeyboardInterrupt:
    error, signum = interrupted_line(workdir), signal.SIGINT
  except Exception as e:
    error = error_line(e)
    if error is None and not peers:
      raise
    if error is None:
      error = unexpected_error_line(e, peers)
  finally:
    if peers and error is None:  # Done: the others need not wait for this one.
      peers.stop()
    if lock:
      workdirs.release_workdir(lock)
      if error is not None and made:
        workdirs.remove_if_only_lock(workdir)
  startup.exit_with_error(error, peers, signum)


def interrupted_line(workdir: str) -> str:
  """The line of a run that a Ctrl-C stopped at once: the second one in training, or the first
  before training started (in its compile, say), when no step is there to checkpoint yet."""
  last, command = gone_process.last_checkpoint(workdir), workdirs.resume_command(workdir)
  if last == 'none':
    return ("Stopped at once (Ctrl-C), before the run's first checkpoint. To start it again: "
            f'{command}')
  return (f'Stopped at once (Ctrl-C); the last complete checkpoint is {last}. To resume from '
          f'it: {command}')


def error_line(error: Exception) -> str | None:
  """The one line that reports `error`, an error a user can act on; None for any other."""
  if isinstance(error, errors.WorkdirError):
    return str(error)
  if isinstance(error, errors.ConfigError):
    return f'Config error: {error}'
  if 'vit_jax.training.trainer' not in sys.modules:  # Raised before (or while) it was imported.
    return None
  from vit_jax.data import shards  # Imported by the trainer, which imports TensorFlow.
  from vit_jax.training import state_checkpoints
  from vit_jax.training import trainer
  if isinstance(error, shards.DataError):  # A training image that does not decode.
    return f'Data error: {error}'
  if isinstance(error, trainer.NonFiniteError):
    return f'Training stopped: {error}'
  if isinstance(error, state_checkpoints.CheckpointSaveError):
    return f'Checkpoint error: {error}'
  return None


# How the runtime's errors that another process may cause begin: a collective's "UNKNOWN: Gloo
# AllGather failed: ... Connection closed by peer", for one (absl status codes).
FROM_ANOTHER_PROCESS = re.compile(
    r'(UNKNOWN|INTERNAL|UNAVAILABLE|ABORTED|CANCELLED|DEADLINE_EXCEEDED|DATA_LOSS): ')


def unexpected_error_line(error: Exception, peers: heartbeats.PeerWatch) -> str:
  """The line that tells the other processes of `error`, an error of this one that no line
  reports (a bug, most likely), written after its traceback. A runtime error that another
  process may have caused (FROM_ANOTHER_PROCESS) waits for the heartbeats to name that process
  first, gone or failed (`wait_for_gone`; they then end this process)."""
  if FROM_ANOTHER_PROCESS.match(str(error)):
    peers.wait_for_gone()
  traceback.print_exception(error)
  sys.stderr.flush()
  said = str(error).strip().splitlines()
  process = jax.process_index()
  return (f'Unexpected error in process {process} of {jax.process_count()}: '
          f'{type(error).__name__}{": " + said[0] if said else ""} (its traceback is in the '
          f'output of process {process}).')


def drop_closed_event_loop_errors(unraisable) -> None:
  """sys.unraisablehook: drops the 'Event loop is closed' errors that TensorStore callbacks raise
  after Orbax gave up a failed save or restore (dozens of tracebacks, each error already
  reported in one line); passes every other one on."""
  if not (isinstance(unraisable.exc_value, RuntimeError)
          and str(unraisable.exc_value) == 'Event loop is closed'):
    sys.__unraisablehook__(unraisable)


def legacy_keras_error() -> str | None:
  """The one line for TF_USE_LEGACY_KERAS set (to `true`, `True` or `1`, as TensorFlow reads it)
  without the tf_keras package that it asks for, or None. A run writes TensorBoard summaries
  through clu, which imports TensorFlow's Keras: with the switch and no tf_keras, that import
  fails with TensorFlow's warning and a traceback. The other commands use no Keras."""
  value = os.environ.get('TF_USE_LEGACY_KERAS')
  if value not in ('true', 'True', '1') or importlib.util.find_spec('tf_keras'):
    return None
  return (f'Environment error: TF_USE_LEGACY_KERAS={value} asks TensorFlow for tf_keras, which is '
          "not installed, and a run's TensorBoard summaries import Keras: unset it (vit_jax uses "
          'no Keras).')


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
  if error := heartbeats.gone_after_error(flags.FLAGS.peer_timeout):
    sys.exit(error)
  if error := legacy_keras_error():
    sys.exit(error)
  config = flags.FLAGS.config
  start_processes(config, log_all)
  workdir = flags.FLAGS.workdir or workdirs.default_workdir(
      flags.FLAGS['config'].config_filename, command_line.overridden_dataset(config, sys.argv))
  logging.info('Workdir: %s', os.path.abspath(workdir))
  try:  # Before TensorFlow is imported: a bad value is reported in seconds.
    checks.validate_config(config, jax.device_count())
    checks.check_dataset_folder(config)
  except checks.ConfigError as e:
    sys.exit(f'Config error: {e}')
  with interrupts.ctrl_c_kept():
    metrics = train(config, workdir)
  if 'preempted_at_step' in metrics:
    logging.warning('Stopped at step %d and wrote its checkpoint. To resume: %s',
                    metrics['preempted_at_step'], workdirs.resume_command(workdir))
    end_unfinished(int(metrics['preempted_by_signal']))
  logging.info('Done: %s', evaluation_summary(metrics))


def end_unfinished(signum: int) -> NoReturn:
  """Ends a run that the signal `signum` stopped, its checkpoint written, with a status that says
  it has not finished, so that a scheduler runs it again and `main && export` stops there (a
  Kubernetes Job would take 0 as done): a Ctrl-C of one process ends it by SIGINT, as Python
  ends on one, so that a shell loop over runs stops too; otherwise the status is 128 + signum
  (143 for SIGTERM), through Python's exit, which shuts JAX's multi-process runtime down in
  step with the other processes."""
  if signum == signal.SIGINT and jax.process_count() == 1:
    interrupts.end_by(signum)
  sys.exit(128 + signum)


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

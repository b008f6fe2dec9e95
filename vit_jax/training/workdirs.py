"""A training run's workdir: its default name, the lock that keeps a second run out of it, and
the command that resumes the run in it."""
import fcntl
import logging
import os
import re
import shlex
import socket
import sys
from typing import TextIO

from vit_jax.config import command_line
from vit_jax.errors import WorkdirError


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
  stem = ('default' if path == command_line.DEFAULT_CONFIG
          else os.path.splitext(os.path.basename(path))[0])
  name = _safe_name('_'.join(filter(None, (stem, argument))))
  if dataset:
    name += '_' + _safe_name(dataset).strip('_.')  # '~/photos', './photos/' -> 'photos'.
  return os.path.join('workdirs', name)


def _safe_name(text: str) -> str:
  """`text` with each run of characters other than letters, digits, '.' and '-' as one '_'."""
  return re.sub(r'[^\w.-]+', '_', text, flags=re.ASCII)


def lock_workdir(workdir: str) -> TextIO:
  """Takes `WORKDIR/lock` (an flock, released when the process ends, holding 'process PID on
  HOST') and returns the open lock file. Raises WorkdirError naming the holder if another run
  holds it, or in one line if the folder cannot be made or written."""
  path = os.path.join(workdir, 'lock')
  try:
    os.makedirs(workdir, exist_ok=True)
    lock = open(path, 'a+')  # No `with`: held until the process ends.
  except OSError as e:
    why = 'is a file, not a folder' if os.path.isfile(workdir) else (
        f'cannot be written ({e.strerror}: {e.filename})')
    raise WorkdirError(f'--workdir={workdir} {why}: give a folder that can be written (it is '
                       'made if missing).') from None
  lock.seek(0)
  try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    raise WorkdirError(f'{workdir} is in use by {lock.read().strip() or "another run"} (lock '
                       f'{path}): wait for that run to end, or use another --workdir.') from None
  if previous := lock.read().strip():  # Its holder ended without releasing it: killed.
    logging.warning('Taking over %s from %s, which no longer runs.', path, previous)
  lock.truncate(0)
  lock.write(f'process {os.getpid()} on {socket.gethostname()}\n')
  lock.flush()
  return lock


def release_workdir(lock: TextIO) -> None:
  """Empties and releases the lock of `lock_workdir` (an emptied lock is a free one)."""
  lock.truncate(0)
  lock.close()


def remove_if_only_lock(workdir: str) -> None:
  """Removes `workdir` where it holds nothing but a released (empty) lock: a folder that a run
  made and then stopped in before it wrote anything (an unknown dataset, say), which would
  otherwise be left behind for the user to find."""
  lock = os.path.join(workdir, 'lock')
  try:
    if os.listdir(workdir) == ['lock'] and os.path.getsize(lock) == 0:
      os.remove(lock)
      os.rmdir(workdir)
  except OSError:  # Gone already, or taken by another run in between: left as it is.
    pass


def resume_command(workdir: str) -> str:
  """This process's command line with `--workdir=WORKDIR` (absolute) in place of any given."""
  args = sys.argv[1:]
  kept = [arg for i, arg in enumerate(args) if not arg.startswith('--workdir=')
          and arg != '--workdir' and (i == 0 or args[i - 1] != '--workdir')]
  return shlex.join(['python', '-m', 'vit_jax.main', *kept,
                     f'--workdir={os.path.abspath(workdir)}'])

"""Tests of the command line, vit_jax/main.py: bad configs, preemption, kills, several processes.

Each test runs `python -m vit_jax.main` in subprocesses, as users do, with a bounded run time.
"""
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest

from vit_jax import checkpoint
from vit_jax import train
import tiny_config

TINY_CONFIG = os.path.join(os.path.dirname(__file__), 'tiny_config.py')
# Long enough to be interrupted in the middle: 150 steps, a checkpoint every 50.
LONG_RUN = {'total_steps': 150, 'checkpoint_every': 50, 'eval_every': 150, 'keep_checkpoints': 5}
TIMEOUT = 300  # Seconds any one process may run.


def main_command(workdir, overrides, *extra):
  return [sys.executable, '-m', 'vit_jax.main', f'--config={TINY_CONFIG}', f'--workdir={workdir}',
          *(f'--config.{k}={v}' for k, v in overrides.items()), *extra]


class MainProcess:
  """`python -m vit_jax.main` in the background, its output collected, killed after TIMEOUT."""

  def __init__(self, workdir, overrides, *extra, env=None):
    self.process = subprocess.Popen(
        main_command(workdir, overrides, *extra), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    self.lines = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    self._deadline = time.monotonic() + TIMEOUT

  def _read(self):
    for line in self.process.stdout:
      self.lines.append(line)

  @property
  def log(self):
    return ''.join(self.lines)

  def wait_for(self, condition, what):
    """Polls `condition()` until it holds; fails with the log if the process ends or times out."""
    while not condition():
      if self.process.poll() is not None or time.monotonic() > self._deadline:
        self.process.kill()
        pytest.fail(f'Never saw {what}; exit status {self.process.poll()}. Log:\n{self.log}')
      time.sleep(0.01)

  def finish(self):
    try:
      self.process.wait(timeout=max(self._deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
      self.process.kill()
      pytest.fail(f'Timed out after {TIMEOUT} s. Log:\n{self.log}')
    self._reader.join()
    return self.process.returncode


def run_main(workdir, overrides, *extra):
  process = MainProcess(workdir, overrides, *extra)
  return process.finish(), process.log


@pytest.fixture(scope='module')
def uninterrupted_params(tmp_path_factory):
  """Final params of the long run trained in one go, in this process (same 8 CPU devices)."""
  workdir = tmp_path_factory.mktemp('uninterrupted')
  config = tiny_config.get_config()
  config.update(LONG_RUN)
  train.train_and_evaluate(config, str(workdir))
  return checkpoint.load(os.path.join(workdir, 'model.npz'))


def assert_same_params(workdir, expected):
  params = checkpoint.load(os.path.join(workdir, 'model.npz'))
  jax.tree.map(np.testing.assert_array_equal, params, expected)


def test_bad_config_is_reported_in_one_line(tmp_path):
  status, log = run_main(tmp_path, {'batch': 100, 'batch_eval': 100})
  assert status == 1
  assert log.strip().splitlines()[-1] == (
      'Config error: config.batch=100 is not divisible by 8 data-parallel devices x '
      'config.accum_steps=1: make it a multiple of 8.')


def test_sigterm_checkpoints_exits_0_and_the_rerun_resumes(tmp_path, uninterrupted_params):
  run = MainProcess(tmp_path, LONG_RUN)
  run.wait_for(lambda: 'step 20/150' in run.log, 'step 20')
  run.process.send_signal(signal.SIGTERM)
  assert run.finish() == 0, run.log
  assert 'Preempted at step' in run.log
  assert not os.path.exists(tmp_path / 'model.npz')

  status, log = run_main(tmp_path, LONG_RUN)
  assert status == 0, log
  assert 'Resuming from step' in log
  assert_same_params(tmp_path, uninterrupted_params)


def test_sigkill_during_training_loses_at_most_one_checkpoint_interval(
    tmp_path, uninterrupted_params):
  run = MainProcess(tmp_path, LONG_RUN)
  checkpoints = tmp_path / 'checkpoints'
  # Killed as soon as the save of step 100 starts (or has ended, if it was too quick to see).
  run.wait_for(lambda: checkpoints.exists() and any(
      name.startswith('100') for name in os.listdir(checkpoints)), 'the save of step 100')
  run.process.kill()
  run.finish()

  status, log = run_main(tmp_path, LONG_RUN)
  assert status == 0, log
  resumed = int(log.split('Resuming from step ')[1].split()[0])
  assert resumed in (50, 100)
  assert_same_params(tmp_path, uninterrupted_params)

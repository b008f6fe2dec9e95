"""Tests of the command line, vit_jax/main.py: bad configs, preemption, kills, several processes.

Each test runs `python -m vit_jax.main` in subprocesses, as users do, with a bounded run time
(forked from one that has imported the libraries: tests/preloaded.py).
"""
import importlib.util
import os
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import jax
import numpy as np
import optax
import pytest

from helpers import TINY_CONFIG
from helpers import tiny_config
from helpers import xla_flags
import preloaded
from vit_jax import main
from vit_jax.checkpoints import npz
from vit_jax.config import command_line
from vit_jax.config import fields
from vit_jax.config import defaults
from vit_jax.models import analysis
from vit_jax.training import resume
from vit_jax.training import trainer
from vit_jax.training import workdirs

# The run of tests/tiny_config.py (60 steps, a checkpoint every 20), logged every 10 steps to be
# interrupted in the middle, keeping the checkpoints of its stops too.
LONG_RUN = {'total_steps': 60, 'checkpoint_every': 20, 'eval_every': 60, 'progress_every': 10,
            'keep_checkpoints': 5}
TIMEOUT = 300  # Seconds any one process may run.


def main_command(workdir, overrides, *extra):
  """The command line of the tiny config with `overrides`; `workdir` None: the default one."""
  return [sys.executable, '-m', 'vit_jax.main', f'--config={TINY_CONFIG}',
          *([f'--workdir={workdir}'] if workdir else []),
          *(f'--config.{k}={v}' for k, v in overrides.items()), *extra]


class MainProcess:
  """`python -m vit_jax.main` in the background, its output collected, killed after TIMEOUT.

  `command` replaces the tiny config's command line; `limits` are {resource: soft limit}.
  """

  def __init__(self, workdir, overrides, *extra, env=None, command=None, limits=None):
    command = command or main_command(workdir, overrides, *extra)
    self.process = preloaded.start(command[1:], env={**os.environ, **(env or {})}, limits=limits)
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


def run_main(workdir, overrides, *extra, **kwargs):
  process = MainProcess(workdir, overrides, *extra, **kwargs)
  return process.finish(), process.log


def final_params(workdir):
  return npz.load(os.path.join(workdir, 'model.npz'))


def assert_same_params(workdir, reference_workdir):
  jax.tree.map(np.testing.assert_array_equal, final_params(workdir),
               final_params(reference_workdir))


def test_bad_config_is_reported_in_one_line_before_anything_runs(tmp_path):
  # Every value checks.validate_config refuses takes this way: test_config_errors.py.
  status, log = run_main(tmp_path / 'run', {'batch': 102, 'batch_eval': 102})
  assert status == 1
  assert 'Traceback' not in log
  assert not os.path.exists(tmp_path / 'run' / 'checkpoints')
  assert log.strip().splitlines()[-1] == (
      'Config error: config.batch=102 is not divisible by 4 data-parallel devices x '
      'config.accum_steps=1: make it a multiple of 4. config.batch_eval=102 is not divisible by '
      '4 data-parallel devices: make it a multiple of 4.')


def test_a_run_stopped_before_it_wrote_anything_leaves_no_workdir_of_its_own(tmp_path):
  status, log = run_main(tmp_path / 'run', {'dataset': 'no_such_dataset'})
  assert status == 1 and log.strip().splitlines()[-1].startswith(
      "Config error: config.dataset='no_such_dataset' is neither "), log
  assert not os.path.exists(tmp_path / 'run')  # Not even its lock.
  (tmp_path / 'mine').mkdir()  # A folder the user made stays, with the lock of the run.
  status, _ = run_main(tmp_path / 'mine', {'dataset': 'no_such_dataset'})
  assert status == 1 and os.listdir(tmp_path / 'mine') == ['lock']


def test_the_legacy_keras_switch_without_tf_keras_is_one_line_before_anything_runs(tmp_path):
  assert importlib.util.find_spec('tf_keras') is None  # Not among the requirements.
  result = preloaded.run(['-m', 'vit_jax.main', f'--config={TINY_CONFIG}',
                          f'--workdir={tmp_path}/run'],
                         env={**os.environ, 'TF_USE_LEGACY_KERAS': '1'}, timeout=TIMEOUT)
  assert result.returncode == 1 and 'Traceback' not in result.stderr, result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
      "Environment error: TF_USE_LEGACY_KERAS=1 asks TensorFlow for tf_keras, which is not "
      "installed, and a run's TensorBoard summaries import Keras: unset it (vit_jax uses no "
      'Keras).'), result.stderr
  assert not os.path.exists(tmp_path / 'run')


def run_command_line(*args):
  """(exit status, stdout, stderr) of `python -m vit_jax.main` on the tiny config with `args`."""
  result = preloaded.run(['-m', 'vit_jax.main', f'--config={TINY_CONFIG}', *args], timeout=TIMEOUT)
  return result.returncode, result.stdout, result.stderr


def test_help_exits_0_and_lists_the_config_fields_with_values_and_meanings():
  status, out, _ = run_command_line('--help')
  assert status == 0
  assert '--workdir' in out
  assert '--config.total_steps=60 ' in out  # The value of tests/tiny_config.py.
  assert "--config.pp.crop=28 " in out
  for meaning in fields.FIELD_HELP.values():
    assert meaning in out


def test_every_config_field_has_a_meaning():
  config = defaults.training_defaults()
  config.model = None  # Described by model_name, whose registry entry fills it.
  assert set(resume.flatten_config(config)) == set(fields.FIELD_HELP) | {'model'}


def test_misspelt_config_field_is_one_line_naming_the_close_match():
  status, out, err = run_command_line('--config.total_step=10')
  assert status == 1
  assert (out + err).strip().splitlines() == [
      'Config error: --config.total_step is not a config field. Did you mean "total_steps"?']


def test_unknown_config_field_lists_the_fields_of_its_group():
  config = defaults.training_defaults()
  assert command_line.unknown_field_error(config, 'pp.crop') is None
  message = command_line.unknown_field_error(config, 'foo')
  assert message.startswith('--config.foo is not a config field. The fields of config: ')
  assert all(f' {field},' in message for field in ('base_lr', 'pp', 'total_steps'))
  assert command_line.unknown_field_error(config, 'pp.crops') == (
      '--config.pp.crops is not a config field. Did you mean "crop"?')
  assert command_line.unknown_field_error(config, 'pp.crop.size') == (
      '--config.pp.crop is not a group of fields, so --config.pp.crop.size cannot be set.')


def interrupt(run, workdir, signal_name, at_step):
  """The step that `run` (of LONG_RUN in `workdir`), sent `signal_name` at `at_step`, stopped
  at; checks that it ends unfinished, by SIGINT for a Ctrl-C and with status 143 for SIGTERM,
  having checkpointed that step."""
  run.wait_for(lambda: f'step {at_step}/60' in run.log, f'step {at_step}')
  run.process.send_signal(getattr(signal, signal_name))
  assert run.finish() == {'SIGINT': -signal.SIGINT, 'SIGTERM': 128 + signal.SIGTERM}[signal_name], (
      run.log)
  # Stopped between steps, or in the evaluation of the step the signal came after.
  said = {'SIGINT': 'Ctrl-C', 'SIGTERM': 'SIGTERM'}[signal_name]
  stopped = re.search(rf'{said} at step (\d+): checkpointing it and stopping|'
                      rf'{said} during the evaluation of step (\d+)', run.log)
  assert stopped, run.log
  step = int(stopped[1] or stopped[2])
  assert str(step) in os.listdir(workdir / 'checkpoints')
  assert not os.path.exists(workdir / 'model.npz')
  return step


@pytest.fixture(scope='module')
def interrupted_run(tmp_path_factory, trained_run):
  """LONG_RUN in one workdir, stopped three ways, each time resumed by the command that the
  first stop printed, then finished in this process:
  - `first`, paused at step 10 while `refused` (its command run again: (status, log)) tries
    the workdir, then stopped there by Ctrl-C;
  - `killed` (SIGKILL) as soon as the save of step 20 starts (or has ended, if it was too
    quick to see);
  - `preempted` by SIGTERM at step 30, 30 steps before the end.
  interrupt() checks that Ctrl-C and SIGTERM end it unfinished, with a checkpoint of the step
  they stop at.
  The session's run, trained first, leaves the programs that these processes compile in the
  XLA cache (tests/conftest.py).
  """
  del trained_run
  workdir = tmp_path_factory.mktemp('interrupted')
  run = types.SimpleNamespace(workdir=workdir, first=MainProcess(workdir, LONG_RUN))
  run.first.wait_for(lambda: 'step 10/60' in run.first.log, 'step 10')
  run.first.process.send_signal(signal.SIGSTOP)  # It holds the workdir's lock meanwhile.
  run.refused = run_main(workdir, LONG_RUN)
  run.first.process.send_signal(signal.SIGCONT)
  run.ctrl_c_step = interrupt(run.first, workdir, 'SIGINT', at_step=10)  # Ctrl-C.
  run.printed_command = shlex.split(run.first.log.split('To resume: ')[1].splitlines()[0])
  command = [sys.executable, *run.printed_command[1:]]

  run.killed = MainProcess(None, {}, command=command)
  checkpoints = workdir / 'checkpoints'
  run.killed.wait_for(lambda: any(name.startswith('20') for name in os.listdir(checkpoints)),
                      'the save of step 20')
  run.killed.process.kill()
  run.killed.finish()

  run.preempted = MainProcess(None, {}, command=command)
  interrupt(run.preempted, workdir, 'SIGTERM', at_step=30)
  trainer.train_and_evaluate(tiny_config(**LONG_RUN), str(workdir))  # The rest.
  return run


# The tests of the interrupted run share one pytest-xdist worker, which runs it once.
SHARES_INTERRUPTED_RUN = pytest.mark.xdist_group('interrupted_run')


@SHARES_INTERRUPTED_RUN
def test_ctrl_c_and_sigterm_checkpoint_end_unfinished_and_the_printed_command_resumes(
    interrupted_run):
  assert interrupted_run.printed_command[:3] == ['python', '-m', 'vit_jax.main']
  for resumed in (interrupted_run.killed, interrupted_run.preempted):
    assert 'Resuming from step' in resumed.log, resumed.log


@SHARES_INTERRUPTED_RUN
def test_sigkill_during_training_loses_at_most_one_checkpoint_interval(interrupted_run,
                                                                         trained_run):
  log = interrupted_run.preempted.log  # Of the run that the killed one's command started.
  resumed = int(log.split('Resuming from step ')[1].split()[0])
  # The save of step 20 ended, or the checkpoint before it (of the Ctrl-C) is used.
  assert resumed in (interrupted_run.ctrl_c_step, 20)
  # Finished, the run has the params of the session's run trained in one go
  # (tests/tiny_config.py's, which LONG_RUN logs more often and keeps more checkpoints of).
  assert_same_params(interrupted_run.workdir, trained_run[0])


@SHARES_INTERRUPTED_RUN
def test_a_workdir_in_use_is_refused_and_a_killed_runs_lock_is_taken_over(interrupted_run):
  workdir, host = interrupted_run.workdir, socket.gethostname()
  status, log = interrupted_run.refused
  assert status == 1, log
  assert log.strip().splitlines()[-1] == (
      f'{workdir} is in use by process {interrupted_run.first.process.pid} on {host} (lock '
      f'{workdir}/lock): wait for that run to end, or use another --workdir.')
  assert (f'Taking over {workdir}/lock from process {interrupted_run.killed.process.pid} on '
          f'{host}, which no longer runs.') in interrupted_run.preempted.log


def test_a_ctrl_c_before_the_first_step_stops_at_once_and_says_there_is_no_checkpoint(tmp_path):
  # Before training starts (its data checks, the compile), there is no step to checkpoint.
  run = MainProcess(tmp_path / 'run', LONG_RUN)
  run.wait_for(lambda: 'Dataset ' in run.log, 'the dataset line')
  run.process.send_signal(signal.SIGINT)
  assert run.finish() == -signal.SIGINT, run.log
  assert 'Traceback' not in run.log and 'step 10/60' not in run.log
  assert run.log.strip().splitlines()[-1] == (
      "Stopped at once (Ctrl-C), before the run's first checkpoint. To start it again: "
      f'python -m vit_jax.main --config={TINY_CONFIG} '
      + ' '.join(f'--config.{k}={v}' for k, v in LONG_RUN.items())
      + f" --workdir={tmp_path / 'run'}")
  checkpoints = tmp_path / 'run' / 'checkpoints'
  assert not (checkpoints.exists() and os.listdir(checkpoints))


def test_a_ctrl_c_that_stops_at_once_names_the_last_complete_checkpoint(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, 'argv', ['main.py', '--config.total_steps=60'])
  for name in ('20', '40', '60.orbax-checkpoint-tmp-1'):  # The last one, unfinished.
    os.makedirs(tmp_path / 'checkpoints' / name)
  assert main.interrupted_line(str(tmp_path)) == (
      'Stopped at once (Ctrl-C); the last complete checkpoint is step 40. To resume from it: '
      f'python -m vit_jax.main --config.total_steps=60 --workdir={tmp_path}')


def test_without_workdir_a_run_writes_to_workdirs_named_after_its_config():
  assert workdirs.default_workdir(TINY_CONFIG) == os.path.join('workdirs', 'tiny_config')
  assert workdirs.default_workdir('configs/vit.py:b16,cifar10') == os.path.join(
      'workdirs', 'vit_b16_cifar10')
  assert workdirs.default_workdir(command_line.DEFAULT_CONFIG) == os.path.join(
      'workdirs', 'default')
  # The quick start, run without --workdir, writes to ./workdirs/default: test_console.py.


def test_a_full_disk_is_reported_in_one_line_and_leaves_no_partial_checkpoint(tmp_path):
  # The checkpoint's data file (about 100 kB) exceeds the file-size limit; logs and config fit.
  # How Orbax splits a save into files depends on its threads' timing, so an early save may
  # still fit: the run stops at the first save that does not, with the ones before it kept. It
  # learns of the failure at the first step after the background save ends, some steps later
  # where steps are quick: the run is long, so that only a missed failure reaches its end.
  overrides = {'total_steps': 200, 'checkpoint_every': 10, 'eval_every': 1000,
               'progress_every': 5}
  status, log = run_main(tmp_path, overrides, limits={resource.RLIMIT_FSIZE: 48 * 1024})
  assert status == 1, log
  errors = [line for line in log.splitlines() if line.startswith('Checkpoint error: ')]
  assert len(errors) == 1, log
  failed = re.match(rf'Checkpoint error: Saving the checkpoint of step ([0-9]+) to '
                    rf'{re.escape(str(tmp_path))}/checkpoints failed \(File too large', errors[0])
  assert failed, log
  kept = sorted(int(name) for name in os.listdir(tmp_path / 'checkpoints'))
  assert kept == list(range(10, int(failed[1]), 10))  # No partial save of the failed step.
  last_good = f'step {kept[-1]}' if kept else 'none'
  assert re.search(r'; [0-9.]+ (bytes|KiB|MiB|GiB) free there; the last good checkpoint is '
                   rf'{last_good}\.$', errors[0])
  assert 'step 200/200' not in log  # Stopped at the failure, not at the end.
  assert 'Traceback' not in log  # Orbax's and TensorStore's are kept off the console.


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


# A short run with a small evaluation and few-shot evaluation at its end, as one process of all
# 4 devices (here) and as two processes of 2 (below).
SHORT_RUN = {'total_steps': 10, 'checkpoint_every': 10, 'eval_every': 10, 'progress_every': 5,
             'test_split': 'test[:400]', 'batch_eval': 200}
FEWSHOT = dict(datasets=('fashion_mnist_embedded',), shots=(1, 5), seeds=1,
               train_split='train[:500]', num_test=200)


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
  """(workdir, few-shot accuracies at its end) of SHORT_RUN trained in this process."""
  workdir = tmp_path_factory.mktemp('one_process')
  config = tiny_config(**SHORT_RUN)
  config.evals.fewshot.update(FEWSHOT)
  metrics = trainer.train_and_evaluate(config, str(workdir))
  return workdir, {name: value for name, value in metrics.items() if name.startswith('fewshot/')}


def test_two_processes_train_and_evaluate_few_shot_like_one_with_all_devices(
    tmp_path, one_process):
  """2 processes x 2 CPU devices (JAX's distributed runtime, gloo) against 1 x 4 devices; each
  process feeds its share of the batches and of the few-shot images, and each gets the same
  few-shot accuracies."""
  address = f'127.0.0.1:{free_port()}'
  env = {'XLA_FLAGS': xla_flags(2)}
  overrides = {**SHORT_RUN, **{f'evals.fewshot.{k}': v for k, v in FEWSHOT.items()}}
  runs = [MainProcess(tmp_path, overrides, f'--coordinator_address={address}',
                      '--num_processes=2', f'--process_id={i}', *(['--log_all'] if i else []),
                      env=env) for i in range(2)]  # Process 1 logs too, in absl's format.
  # If one process fails, the other would wait for it: then stop both and show both logs.
  deadline = time.monotonic() + TIMEOUT
  while (any(run.process.poll() is None for run in runs)
         and all(run.process.poll() in (None, 0) for run in runs)
         and time.monotonic() < deadline):
    time.sleep(0.1)
  for run in runs:
    run.process.kill()
  statuses = [run.finish() for run in runs]
  assert statuses == [0, 0], '\n\n'.join(run.log for run in runs)
  # Gloo's line for each device of each program that connects: off the console, but for
  # --log_all's.
  assert '[Gloo]' not in runs[0].log and '[Gloo] Rank ' in runs[1].log, runs[0].log

  reference, reference_fewshot = one_process
  scalars = analysis.read_scalars(str(tmp_path))
  steps, losses = scalars['train_loss']
  expected_steps, expected = analysis.read_scalars(str(reference))['train_loss']
  assert list(steps) == list(expected_steps) == [5, 10]
  # The same batches and math: step 5's loss agrees to float precision. Cross-process sums add
  # in another order, and the rounding differences grow over the Adam steps at lr 1e-2 (another
  # data order would change the losses and params entirely).
  np.testing.assert_allclose(losses[0], expected[0], rtol=1e-5)
  np.testing.assert_allclose(losses, expected, rtol=1e-2)
  params, expected_params = final_params(tmp_path), final_params(reference)
  difference = optax.tree.norm(jax.tree.map(np.subtract, params, expected_params))
  assert difference < 0.01 * optax.tree.norm(expected_params)

  # The same shots and test images; the sums add in another order, which may move a held-out
  # image across a decision boundary and with it the choice of L2.
  assert sorted(reference_fewshot) == ['fewshot/fashion_mnist_embedded_1shot',
                                       'fewshot/fashion_mnist_embedded_5shot']
  for name, accuracy in reference_fewshot.items():
    (step,), (logged,) = scalars[name]
    assert step == 10 and logged == pytest.approx(accuracy, abs=0.02)
  assert reference_fewshot['fewshot/fashion_mnist_embedded_5shot'] > 0.3  # Chance is 0.1.
  # Every process got the same accuracies (the sums are reduced across them).
  printed = [re.findall(r'few-shot linear accuracy (.*) \(', run.log) for run in runs]
  assert len(printed[0]) == 1 and printed[1] == printed[0], printed

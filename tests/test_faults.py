"""Faults during a run, as an operator meets them: a file system that fills to the byte, a
SIGTERM during the final evaluation (of one process or two), training images changed between a
run and its resume, a process of a two-process run that dies (process 1, or process 0 with JAX's
coordination service) or raises an error that no line reports (a bug).

Each fault meets the command a user types, run in a subprocess with the device count it picks
for itself (helpers.xla_flags(None)), forked from one that has imported the libraries
(tests/preloaded.py). A run that only sets the scene (a trained workdir) or checks
what a later run does with it (a rerun, a resume) is the library's, run in the test's process.

A full disk is a real one: a small tmpfs mounted for the test (`mount -t tmpfs -o size=...`, which
needs root), filled to its last byte by a file of zeros. A file-size limit (RLIMIT_FSIZE) fails
writes with another error (EFBIG) and leaves the file system's free space as it was, so it does
not show what a full disk does to Orbax, TensorStore, numpy or safetensors. Where mounting is not
permitted, these tests skip and say so.
"""
import io
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
from PIL import Image
import pytest

from helpers import tiny_config
from helpers import xla_flags
import preloaded
from test_main import main_command
from test_main import MainProcess
from test_main import free_port
from test_main import run_main
from vit_jax.checkpoints import npz
from vit_jax.data import embedded
from vit_jax.distributed import gone_process
from vit_jax.distributed import heartbeats
from vit_jax.tools import export
from vit_jax.training import summaries
from vit_jax.training import trainer
from vit_jax.training import workdirs

# Checkpoints of the tiny config take about 300 KiB each, its model.npz 68 KiB.
FULL_DISK_RUN = {'total_steps': 300, 'checkpoint_every': 10, 'eval_every': 1000,
                 'progress_every': 5, 'keep_checkpoints': 5}
ONE_DEVICE_PER_CORE = {'XLA_FLAGS': xla_flags(None)}  # As a user's process: no harness count.


@pytest.fixture
def small_disk(tmp_path):
  """An 8 MiB tmpfs mounted at tmp_path/disk; skips where mounting is not permitted."""
  disk = tmp_path / 'disk'
  disk.mkdir()
  mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=8m', 'tmpfs', str(disk)],
                           capture_output=True, text=True, check=False)
  if mounted.returncode:
    pytest.skip(f'mounting a tmpfs is not permitted here: {mounted.stderr.strip()}')
  try:
    yield disk
  finally:
    subprocess.run(['umount', '-l', str(disk)], check=False)


def fill(disk, leave: int = 0) -> None:
  """Fills the file system of `disk` with a file of zeros until `leave` bytes are free."""
  with open(disk / f'filler-{uuid.uuid4().hex}', 'wb') as f:
    try:
      while (free := os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize) > leave:
        f.write(bytes(min(free - leave, 1 << 20)))
        f.flush()
    except OSError:  # Full to the byte.
      pass


def stopped_after_checkpoint(run, checkpoints, step):
  """Waits until the checkpoint of `step` is complete, then pauses `run` (SIGSTOP)."""
  run.wait_for(lambda: (checkpoints / str(step)).exists(), f'the checkpoint of step {step}')
  run.process.send_signal(signal.SIGSTOP)


def error_lines(log):
  return [line for line in log.splitlines()
          if line.startswith(('Checkpoint error: ', 'Traceback', 'error: '))]


def the_failed_save_of_step_20(run, workdir) -> str:
  """The one error line of `run`, which exits 1 after its save of step 20 to a full disk."""
  assert run.finish() == 1, run.log
  errors = error_lines(run.log)
  assert errors == [errors[0]] and errors[0].startswith(
      f'Checkpoint error: Saving the checkpoint of step 20 to {workdir}/checkpoints failed '
      '(No space left on device); '), run.log
  return errors[0]


def test_a_disk_full_to_the_byte_mid_run_is_one_line_and_leaves_no_partial_checkpoint(
    small_disk):
  workdir = small_disk / 'run'
  run = MainProcess(workdir, FULL_DISK_RUN, env=ONE_DEVICE_PER_CORE)
  stopped_after_checkpoint(run, workdir / 'checkpoints', 10)
  fill(small_disk)
  run.process.send_signal(signal.SIGCONT)
  error = the_failed_save_of_step_20(run, workdir)
  assert error.endswith(' free there; the last good checkpoint is step 10.'), run.log
  assert 'GiB free' not in error  # Less than 8 MiB is free: said in bytes or KiB.
  assert run.log.strip().splitlines()[-1] == error
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['10']  # The partial save is gone.


def test_a_disk_full_at_the_last_checkpoint_still_writes_model_npz(small_disk):
  workdir = small_disk / 'run'
  run = MainProcess(workdir, {**FULL_DISK_RUN, 'total_steps': 20}, env=ONE_DEVICE_PER_CORE)
  stopped_after_checkpoint(run, workdir / 'checkpoints', 10)
  fill(small_disk, leave=150 * 1024)  # Room for model.npz, not for a checkpoint.
  run.process.send_signal(signal.SIGCONT)
  assert the_failed_save_of_step_20(run, workdir).endswith(
      f'; the last good checkpoint is step 10. The final params are in {workdir}/model.npz; '
      'free some space and run the same command again for the final checkpoint.'), run.log
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['10']
  assert npz.load(workdir / 'model.npz')  # Complete: it loads.


def test_a_disk_full_at_the_model_npz_write_is_one_line_and_leaves_no_partial_file(
    small_disk, trained_run):
  """The session's trained run (tests/tiny_config.py, 60 steps) without its model.npz: the same
  command again only evaluates it and writes model.npz, here to a full disk."""
  workdir = small_disk / 'run'
  shutil.copytree(trained_run[0], workdir, ignore=shutil.ignore_patterns('model.npz'))
  fill(small_disk, leave=16 * 1024)  # Room for the lock and config.json, not for model.npz.
  rerun = MainProcess(workdir, {}, env=ONE_DEVICE_PER_CORE)
  assert rerun.finish() == 1, rerun.log
  assert 'Already trained to step 60 of 60' in rerun.log
  errors = error_lines(rerun.log)
  assert errors == [errors[0]] and re.fullmatch(re.escape(
      f'Checkpoint error: Writing the final params to {workdir}/model.npz failed (No space left '
      'on device); ') + '[0-9]+ KiB' + re.escape(
          ' free there. The checkpoint of step 60 is complete: free some space and run the '
          'same command again to write the file.'), errors[0]), rerun.log
  assert not [name for name in os.listdir(workdir) if name.startswith('model')]


def test_summaries_on_a_full_disk_stop_with_one_warning_and_the_run_goes_on(small_disk, caplog):
  """TensorBoard's writes fail first where the checkpoint due next is far off: one warning, no
  traceback from the writer's thread, and the writes after it do nothing."""
  writer = summaries.writer(str(small_disk), is_main=True)
  writer.write_scalars(1, {'loss': 1.0})
  writer.flush()
  fill(small_disk)
  many = {f'metric_{i}': 1.0 for i in range(200)}  # More than the file's last page holds.
  for step in (2, 3):
    writer.write_scalars(step, many)
    writer.flush()
  writer.close()
  records = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
  assert records == [('WARNING', f'TensorBoard summaries stopped: writing them to {small_disk} '
                      'failed (No space left on device; 0 bytes free).')], records
  assert not any(r.exc_info for r in caplog.records)


def assert_one_line_and_no_partial_file(disk, out, stderr):
  assert 'Traceback' not in stderr
  assert re.fullmatch(
      re.escape(f'error: Writing {out} failed (No space left on device); ') + '[0-9]+ KiB'
      + re.escape(' free there: free some space, or pass another --out.'),
      stderr.strip().splitlines()[-1]), stderr
  assert not [name for name in os.listdir(disk) if not name.startswith('filler')]


def test_export_to_a_full_disk_is_one_line_and_leaves_no_partial_file(small_disk, trained_run):
  fill(small_disk, leave=16 * 1024)  # Less than the tiny model's 60 KiB of weights.
  out = small_disk / 'export'
  result = preloaded.run(
      ['-m', 'vit_jax.export', '--checkpoint', trained_run[0], '--format', 'timm', '--out',
       str(out)], env={**os.environ, **ONE_DEVICE_PER_CORE})
  assert result.returncode == 1, result.stderr
  assert_one_line_and_no_partial_file(small_disk, out, result.stderr)


@pytest.mark.parametrize('format_name', ['hf', 'saved_model'])
def test_export_of_other_formats_to_a_full_disk_is_one_line_and_leaves_no_partial_file(
    small_disk, trained_run, format_name, capsys):
  """As the test above, through the command's main: Hugging Face's files and TensorFlow's
  SavedModel meet the full disk in their own writers."""
  fill(small_disk, leave=16 * 1024)
  out = small_disk / 'export'
  assert export.main(['--checkpoint', trained_run[0], '--format', format_name,
                      '--out', str(out)]) == 1
  assert_one_line_and_no_partial_file(small_disk, out, capsys.readouterr().err)


# Ten steps, then an evaluation of all 10,000 test images in 625 batches (several seconds), and
# with FEWSHOT_AT_END a few-shot evaluation after it.
LONG_FINAL_EVALUATION = {'total_steps': 10, 'checkpoint_every': 10, 'progress_every': 5,
                         'eval_every': 10, 'test_split': 'test', 'batch_eval': 16}
FEWSHOT_AT_END = dict(datasets=('fashion_mnist_embedded',), shots=(1, 5), seeds=1,
                      train_split='train[:500]', num_test=200)


def stopped_during_the_final_evaluation(workdir, during, overrides) -> None:
  """Runs the tiny config with `overrides` in `workdir`, sends SIGTERM once `during` is in its
  output, and checks that it stops at once with the checkpoint of step 10 and no model.npz."""
  run = MainProcess(workdir, overrides, env=ONE_DEVICE_PER_CORE)
  run.wait_for(lambda: during in run.log, repr(during))
  run.process.send_signal(signal.SIGTERM)
  sent = time.monotonic()
  assert run.finish() == 128 + signal.SIGTERM, run.log  # Unfinished: a scheduler reruns it.
  assert time.monotonic() - sent < 20, run.log  # Seconds, on a loaded 2-core machine too.
  assert ('SIGTERM during the evaluation of step 10: stopping it now, with the checkpoint of '
          'step 10; a rerun only evaluates it.') in run.log, run.log
  assert 'Stopped at step 10 and wrote its checkpoint. To resume: ' in run.log
  assert os.listdir(workdir / 'checkpoints') == ['10']
  assert not (workdir / 'model.npz').exists()


def test_sigterm_during_the_final_evaluation_stops_it_at_once(tmp_path):
  """In the middle of the 625 batches. That a rerun only evaluates it, the test below shows."""
  stopped_during_the_final_evaluation(tmp_path, 'step 10: checkpoint -> ', LONG_FINAL_EVALUATION)


def test_sigterm_during_the_final_few_shot_evaluation_stops_it_and_the_rerun_evaluates(
    tmp_path, caplog):
  """The rerun, the same run again, is the library's in this process: it only evaluates (few-shot
  too) and writes model.npz."""
  overrides = {**LONG_FINAL_EVALUATION, 'test_split': 'test[:32]'}
  stopped_during_the_final_evaluation(tmp_path, 'step 10: test accuracy ', {
      **overrides, **{f'evals.fewshot.{field}': value if isinstance(value, str) else repr(value)
                      for field, value in FEWSHOT_AT_END.items()}})

  config = tiny_config(**overrides)
  config.evals.fewshot.update(FEWSHOT_AT_END)
  with caplog.at_level(logging.INFO):
    metrics = trainer.train_and_evaluate(config, str(tmp_path))
  assert 'Already trained to step 10 of 10: evaluating it.' in caplog.text
  assert 'fashion_mnist_embedded_5shot' in caplog.text
  assert 'fewshot/fashion_mnist_embedded_5shot' in metrics, metrics
  assert npz.load(tmp_path / 'model.npz')


def write_image_folder(root, per_class=20):
  """An image folder of 3 classes of 28x28 PNGs (embedded Fashion-MNIST images): per_class
  training and 2 test images each."""
  with np.load(embedded.PATH) as data:
    images, labels = data['train_images'], data['train_labels']
  for split, count, start in (('train', per_class, 0), ('test', 2, per_class)):
    for name, class_id in (('bag', 8), ('coat', 4), ('sandal', 5)):
      os.makedirs(root / split / name)
      for i, image in enumerate(images[labels == class_id][start:start + count]):
        Image.fromarray(image).save(root / split / name / f'{i}.png')


def test_a_resume_whose_images_changed_is_refused_in_one_line_and_resumes_once_restored(
    tmp_path, caplog):
  """The refused resume is the command a user types; the run before it and the resume after it
  are the library's, in this process."""
  data = tmp_path / 'images'
  write_image_folder(data)
  run = {'dataset': str(data), 'test_split': 'test', 'total_steps': 10, 'checkpoint_every': 10,
         'eval_every': 10, 'progress_every': 5}
  trainer.train_and_evaluate(tiny_config(**run), str(tmp_path / 'run'))
  removed = data / 'train' / 'coat' / '7.png'
  kept = removed.read_bytes()
  removed.unlink()  # Between two runs: the resumed one would see 59 images, not 60.

  longer = {**run, 'total_steps': 20}
  status, log = run_main(tmp_path / 'run', longer, env=ONE_DEVICE_PER_CORE)
  assert status == 1, log
  assert log.strip().splitlines()[-1] == (
      f'Config error: The training data changed since the checkpoint of step 10: {data} split '
      "'train' now has 59 examples (60 examples when saved), so its order would not be the "
      'one trained on. Restore the data as it was, set --config.resume_changed_data=True to '
      'resume in a new order (no longer exact), or use another --workdir to start afresh.')
  assert sorted(os.listdir(tmp_path / 'run' / 'checkpoints')) == ['10']

  removed.write_bytes(kept)
  with caplog.at_level(logging.INFO):
    trainer.train_and_evaluate(tiny_config(**longer), str(tmp_path / 'run'))
  assert 'Resuming from step 10 of ' in caplog.text
  assert '20' in os.listdir(tmp_path / 'run' / 'checkpoints')


def two_processes(workdir, overrides, *flags):
  """The two processes of a run of the tiny config with `overrides` and main's `flags` in
  `workdir`."""
  address = f'127.0.0.1:{free_port()}'
  return [MainProcess(workdir, overrides, f'--coordinator_address={address}',
                      '--num_processes=2', f'--process_id={i}', *flags, env=ONE_DEVICE_PER_CORE)
          for i in range(2)]


def test_sigterm_to_one_process_during_the_final_evaluation_stops_both_at_once(tmp_path):
  runs = two_processes(tmp_path, LONG_FINAL_EVALUATION)
  runs[0].wait_for(lambda: 'step 10: checkpoint -> ' in runs[0].log, 'the final evaluation')
  runs[1].process.send_signal(signal.SIGTERM)  # Process 0 hears of it from JAX's runtime.
  sent = time.monotonic()
  assert [run.finish() for run in runs] == [128 + signal.SIGTERM] * 2, '\n\n'.join(
      run.log for run in runs)
  assert time.monotonic() - sent < 20, runs[0].log  # Not the 625 batches' evaluation.
  for run in runs:
    assert ('SIGTERM during the evaluation of step 10: stopping it now, with the checkpoint of '
            'step 10; a rerun only evaluates it.') in run.log, run.log
    assert 'Traceback' not in run.log
  assert os.listdir(tmp_path / 'checkpoints') == ['10']  # Complete: renamed from its temporary.
  assert not (tmp_path / 'model.npz').exists()


# A run long enough to be killed in the middle, a checkpoint every 10 steps.
KILLED_RUN = {'total_steps': 1000, 'checkpoint_every': 10, 'eval_every': 1000,
              'progress_every': 10}
# Seconds a killed process's peer waits for its heartbeat before naming it gone.
PEER_TIMEOUT_S = 8
PEER_TIMEOUT = f'--peer_timeout={PEER_TIMEOUT_S}'


def stopped_too(process, workdir, *flags):
  """The end of the line of a gone process, on `process` started with main's `flags` last, as
  a regular expression."""
  return (rf' Stopped process {process} too; the last complete checkpoint is step [0-9]+\. To '
          r'resume from it, start all 2 processes again with their commands, this one: python '
          rf'-m vit_jax\.main .*--process_id={process} '
          + ''.join(f'{re.escape(flag)} ' for flag in flags) + '--workdir='
          + re.escape(str(workdir)))


def named_checkpoint_is_complete(line, workdir):
  step = int(re.search(r'checkpoint is step ([0-9]+)', line)[1])
  return str(step) in os.listdir(workdir / 'checkpoints')


def test_a_process_killed_in_a_two_process_run_is_named_in_one_line_with_how_to_resume(
    tmp_path):
  runs = two_processes(tmp_path, KILLED_RUN, PEER_TIMEOUT)
  runs[0].wait_for(lambda: 'step 20/1000' in runs[0].log, 'step 20')
  runs[1].process.kill()  # As a host that dies: no goodbye.
  killed = time.monotonic()
  assert runs[0].finish() == 1, runs[0].log
  runs[1].finish()
  # After --peer_timeout, and well before JAX's own heartbeat timeout (100 s), after which it
  # aborts from C++.
  assert time.monotonic() - killed < PEER_TIMEOUT_S + 20, runs[0].log
  last = runs[0].log.strip().splitlines()[-1]
  assert re.fullmatch(
      r'Process error: process 1 of 2 sent no heartbeat for ([89]|1[0-9]) s: it was killed, or '
      r'its host died or hangs\.' + stopped_too(0, tmp_path, PEER_TIMEOUT),
      last), runs[0].log
  assert 'Traceback' not in runs[0].log and 'Fatal Python error' not in runs[0].log
  assert named_checkpoint_is_complete(last, tmp_path)


def test_process_0_killed_in_a_two_process_run_is_named_in_one_line_by_the_other(tmp_path):
  runs = two_processes(tmp_path, KILLED_RUN)
  runs[0].wait_for(lambda: (tmp_path / 'checkpoints' / '10').exists(), 'the checkpoint of 10')
  runs[0].process.kill()  # JAX's coordination service goes with it.
  killed = time.monotonic()
  assert runs[1].finish() != 0, runs[1].log  # Its output ended too: the filter is gone.
  assert time.monotonic() - killed < 20, runs[1].log  # Not the runtime's heartbeat timeout.
  runs[0].finish()
  last = runs[1].log.strip().splitlines()[-1]
  assert re.fullmatch(
      r"Process error: process 0 of 2, which serves JAX's coordination service, no longer "
      r'answers: it was killed, or its host died or hangs\.' + stopped_too(1, tmp_path),
      last), runs[1].log
  # Neither jaxlib's fatal line, nor the warnings that come with it, nor the dumps after it.
  assert runs[1].log.count('coordination service') == 1, runs[1].log
  for dump in ('Check failure stack trace', 'Fatal Python error', 'Thread 0x', 'Traceback'):
    assert dump not in runs[1].log
  assert named_checkpoint_is_complete(last, tmp_path)


def test_a_two_process_run_into_a_workdir_in_use_stops_both_in_one_line_each(tmp_path):
  held = workdirs.lock_workdir(str(tmp_path))  # As another run's: here this test's process's.
  try:
    runs = two_processes(tmp_path, KILLED_RUN)
    refused = (f'{tmp_path} is in use by process {os.getpid()} on {socket.gethostname()} (lock '
               f'{tmp_path}/lock): wait for that run to end, or use another --workdir.')
    runs[0].wait_for(lambda: refused in runs[0].log, 'the refusal')
    said = time.monotonic()
    assert [run.finish() for run in runs] == [1, 1], '\n\n'.join(run.log for run in runs)
    # Process 1 hears of it at its next heartbeat. Without it, process 1 waited for the
    # heartbeats of process 0 (30 s), and process 0 for JAX's shutdown barrier (100 s), then
    # aborted with a stack dump.
    assert time.monotonic() - said < 4 * heartbeats.HEARTBEAT_S + 5
  finally:
    workdirs.release_workdir(held)
  assert runs[0].log.strip().splitlines()[-1] == refused, runs[0].log
  assert runs[1].log.strip().splitlines()[-1] == (
      f'Stopped process 1 of 2 too, because process 0 stopped: {refused}'), runs[1].log
  for run in runs:
    for dump in ('Traceback', 'Check failure stack trace', 'Fatal Python error',
                 'coordination service'):
      assert dump not in run.log, run.log


def test_an_image_that_does_not_decode_in_a_two_process_run_stops_both_in_one_line_each(
    tmp_path):
  data = tmp_path / 'images'
  write_image_folder(data)
  (data / 'train' / 'coat' / 'broken.png').write_bytes(b'not an image')
  runs = two_processes(tmp_path / 'run', {'dataset': data, 'test_split': 'test', 'batch': 16,
                                          'batch_eval': 6, **KILLED_RUN})
  assert [run.finish() for run in runs] == [1, 1], '\n\n'.join(run.log for run in runs)
  last = [run.log.strip().splitlines()[-1] for run in runs]
  error = next(line for line in last if line.startswith('Data error: '))  # Whoever read it.
  assert error.startswith(f"Data error: Cannot decode 1 image(s) of {data} split 'train': "
                          f'{data}/train/coat/broken.png ('), error
  for process, line in enumerate(last):  # The other waited for it in a collective.
    assert line == error or re.fullmatch(
        rf'Stopped process {process} of 2 too, because process {1 - process} stopped: '
        + re.escape(error), line), runs[process].log
  for run in runs:
    assert 'Traceback' not in run.log and 'coordination service' not in run.log, run.log


# `python -m vit_jax.main ARGS` with a bug put into its checkpoint of step 10.
WITH_A_BUG_AT_STEP_10 = """
import runpy, sys
from vit_jax.training import trainer
save = trainer.save_finite
def save_finite(checkpoints, step, *args):
  if step == 10:
    raise ZeroDivisionError('a bug')
  return save(checkpoints, step, *args)
trainer.save_finite = save_finite
runpy.run_module('vit_jax.main', run_name='__main__', alter_sys=True)
"""


def test_a_bug_in_one_process_of_two_is_its_traceback_and_one_line_for_both(tmp_path):
  address = f'127.0.0.1:{free_port()}'
  commands = [main_command(tmp_path, KILLED_RUN, f'--coordinator_address={address}',
                           '--num_processes=2', f'--process_id={i}') for i in range(2)]
  commands[1][1:3] = ['-c', WITH_A_BUG_AT_STEP_10]  # In place of '-m vit_jax.main'.
  runs = [MainProcess(tmp_path, {}, command=command, env=ONE_DEVICE_PER_CORE)
          for command in commands]
  line = ("Unexpected error in process 1 of 2: ZeroDivisionError: a bug (its traceback is in "
          "the output of process 1).")
  runs[1].wait_for(lambda: line in runs[1].log, 'the line of the error')
  said = time.monotonic()
  assert [run.finish() for run in runs] == [1, 1], '\n\n'.join(run.log for run in runs)
  # At process 0's next heartbeat, not after heartbeats go quiet (30 s) or a barrier's timeout.
  assert time.monotonic() - said < 4 * heartbeats.HEARTBEAT_S + 5, runs[0].log
  assert re.search(r'Traceback \(most recent call last\):\n(.*\n)+ZeroDivisionError: a bug\n'
                   + re.escape(line), runs[1].log), runs[1].log
  assert runs[1].log.strip().splitlines()[-1] == line, runs[1].log
  assert runs[0].log.strip().splitlines()[-1] == (
      f'Stopped process 0 of 2 too, because process 1 stopped: {line}'), runs[0].log
  assert 'Traceback' not in runs[0].log and 'coordination service' not in runs[0].log


def test_the_filter_drops_gloo_connection_lines_and_passes_the_rest_as_it_came():
  """Gloo's lines come in pieces, each in a write of its own, and among lines of others."""
  read, write = os.pipe()
  sink = io.BytesIO()
  copy = threading.Thread(target=gone_process.copy_until_coordinator_lost,
                          args=(read, sink, bytes))
  copy.start()
  for piece in (b'[Gl', b'oo] Rank 5 is conn', b'ected to 7 peer ranks. Expected number of ',
                b'connected peer ranks is : 7\nstep 5/5: loss 2.2420\n',
                b'[Gloo] in a line of ours\n',
                # Two communicators connecting at once, their writes interleaved.
                b'[Gloo] Rank 0 is connected to 7', b'[Gloo] Rank 1 is connected to 7 peer ranks. '
                b'Expected number of connected peer ranks is : 7\n', b' peer ranks. Expected '
                b'number of connected peer ranks is : 7\n', b'7\n', b'3/5\r', b'4/5'):
    os.write(write, piece)
    time.sleep(0.05)  # Each read gets one piece.
  os.close(write)
  copy.join()
  os.close(read)
  assert sink.getvalue() == (
      b'step 5/5: loss 2.2420\n[Gloo] in a line of ours\n7\n3/5\r4/5'), sink.getvalue()


# A process that writes to its stderr through the filter, as process 1 of 2 does, and stops at
# SIGTERM with a line of its own and a C++ log line (which the filter holds for a while).
FILTERED = """
import os, signal, sys, time
from vit_jax.distributed import gone_process
gone_process.filter_output(2, sys.argv[1], 2, 1, 'python -m vit_jax.main --process_id=1')
def stop(signum, frame):
  print('stopping', file=sys.stderr, flush=True)
  os.write(2, b'W1202 10:00:00.000000    42 native.cc:1] a C++ warning\\n')
  sys.exit(0)
signal.signal(signal.SIGINT, lambda signum, frame: print('SIGINT', file=sys.stderr, flush=True))
signal.signal(signal.SIGTERM, stop)
print('started', file=sys.stderr, flush=True)
time.sleep(60)
"""


def test_the_filter_of_stderr_passes_every_line_on_and_outlives_its_process_group_s_signals(
    tmp_path):
  process = subprocess.Popen([sys.executable, '-c', FILTERED, str(tmp_path)],
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
  assert process.stderr.readline() == 'started\n'
  os.killpg(process.pid, signal.SIGINT)  # As a terminal's Ctrl-C.
  assert process.stderr.readline() == 'SIGINT\n'
  os.killpg(process.pid, signal.SIGTERM)  # As a scheduler's stop.
  assert process.stderr.read() == (
      'stopping\nW1202 10:00:00.000000    42 native.cc:1] a C++ warning\n')
  assert process.wait() == 0

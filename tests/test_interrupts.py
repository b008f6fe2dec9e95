"""Tests of how a command stops where its user stops it, vit_jax/interrupts.py: a Ctrl-C is one
line, a closed pipe no traceback, and the process ends by that signal.

A Ctrl-C in training (checkpoint, then stop) is tested in tests/test_main.py, in `plan`'s compile
in tests/test_plan.py.
"""
import gc
import signal
import subprocess
import sys
import time

import pytest

from helpers import user_env
from vit_jax import interrupts


def started_as_from_a_terminal(args, **kwargs) -> subprocess.Popen:
  """`subprocess.Popen(args)` of a process that takes Ctrl-C as one started from a shell does:
  pytest-xdist's workers ignore SIGINT, and a child would inherit that."""
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)
  finally:
    signal.signal(signal.SIGINT, before)


def wait_for_jax_import(pid: int) -> None:
  """Returns once process `pid` has begun to import JAX (its native library is mapped): after
  vit_jax's own import, before the command's imports are done."""
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:
    with open(f'/proc/{pid}/maps') as maps:
      if 'jaxlib' in maps.read():
        return
    time.sleep(0.005)
  raise AssertionError(f'process {pid} did not import JAX within 60 s')


# Ctrl-C just after the command was started, as its imports take seconds: before, a traceback of
# 20 to 50 lines ending in importlib's frames.
@pytest.mark.parametrize('command', [['main', '--workdir=never_made'],
                                     ['predict', '--checkpoint=none', 'image.png']],
                         ids=['main', 'predict'])
def test_a_ctrl_c_while_a_command_imports_is_one_line_and_ends_it_by_sigint(tmp_path, command):
  process = started_as_from_a_terminal([sys.executable, '-m', f'vit_jax.{command[0]}',
                                        *command[1:]], env=user_env(), cwd=tmp_path)
  wait_for_jax_import(process.pid)
  process.send_signal(signal.SIGINT)
  stdout, stderr = process.communicate(timeout=60)
  assert (process.returncode, stdout, stderr) == (-signal.SIGINT, '', 'Stopped (Ctrl-C).\n')
  assert list(tmp_path.iterdir()) == []


def test_a_program_run_from_a_package_that_imports_vit_jax_keeps_pythons_ctrl_c(tmp_path):
  # `python -m lab.run`: Python imports `lab`, and so vit_jax, as it finds the module to run.
  (tmp_path / 'lab').mkdir()
  (tmp_path / 'lab' / '__init__.py').write_text('import vit_jax\n')
  (tmp_path / 'lab' / 'run.py').write_text(
      'import signal\nprint(signal.getsignal(signal.SIGINT) is signal.default_int_handler)\n')
  env = {**user_env(), 'PYTHONPATH': f'{tmp_path}:{user_env()["PYTHONPATH"]}'}
  run = started_as_from_a_terminal([sys.executable, '-m', 'lab.run'], env=env)
  assert run.communicate(timeout=60) == ('True\n', '')


@pytest.mark.parametrize('handler', [signal.default_int_handler, signal.SIG_IGN],
                         ids=['pythons', 'ignored'])
def test_a_commands_ctrl_c_is_quiet_until_the_command_starts(monkeypatch, handler):
  monkeypatch.setattr(sys, 'argv', ['-m'])  # As Python sets it while it finds the module.
  monkeypatch.setattr(sys, 'orig_argv', ['python', '-X', 'importtime', '-m', 'vit_jax.main'])
  before = signal.signal(signal.SIGINT, handler)
  try:
    interrupts.stop_quietly_while_a_command_imports()
    quiet = signal.getsignal(signal.SIGINT)
    interrupts.command_started()
    assert (quiet is handler) == (handler is signal.SIG_IGN)  # Ignored (nohup): still ignored.
    assert signal.getsignal(signal.SIGINT) is handler
  finally:
    signal.signal(signal.SIGINT, before)


def test_a_command_whose_reader_stopped_reading_ends_by_sigpipe_without_a_traceback():
  # `python -m vit_jax.checkpoint --list | head -1`, with the reader gone before the first write.
  listing = subprocess.Popen([sys.executable, '-m', 'vit_jax.checkpoint', '--list'],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  listing.stdout.close()
  _, stderr = listing.communicate(timeout=120)
  assert (listing.returncode, stderr) == (-signal.SIGPIPE, '')


def test_a_ctrl_c_that_a_callback_swallowed_is_raised_again():
  pressed = []

  def ctrl_c_in_a_collection(phase, info):  # As JAX's callback may get one in a compile.
    del info
    if phase == 'start' and not pressed:  # The next collection's, once.
      pressed.append(True)
      signal.raise_signal(signal.SIGINT)  # Raised in this callback, which swallows it.

  # Python's own handler of Ctrl-C, which pytest-xdist's workers replace by ignoring it.
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(KeyboardInterrupt), interrupts.ctrl_c_kept():
      gc.callbacks.insert(0, ctrl_c_in_a_collection)
      gc.collect()
      time.sleep(5)  # Where the Ctrl-C comes again, at once; lost, it would not.
  finally:
    gc.callbacks.remove(ctrl_c_in_a_collection)
    signal.signal(signal.SIGINT, before)
  assert pressed

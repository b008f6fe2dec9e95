"""Tests of the console, vit_jax/console.py: the filter, the live bar, no native or library lines.

The quick start's console and every command's are checked where they run, tests/test_commands.py;
a finished run's command run again, in tests/test_config_errors.py (the damaged config.json).
"""
import gc
import io
import logging
import os
import re
import subprocess
import sys

import orbax.checkpoint as ocp
import pytest

from helpers import xla_flags
from vit_jax import console
from vit_jax.checkpoints import convert
from vit_jax.models import __main__ as models_command
from vit_jax.tools import predict
from vit_jax.training import trainer


# tests/test_commands.py checks every other command's console; the exports to a SavedModel and
# to TFLite are those that run TensorFlow themselves (TFLite's converter writes native warnings).
@pytest.mark.parametrize('format_name', ['saved_model', 'tflite'])
def test_an_export_through_tensorflow_shows_no_native_lines(trained_run, tmp_path, format_name):
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}
  env['XLA_FLAGS'] = xla_flags(None)
  result = subprocess.run(
      [sys.executable, '-m', 'vit_jax.export', '--checkpoint', trained_run[0], '--format',
       format_name, '--out', str(tmp_path / 'out')],
      env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith(f'Exported {trained_run[0]} '), result.stderr  # Its one line.
  assert result.stderr == ''


def test_native_info_lines_are_dropped_and_every_other_line_is_kept(capfd):
  # As TensorFlow's C++ runtime writes them while it loads, before its logging is set up.
  native = (b'WARNING: All log messages before absl::InitializeLog() is called are written to '
            b'STDERR\nI0000 00:00:1796162767.948242    4631 port.cc:153] oneDNN custom operations '
            b'are on.\nW0000 00:00:1796162767.951003    4631 cuda.cc:41] No CUDA driver.\n')
  with pytest.raises(ImportError):
    with console.native_info_lines_dropped():
      os.write(2, native)
      os.write(2, b'Traceback (most recent call last): ...\n')
      raise ImportError('the held lines are written all the same')
  assert capfd.readouterr().err == (
      'W0000 00:00:1796162767.951003    4631 cuda.cc:41] No CUDA driver.\n'
      'Traceback (most recent call last): ...\n')
  # And the lines a caller knows to be of no use, as it names them.
  with console.native_info_lines_dropped(also=re.compile(r'W\d{4} .* cuda\.cc:\d+\] ')):
    os.write(2, native + b'a line of its own\n')
  assert capfd.readouterr().err == 'a line of its own\n'


def record(source_module, level: int, message: str = 'a message', **extra) -> logging.LogRecord:
  """A record as if `source_module`'s code had logged `message`."""
  made = logging.LogRecord('absl', level, source_module.__file__, 1, message, None, None)
  made.__dict__.update(extra)
  return made


def test_the_collector_is_paused_inside_and_left_as_it_was_after():
  for enabled_before in (True, False):
    (gc.enable if enabled_before else gc.disable)()
    with console.collector_paused():
      assert not gc.isenabled()
    assert gc.isenabled() == enabled_before
  gc.enable()


def test_what_an_import_made_is_left_out_of_later_collections():
  try:
    with console.collector_paused():
      lasting = [[] for _ in range(1000)]  # As a module's objects: tracked by the collector.
    assert gc.get_freeze_count() >= len(lasting)
    collected = {id(obj) for generation in range(3) for obj in gc.get_objects(generation)}
    assert not collected & {id(obj) for obj in lasting}
  finally:
    gc.unfreeze()


def test_a_deferred_package_fails_to_import_inside_and_imports_after(tmp_path, monkeypatch):
  (tmp_path / 'deferred_pkg').mkdir()
  (tmp_path / 'deferred_pkg' / '__init__.py').write_text('VALUE = 7\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  with console.imports_deferred(('deferred_pkg', 'gc')):
    with pytest.raises(ImportError):
      import deferred_pkg  # noqa: F401
    import gc as imported_before  # Imported already: untouched.
  assert imported_before is gc
  import deferred_pkg
  assert deferred_pkg.VALUE == 7
  monkeypatch.delitem(sys.modules, 'deferred_pkg')


def test_tensorflow_imports_without_keras_and_tf_keras_loads_it_when_used():
  # In a fresh Python: this one imported TensorFlow, and Keras with it, long ago.
  code = ('import sys; from vit_jax import console; console.setup(False); import tensorflow as tf; '
          "print('keras' in sys.modules, tf.keras.layers.Dense(3).units, 'keras' in sys.modules)")
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, 'XLA_FLAGS': xla_flags(None)})
  assert result.stdout == 'False 3 True\n', result.stderr


def test_filter_passes_project_lines_and_library_warnings():
  passes = console.ProjectOnly().filter
  assert passes(record(trainer, logging.INFO))
  assert passes(record(ocp, logging.WARNING))
  assert not passes(record(ocp, logging.INFO))


def test_sizes_are_given_in_the_largest_unit_they_fill():
  assert console.readable_bytes(0) == '0 bytes'
  assert console.readable_bytes(1023) == '1023 bytes'
  assert console.readable_bytes(4_900_000) == '4.7 MiB'
  assert console.readable_bytes(3 * 2**30 + 2**29) == '3.50 GiB'


class Terminal(io.StringIO):
  """What a terminal receives (tqdm redraws the bar in place with carriage returns)."""

  def isatty(self):
    return True


def test_progress_lines_become_one_live_bar_on_a_terminal():
  terminal = Terminal()
  handler = console.ProgressBarHandler(terminal)
  handler.setFormatter(console.ConsoleFormatter())
  for step in (20, 40):
    handler.handle(record(trainer, logging.INFO, f'step {step}/60: loss 1.0', progress=(step, 60)))
  handler.handle(record(trainer, logging.INFO, 'step 40: test accuracy 0.5'))
  handler.handle(record(trainer, logging.INFO, 'step 60/60: loss 0.5', progress=(60, 60)))
  handler.handle(record(trainer, logging.INFO, 'Done.'))
  lines = terminal.getvalue().split('\n')
  assert sum('step 40: test accuracy 0.5' in line for line in lines) == 1
  assert '\r' in terminal.getvalue()  # The bar was redrawn, not printed again.
  bar_end = lines[-3].rsplit('\r', 1)[-1]  # The finished bar: its last drawing.
  assert bar_end.startswith('100%|') and bar_end.endswith('step 60/60: loss 0.5'), lines
  assert lines[-2].endswith(' Done.') and lines[-1] == '', lines


@pytest.mark.parametrize('command, parse', [
    ('predict', lambda argv: predict.parse_args(argv)),
    ('convert', lambda argv: convert.parse_args(argv)),
    ('models', lambda argv: models_command.main()),
])
def test_usage_names_the_command_a_user_types(command, parse, capsys, monkeypatch):
  monkeypatch.setattr(sys, 'argv', ['__main__.py', '--bad'])  # What the models command reads.
  with pytest.raises(SystemExit) as exit_status:
    parse(['--bad'])
  assert exit_status.value.code == 2
  usage = capsys.readouterr().err.splitlines()
  assert usage[0].startswith(f'usage: python -m vit_jax.{command} [-h]')
  assert usage[-1].startswith(f'python -m vit_jax.{command}: error: ')

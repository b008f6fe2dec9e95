"""The console of every vit_jax command and of the notebook: the project's lines, other
libraries' warnings.

By default the console shows what vit_jax logs (the workdir, the model, the mesh, progress,
evaluations, checkpoints, the end), each as `HH:MM:SS message`, and other libraries' records at
WARNING and above, without the INFO lines TensorFlow's C++ runtime prints as it loads. On a
terminal the progress lines become one live tqdm bar. `setup(True)` (`--log_all`, or absl's
`--verbosity=1`) keeps absl's format and every library's INFO lines. How a command stops (a
Ctrl-C, a closed pipe) is vit_jax/interrupts.py's.

Importing this module changes nothing; `python -m vit_jax.main` calls `setup` once, the other
commands run their `main` through `run`, and the notebook calls `setup` in its first cell.
"""
import argparse
import contextlib
import gc
import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import tempfile
from typing import Callable, Iterator, NoReturn, Optional, TextIO

import tqdm

from vit_jax import hardware
from vit_jax import interrupts

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def readable_bytes(count: float) -> str:
  """`count` bytes in the largest unit they fill: '0 bytes', '220 KiB', '4.9 MiB', '12.30 GiB'."""
  for unit, size, digits in (('GiB', 2**30, 2), ('MiB', 2**20, 1), ('KiB', 2**10, 0)):
    if count >= size:
      return f'{count / size:.{digits}f} {unit}'
  return f'{int(count)} bytes'


def from_project(record: logging.LogRecord) -> bool:
  """Whether `record` was logged by vit_jax's own code."""
  return os.path.abspath(record.pathname).startswith(PACKAGE_DIR + os.sep)


class ProjectOnly(logging.Filter):
  """Passes vit_jax's records and other libraries' records at WARNING and above."""

  def filter(self, record: logging.LogRecord) -> bool:
    return record.levelno >= logging.WARNING or from_project(record)


class ConsoleFormatter(logging.Formatter):
  """`HH:MM:SS message`; a warning or error adds its level, another library's its logger."""

  def __init__(self):
    super().__init__('%(asctime)s %(message)s', datefmt='%H:%M:%S')

  def formatMessage(self, record: logging.LogRecord) -> str:
    level = f'{record.levelname}: ' if record.levelno >= logging.WARNING else ''
    source = '' if from_project(record) else f'{record.name}: '
    return f'{record.asctime} {level}{source}{record.message}'


class ProgressBarHandler(logging.StreamHandler):
  """Shows the records logged with `extra={'progress': (step, total_steps)}` as one live bar,
  the record's message beside it; other records are printed above the bar."""

  BAR_FORMAT = '{percentage:3.0f}%|{bar:20}| {desc}'

  def __init__(self, stream: TextIO):
    super().__init__(stream)
    self._bar = None

  def emit(self, record: logging.LogRecord) -> None:
    try:
      progress = getattr(record, 'progress', None)
      if progress is None:
        self._print(self.format(record))
      else:
        self._advance(*progress, self.format(record))
    except Exception:  # What logging.Handler.emit does.
      self.handleError(record)

  def _print(self, line: str) -> None:
    if self._bar is None:
      self.stream.write(line + '\n')
      self.flush()
    else:
      tqdm.tqdm.write(line, file=self.stream)

  def _advance(self, step: int, total: int, line: str) -> None:
    if self._bar is None or self._bar.total != total or step < self._bar.n:
      self.close_bar()
      self._bar = tqdm.tqdm(total=total, initial=step, desc=line, file=self.stream,
                            bar_format=self.BAR_FORMAT, dynamic_ncols=True)
    else:
      self._bar.n = step
      self._bar.set_description_str(line)  # Redraws the bar.
    if step >= total:
      self.close_bar()

  def close_bar(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def close(self) -> None:
    self.close_bar()
    super().close()


# The INFO lines a C++ runtime writes to stderr before its logging is set up (absl's preamble, then
# lines like "I0000 00:00:1796162767.948242 4631 port.cc:153] oneDNN custom operations are on",
# which TensorFlow prints on CPUs with AVX512_VNNI whatever TF_CPP_MIN_LOG_LEVEL says).
NATIVE_INFO_LINE = re.compile(
    r'WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$'
    r'|I\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.]+:\d+\] ')


# While native_info_lines_dropped holds file descriptor 2 back: a copy of the descriptor it held
# back, which still writes to the console.
_stderr_held_back_from: int | None = None


def write_now(text: str) -> None:
  """Writes `text` to stderr at once, even inside native_info_lines_dropped: for a last line
  written just before the process ends (os._exit), which would otherwise stay held back."""
  sys.stderr.flush()
  if _stderr_held_back_from is None:
    sys.stderr.write(text)
    sys.stderr.flush()
  else:
    os.write(_stderr_held_back_from, text.encode())


@contextlib.contextmanager
def native_info_lines_dropped(also: re.Pattern | None = None) -> Iterator[None]:
  """Holds back what is written to file descriptor 2 inside the block (by C++ code, and by Python),
  then writes it to stderr without its NATIVE_INFO_LINE lines, nor those that `also` matches
  (a caller's known lines of no use to a user). For imports that load C++ runtimes, such as
  TensorFlow's; the held lines appear when the block ends, even if it raises."""
  global _stderr_held_back_from
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    _stderr_held_back_from = saved
    try:
      yield
    finally:
      sys.stderr.flush()
      _stderr_held_back_from = None
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      lines = held.read().decode(errors='replace').splitlines(keepends=True)
      sys.stderr.write(''.join(line for line in lines if not NATIVE_INFO_LINE.match(line)
                               and not (also and also.match(line))))
      sys.stderr.flush()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
  """Inside, the cyclic garbage collector does not run: an import that creates hundreds of
  thousands of lasting objects (TensorFlow's) otherwise spends about a sixth of its time in
  collections that free nothing. On the way out, every object made so far moves to the
  collector's permanent generation (gc.freeze): the modules, functions and classes of such an
  import last as long as the process, and the first collections after it would otherwise go
  through all of them to free nothing (benchmarks/README.md#start-up)."""
  was_enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    gc.freeze()
    if was_enabled:
      gc.enable()


@contextlib.contextmanager
def imports_deferred(names: tuple[str, ...]) -> Iterator[None]:
  """Inside, an import of any of the top-level packages `names` not imported yet fails with
  ImportError; after the block they import as usual, on first use. For TensorFlow's import,
  whose `__init__` loads all of Keras 3 (matplotlib's pyplot included) only to register Keras's
  optimizers, inside a `try` that passes on ImportError: about a quarter of its time, for a
  library vit_jax does not use. `tf.keras` still loads Keras when it is first used."""
  deferred = [name for name in names if name not in sys.modules]
  for name in deferred:
    sys.modules[name] = None  # Python's way to make `import name` raise ImportError.
  try:
    yield
  finally:
    for name in deferred:
      if sys.modules.get(name, '') is None:
        del sys.modules[name]


class QuietFirstImport(importlib.abc.MetaPathFinder):
  """An import hook (for sys.meta_path) that runs the first import of the package `name` inside
  `native_info_lines_dropped`, `collector_paused` and `imports_deferred(deferred)`, then takes
  itself off sys.meta_path. Finds nothing itself: the finders after it find the package."""

  def __init__(self, name: str, deferred: tuple[str, ...] = ()):
    self.name = name
    self.deferred = deferred

  def find_spec(self, fullname: str, path=None, target=None):
    del path, target
    if fullname != self.name:
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(fullname)
    if spec is not None and spec.loader is not None:
      exec_module = spec.loader.exec_module

      def quiet_exec_module(module):
        with (native_info_lines_dropped(), collector_paused(),
              imports_deferred(self.deferred)):
          exec_module(module)

      spec.loader.exec_module = quiet_exec_module
    return spec


def setup(log_all: bool, stream: TextIO = sys.stderr) -> None:
  """Sets the process's logging up for the console `stream`: quiet unless `log_all`.

  Quiet also hides TensorFlow's C++ INFO lines (TF_CPP_MIN_LOG_LEVEL=1 unless set, and the lines
  it prints all the same as it loads, whichever module imports it and whenever), which works
  only before TensorFlow is first imported, and, off a terminal, tfds's progress bars. That first
  import also leaves Keras to load when it is first used (`imports_deferred`).
  """
  root = logging.getLogger()
  root.setLevel(min(root.getEffectiveLevel(), logging.INFO))
  if log_all:
    return
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '1')
  if 'tensorflow' not in sys.modules and not any(
      isinstance(finder, QuietFirstImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, QuietFirstImport('tensorflow', deferred=('keras',)))
  handler = ProgressBarHandler(stream) if stream.isatty() else logging.StreamHandler(stream)
  handler.addFilter(ProjectOnly())
  handler.setFormatter(ConsoleFormatter())
  for old in root.handlers[:]:  # absl's handler, which app.run installs.
    root.removeHandler(old)
  root.addHandler(handler)
  if not stream.isatty():  # tfds's preparation bars would print a line per update.
    import tensorflow_datasets as tfds  # After TF_CPP_MIN_LOG_LEVEL is set.
    tfds.disable_progress_bar()


def command_parser(command: str, **kwargs) -> argparse.ArgumentParser:
  """The argparse parser of `python -m vit_jax.COMMAND`, which its usage line names so (not the
  file that holds its code)."""
  return argparse.ArgumentParser(prog=f'python -m vit_jax.{command}', **kwargs)


def run(main: Callable[[], Optional[int]]) -> NoReturn:
  """Runs a command line's `main` (argv from sys.argv) in the quiet console and exits with the
  status it returns: the start of every `python -m vit_jax.COMMAND` but `vit_jax.main`, whose
  flags choose between quiet and `--log_all`. JAX stays off an installed libtpu on a host
  without TPU chips (`hardware.skip_absent_tpu`), and keeps what it compiles in vit_jax's cache
  (`hardware.use_compilation_cache`)."""
  hardware.skip_absent_tpu()
  hardware.use_compilation_cache()
  setup(log_all=False)
  with interrupts.stopped_quietly():
    sys.exit(main())

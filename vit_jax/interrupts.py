"""How a vit_jax command stops where its user stops it: a Ctrl-C is one line, CTRL_C_LINE, and a
reader that stopped reading its output (`python -m vit_jax.checkpoint --list | head`) no
traceback. Either way the process then ends by that signal, as Python ends on an uncaught Ctrl-C
and a Unix tool on a closed pipe, so that a shell loop that runs the command stops too and a
pipeline's status says so.

- While the command imports its libraries (seconds: TensorFlow, JAX), before a line of its own
  runs, a Ctrl-C ends it at once with that line, not with the traceback of whichever import it
  stopped (`stop_quietly_while_a_command_imports`, called by the package's import). The command's
  code takes Ctrl-C back as it starts (`command_started`).
- Then `stopped_quietly` around the command's work. `vit_jax.main` handles its own Ctrl-Cs (the
  first in training checkpoints) and only keeps them from being swallowed (`ctrl_c_kept`).

Imports the standard library only: the package's import imports this module.
"""
import _thread
import contextlib
import os
import signal
import sys
import threading
from typing import Iterator, NoReturn

CTRL_C_LINE = 'Stopped (Ctrl-C).'
RAISE_AGAIN_S = 0.01  # When a Ctrl-C that a callback swallowed is raised again (ctrl_c_kept).


def stop_quietly_while_a_command_imports() -> None:
  """Makes a Ctrl-C end this process with CTRL_C_LINE, until `command_started`, where this
  process is `python -m vit_jax.COMMAND` and only there: Python sets argv[0] to '-m' while it
  imports the packages of the module it runs, and sys.orig_argv names that module. A process
  started with Ctrl-C ignored (`nohup`, a shell's background job) goes on ignoring it.

  The process ends at once, in the signal's handler: a KeyboardInterrupt raised through an
  unfinished import of a native library (jaxlib's) and printed in one line by sys.excepthook
  crashed the interpreter's exit with SIGSEGV; and nothing is there yet to clean up."""
  if (sys.argv[:1] == ['-m'] and _module_run().startswith('vit_jax.')
      and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    signal.signal(signal.SIGINT, _stop_importing)


def _module_run() -> str:
  """MODULE of `python [OPTIONS] -m MODULE [ARGS]`, from sys.orig_argv; '' where none is named."""
  args = sys.orig_argv[1:]
  for i, arg in enumerate(args):
    if arg == '-m':
      return args[i + 1] if i + 1 < len(args) else ''
    if arg.startswith('-m'):
      return arg[2:]
  return ''


def _stop_importing(signum, frame) -> NoReturn:
  del signum, frame
  _end_for_ctrl_c()


def command_started() -> None:
  """Gives Ctrl-C back to Python (a KeyboardInterrupt, which the command handles) where
  `stop_quietly_while_a_command_imports` had taken it; else changes nothing."""
  if signal.getsignal(signal.SIGINT) is _stop_importing:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@contextlib.contextmanager
def stopped_quietly() -> Iterator[None]:
  """Ends the process without Python's traceback where the user stopped the command:
  - a Ctrl-C (a compile, most often, is under way): one line, CTRL_C_LINE, once the `finally`
    blocks inside have run;
  - a reader of its output that stopped reading (`python -m vit_jax.checkpoint --list | head`).
  The process then ends by that signal (SIGINT, SIGPIPE). Ctrl-C is Python's again inside
  (`command_started`)."""
  command_started()
  try:
    with ctrl_c_kept():
      yield
  except KeyboardInterrupt:
    _end_for_ctrl_c()
  except BrokenPipeError:
    end_by(signal.SIGPIPE)


@contextlib.contextmanager
def ctrl_c_kept() -> Iterator[None]:
  """Inside, a Ctrl-C that a callback swallowed is raised again. Python raises a Ctrl-C's
  KeyboardInterrupt wherever the main thread runs Python code next, and that may be a callback
  whose exceptions are only printed ("Exception ignored in ...": JAX's callback of each garbage
  collection, which may come in a compile, or a `__del__`), so the Ctrl-C would be lost. Here it
  is not printed, and another thread raises it again RAISE_AGAIN_S later, in the code after the
  callback (or, if a callback swallows it again, again)."""
  previous = sys.unraisablehook

  def raise_again(unraisable) -> None:
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
      # Raised from here, it would be raised in this hook, and swallowed too.
      later = threading.Timer(RAISE_AGAIN_S, _thread.interrupt_main, (signal.SIGINT,))
      later.daemon = True
      later.start()
    else:
      previous(unraisable)

  sys.unraisablehook = raise_again
  try:
    yield
  finally:
    sys.unraisablehook = previous


def _end_for_ctrl_c() -> NoReturn:
  print(CTRL_C_LINE, file=sys.stderr)
  with contextlib.suppress(BrokenPipeError):
    sys.stdout.flush()
  end_by(signal.SIGINT)


def end_by(signum: int) -> NoReturn:
  """Ends this process by `signum`, taken as the system's default takes it; with the status a
  shell gives that, 128 + signum, where the signal is blocked (a mask it inherited)."""
  sys.stderr.flush()
  signal.signal(signum, signal.SIG_DFL)
  os.kill(os.getpid(), signum)
  os._exit(128 + signum)

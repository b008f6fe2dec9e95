"""SIGTERM and Ctrl-C in a run (`PreemptionWatcher`): the first stops training at the next step
boundary, where the loop checkpoints and returns (`main` then ends the run unfinished), or stops
an evaluation in progress (`EvaluationStopped`) on every process at the same batch; a second
Ctrl-C stops at once.
"""
import contextlib
import functools
import itertools
import logging
import signal
import sys
import threading
from typing import Callable

import jax
from jax.experimental import multihost_utils

from vit_jax import hardware


class EvaluationStopped(Exception):
  """A SIGTERM or SIGINT came during an evaluation (PreemptionWatcher.stops_evaluation)."""

  def __init__(self, signal_name: str):
    super().__init__(signal_name)
    self.signal_name = signal_name


STOP_REPEAT_S = 0.2  # How often a stopped evaluation is told again (PreemptionWatcher).


def stop_name(signal_name: str) -> str:
  """What the console calls a stop by `signal_name`: 'Ctrl-C' for 'SIGINT', else the name."""
  return 'Ctrl-C' if signal_name == 'SIGINT' else signal_name


def _drop_evaluation_stopped(previous: Callable, unraisable) -> None:
  """sys.unraisablehook in `stops_evaluation`: an EvaluationStopped that a callback swallowed
  (JAX's of each garbage collection; Python would print "Exception ignored in ...") is left
  unprinted, as it comes again within STOP_REPEAT_S; `previous` takes any other."""
  if not isinstance(unraisable.exc_value, EvaluationStopped):
    previous(unraisable)


class PreemptionWatcher:
  """Notices SIGTERM (how TPU VMs and cluster schedulers announce a preemption) and Ctrl-C.

  With one process a handler of SIGTERM and SIGINT sets a flag, and a second SIGINT stops at
  once (KeyboardInterrupt); inside `stops_evaluation` either stops at once. With several,
  JAX's distributed runtime (whose own SIGTERM handler tells every process of a SIGTERM to
  any) makes every process agree on the same step to stop at, and in the final evaluation
  on the same batch.
  """

  def __init__(self):
    self.signal_name = None
    self._evaluating = False
    self._previous = {}
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      for signum in (signal.SIGTERM, signal.SIGINT):
        self._previous[signum] = signal.signal(signum, self._on_signal)

  def _on_signal(self, signum, frame):
    del frame
    if signum == signal.SIGINT and self.signal_name == 'SIGINT':
      raise KeyboardInterrupt
    self.signal_name = signal.Signals(signum).name
    self._stop_evaluation()
    if signum == signal.SIGINT:
      logging.warning('Ctrl-C: stopping after this step with a checkpoint; press it again to '
                      'stop at once.')

  def _stop_evaluation(self, *_) -> None:
    """Raises EvaluationStopped inside `stops_evaluation`, and again every STOP_REPEAT_S
    seconds (SIGALRM) until the evaluation has stopped: libraries catch exceptions broadly
    (TensorFlow's AutoGraph, converting a function, may log one and go on)."""
    if self._evaluating:
      signal.setitimer(signal.ITIMER_REAL, STOP_REPEAT_S)
      raise EvaluationStopped(self.signal_name)

  @contextlib.contextmanager
  def stops_evaluation(self, final_step: int | None = None):
    """Inside, a SIGTERM or SIGINT (also one already received) stops the evaluation at once
    (EvaluationStopped): it runs after its step's checkpoint was started, so stopping it loses
    nothing a rerun cannot redo, and a preemption's grace period is often shorter than an
    evaluation of a large test set.

    With several processes, where `final_step` (the last step, after which no step follows)
    is given: a SIGTERM stops it at a batch on which all processes agree
    (`_sync_at_each_batch`); they cannot each stop where they are, as the others would wait at
    the batch's collectives. Another evaluation runs to its end, and the run stops at the next
    step's sync point."""
    if not self._previous:  # Several processes, or not the main thread.
      with (hardware.at_each_batch(self._sync_at_each_batch(final_step))
            if final_step is not None and jax.process_count() > 1
            else contextlib.nullcontext()):
        yield
      return
    self._previous.setdefault(signal.SIGALRM, signal.signal(signal.SIGALRM,
                                                            self._stop_evaluation))
    self._evaluating = True
    unraisable_hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_drop_evaluation_stopped, unraisable_hook)
    try:
      if self.signal_name is not None:
        self._stop_evaluation()
      yield
    except Exception as e:
      if self.signal_name is None or isinstance(e, EvaluationStopped):
        raise
      # Ours, wrapped by a library (AutoGraph re-raises it as a StagingError).
      raise EvaluationStopped(self.signal_name) from None
    finally:
      self._evaluating = False
      signal.setitimer(signal.ITIMER_REAL, 0)
      sys.unraisablehook = unraisable_hook

  def _sync_at_each_batch(self, final_step: int) -> Callable[[], None]:
    """For hardware.at_each_batch: asks JAX's preemption sync point at each batch, numbered on
    from `final_step` (the sync point's numbers must grow by one a call, alike in every
    process; Orbax asks it with the step at each save, so only after the last step are the
    numbers free), and raises EvaluationStopped at the batch where it is reached."""
    numbers = itertools.count(final_step + 1)

    def check() -> None:
      if multihost_utils.reached_preemption_sync_point(next(numbers)):
        self.signal_name = 'SIGTERM'
        raise EvaluationStopped(self.signal_name)
    return check

  def reached(self, step: int) -> bool:
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signal_name is not None

  def close(self):
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)

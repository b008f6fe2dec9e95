"""Notices a process of a multi-process run that is gone: killed, or its host dead or hung.

JAX's distributed runtime notices it too, but only after its heartbeat timeout (100 s), and then
aborts the surviving processes from C++ with a stack dump of every thread and no word on what
to do. Here each process writes a counter to the runtime's key-value store every HEARTBEAT_S
seconds and reads the others'; a counter that has not moved for GONE_AFTER_S seconds names its
process as gone, well before JAX's timeout. A process that ends on purpose (done, or preempted)
writes STOPPED instead, and is no longer watched. A process that stops on an error of its own (a
workdir in use, a config error, an image that does not decode) writes FAILED and its one line:
the others, which may be waiting for it in a collective, stop with that line at their next
heartbeat, and all of them end without JAX's shutdown barrier (`PeerWatch.fail`).
"""
import threading
import time
from typing import Callable

import jax
from jax._src import distributed  # The runtime's client: the key-value store of the processes.

HEARTBEAT_S = 2.0
GONE_AFTER_S = 30.0  # The default; main's --peer_timeout.
RUNTIME_TIMEOUT_S = 100  # JAX's heartbeat timeout (jax.distributed.initialize's default).
STOPPED = 'stopped'
FAILED = 'failed: '  # Then the error's line.


def gone_after_error(seconds: float) -> str | None:
  """Why `seconds` cannot be how long a quiet process is given before it is named gone, in
  one line; None where it can: more than two heartbeats, less than JAX's own timeout."""
  if 2 * HEARTBEAT_S < seconds < RUNTIME_TIMEOUT_S:
    return None
  return (f'--peer_timeout={seconds:g}: give more than {2 * HEARTBEAT_S:g} seconds (two '
          f'heartbeats) and less than {RUNTIME_TIMEOUT_S} (JAX\'s own timeout, after which it '
          f'aborts every process with a stack dump); the default is {GONE_AFTER_S:g}.')


def _key(process: int) -> str:
  return f'vit_jax/heartbeat/{process}'


class PeerWatch:
  """While running, calls `on_gone(process, seconds)` from its thread when another process's
  heartbeat has not moved for `seconds` (at least `gone_after_s`), and `on_failed(process, line)`
  when another process stops on an error of its own (`fail`), once every process has stopped;
  `stop` ends the watch and tells the others that this process stops on purpose. Both callbacks
  are to end the process."""

  def __init__(self, on_gone: Callable[[int, float], None], on_failed: Callable[[int, str], None],
               heartbeat_s: float = HEARTBEAT_S, gone_after_s: float = GONE_AFTER_S):
    self._client = distributed.global_state.client
    self._me = jax.process_index()
    self._others = [p for p in range(jax.process_count()) if p != self._me]
    self._on_gone, self._on_failed = on_gone, on_failed
    self._heartbeat_s, self._gone_after_s = heartbeat_s, gone_after_s
    self._stopped = threading.Event()
    self._ending = threading.Lock()  # Taken by whichever of `fail` and a peer's failure is first.
    self._thread = threading.Thread(target=self._watch, name='vit_jax heartbeats', daemon=True)

  def start(self) -> 'PeerWatch':
    self._thread.start()
    return self

  def wait_for_gone(self) -> None:
    """Waits as long as it takes to find a process gone (`on_gone` is then called), or returns
    after GONE_AFTER_S and two heartbeats: for an error that may be a collective's that failed
    because a process went."""
    self._thread.join(self._gone_after_s + 2 * self._heartbeat_s)

  def stop(self) -> None:
    self._stopped.set()
    self._thread.join()
    self._client.key_value_set(_key(self._me), STOPPED, allow_overwrite=True)

  def fail(self, line: str) -> None:
    """Tells the others that this process stops on an error of its own, `line`, and returns
    once each of them has stopped or gone quiet for `gone_after_s`: the caller then ends this
    process without JAX's shutdown barrier, which would wait for the others until the runtime's
    heartbeat timeout (about 100 s) and then abort. Blocks for good if another process's failure
    is already ending this one (its `on_failed` ends the process)."""
    self._stopped.set()
    self._thread.join()
    self._ending.acquire()
    self._client.key_value_set(_key(self._me), FAILED + line, allow_overwrite=True)
    self._wait_for_others()

  def _read(self, process: int) -> str | None:
    try:
      return self._client.key_value_try_get(_key(process))
    except Exception:  # NOT_FOUND: no heartbeat written yet; or the store, in process 0, is gone.
      return None

  def _wait_for_others(self) -> None:
    """Returns once every other process has written STOPPED or FAILED, or sent no heartbeat for
    `gone_after_s`; process 0, whose exit takes the key-value store with it, a quarter of a
    heartbeat later, so that the others end first."""
    quiet = {p: (None, time.monotonic()) for p in self._others}  # Last value, when it changed.
    while quiet:
      now = time.monotonic()
      for process, (last, since) in list(quiet.items()):
        value = self._read(process)
        if (value == STOPPED or (value or '').startswith(FAILED)
            or now - since >= self._gone_after_s):
          del quiet[process]
        elif value != last:
          quiet[process] = (value, now)
      time.sleep(0.05)
    if self._me == 0:
      time.sleep(self._heartbeat_s / 4)

  def _watch(self) -> None:
    beats = 0
    seen = {p: (None, time.monotonic()) for p in self._others}  # Last value, when it changed.
    written = time.monotonic()
    while not self._stopped.wait(self._heartbeat_s):
      beats += 1
      now = time.monotonic()
      try:
        self._client.key_value_set(_key(self._me), str(beats), allow_overwrite=True)
        written = now
      except Exception:  # The store, in process 0, is gone.
        self._on_gone(0, now - written)
        return
      for process, (last, since) in list(seen.items()):
        value = self._read(process)
        if value == STOPPED:
          del seen[process]
        elif (value or '').startswith(FAILED):
          self._stop_with(process, value.removeprefix(FAILED))
          return
        elif value != last:
          seen[process] = (value, now)
        elif now - since >= self._gone_after_s:
          self._on_gone(process, now - since)
          return

  def _stop_with(self, process: int, line: str) -> None:
    """Stops this process too, after `process` failed with `line`: says STOPPED, waits for the
    others (`_wait_for_others`), then calls `on_failed`; unless this process is failing itself
    (`fail`), which then ends it."""
    if not self._ending.acquire(blocking=False):
      return
    self._client.key_value_set(_key(self._me), STOPPED, allow_overwrite=True)
    self._wait_for_others()
    self._on_failed(process, line)

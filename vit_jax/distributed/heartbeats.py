"""Notices a process of a multi-process run that is gone: killed, or its host dead or hung.

JAX's distributed runtime notices it too, but only after its heartbeat timeout (100 s), and then
aborts the surviving processes from C++ with a stack dump of every thread and no word on what
to do. Here each process writes a counter to the runtime's key-value store every HEARTBEAT_S
seconds and reads the others'; a counter that has not moved for GONE_AFTER_S seconds names its
process as gone, well before JAX's timeout. A process that ends on purpose (done, or stopped by
an error it reports itself) writes STOPPED instead, and is no longer watched.
"""
import threading
import time
from typing import Callable

import jax
from jax._src import distributed  # The runtime's client: the key-value store of the processes.

HEARTBEAT_S = 2.0
GONE_AFTER_S = 30.0
STOPPED = 'stopped'


def _key(process: int) -> str:
  return f'vit_jax/heartbeat/{process}'


class PeerWatch:
  """While running, calls `on_gone(process, seconds)` from its thread when another process's
  heartbeat has not moved for `seconds` (at least `gone_after_s`); `stop` ends the watch and
  tells the others that this process stops on purpose."""

  def __init__(self, on_gone: Callable[[int, float], None], heartbeat_s: float = HEARTBEAT_S,
               gone_after_s: float = GONE_AFTER_S):
    self._client = distributed.global_state.client
    self._me = jax.process_index()
    self._others = [p for p in range(jax.process_count()) if p != self._me]
    self._on_gone, self._heartbeat_s, self._gone_after_s = on_gone, heartbeat_s, gone_after_s
    self._stopped = threading.Event()
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

  def _read(self, process: int) -> str | None:
    try:
      return self._client.key_value_try_get(_key(process))
    except Exception:  # NOT_FOUND: no heartbeat written yet.
      return None

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
        elif value != last:
          seen[process] = (value, now)
        elif now - since >= self._gone_after_s:
          self._on_gone(process, now - since)
          return

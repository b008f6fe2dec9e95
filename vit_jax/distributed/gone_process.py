"""The one line that names a gone process of a multi-process run, and the filter of the console
output that prints it when the gone process is process 0.

Process 0 serves JAX's coordination service. When it is gone, jaxlib ends every other process
from C++: within a second if process 0 was killed, after the runtime's heartbeat timeout (about
100 s) if it hangs or its host no longer answers. It writes a fatal log line ("Terminating
process because the JAX distributed service detected fatal errors ... Failed to send RPC to
coordination service"), a stack trace and Python's dump of every thread, then aborts (SIGABRT).
No Python code of the process runs in between, and the hook jaxlib offers for it
(`missed_heartbeat_callback` of the runtime's client) cannot be a Python function in jaxlib
0.10.2: its argument, a C++ absl::Status, has no Python form, and the call ends the process
with std::bad_cast.

So the line has to come from outside the process that aborts. `filter_output` sends the file
descriptor 2 of a process other than 0 through a small process running this module, which
passes everything on as it comes until jaxlib's fatal line, and prints `gone_line` for process
0 in place of that line and all that follows it. C++ log lines wait up to HOLD_S seconds before
they are passed on, so that the runtime's warnings that come with the fatal line (a failed
preemption poll, a polled error) go with it. The same filter keeps Gloo's connection lines
(GLOO_CONNECTED) off the console: on CPUs, every process sends its file descriptor 1 through it
too. This module uses only the standard library: the filter starts in a fraction of a second.
"""
import os
import re
import select
import signal
import sys
import time
from typing import BinaryIO, Callable

HOLD_S = 1.0
# absl's prefix of a C++ log line: severity, date, time, thread, file:line.
NATIVE_LOG_LINE = re.compile(rb'[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ \S+:\d+\] ')
# jaxlib's fatal line when the coordination service (process 0) is gone: its RPCs fail at once
# (process 0 was killed) or time out (it hangs, or its host is unreachable). absl writes the line
# in one write of less than a pipe's atomic size, so it arrives whole.
COORDINATOR_GONE = re.compile(
    rb'Terminating process because the JAX distributed service detected fatal errors\..*'
    rb'absl::Status: (UNAVAILABLE: Failed to send RPC to coordination service|DEADLINE_EXCEEDED)')
# The words of what Gloo, the collectives of processes on CPUs, prints to stdout as each of its
# communicators connects, a line for each device of each program: "[Gloo] Rank 5 is connected to
# 7 peer ranks. Expected number of connected peer ranks is : 7". Nothing a user acts on; it has
# no switch. Gloo writes a line in several writes, word by word, and two communicators connecting
# at once interleave theirs: "[Gloo] Rank 0 is connected to 7[Gloo] Rank 1 is connected to 7 peer
# ranks. Expected ... is : 7", then " peer ranks. Expected ... is : 7". So a line is Gloo's when
# it has these words and nothing else but numbers.
GLOO_WORDS = re.compile(
    rb'\[Gloo\] Rank|is connected to|peer ranks\.|Expected number of connected peer ranks is :')


def last_checkpoint(workdir: str) -> str:
  """'step N' of the newest complete checkpoint in WORKDIR/checkpoints, or 'none'."""
  directory = os.path.join(workdir, 'checkpoints')
  steps = [int(n) for n in os.listdir(directory) if n.isdigit()] if os.path.isdir(directory) else []
  return f'step {max(steps)}' if steps else 'none'


def coordinator_gone(process_count) -> str:
  """The words for process 0 gone, as `gone_line` takes them: the same whether its coordination
  service's RPCs failed first (this filter) or its heartbeats stopped (heartbeats.PeerWatch)."""
  return (f"process 0 of {process_count}, which serves JAX's coordination service, no longer "
          'answers')


def gone_line(gone: str, workdir: str, process_count: int, process_index: int,
              command: str) -> str:
  """The line that says which process is `gone` (its words: 'process 1 of 2 sent no heartbeat
  for 30 s'), that this one stops too, and how to resume: `command` on this host."""
  return (f'Process error: {gone}: it was killed, or its host died or hangs. Stopped process '
          f'{process_index} too; the last complete checkpoint is {last_checkpoint(workdir)}. To '
          f'resume from it, start all {process_count} processes again with their commands, '
          f'this one: {command}')


def filter_output(fd: int, workdir: str, process_count: int, process_index: int,
                  command: str) -> None:
  """Sends what this process writes to its file descriptor `fd` (1, stdout, or 2, stderr; C++'s
  and Python's alike) through `python -m vit_jax.distributed.gone_process` (this module), which
  writes it to where `fd` went before and ends when the pipe closes, that is when this process
  has ended. SIGINT and SIGTERM are blocked in it from its start: a terminal's Ctrl-C and a
  scheduler's SIGTERM reach every process of the group, and the filter has to outlive this
  process to pass its last lines on."""
  (sys.stdout if fd == 1 else sys.stderr).flush()
  read, write = os.pipe()
  os.posix_spawn(
      sys.executable, [sys.executable, '-m', 'vit_jax.distributed.gone_process', workdir,
                       str(process_count), str(process_index), command], os.environ,
      file_actions=[(os.POSIX_SPAWN_DUP2, fd, 1), (os.POSIX_SPAWN_DUP2, read, 0)],
      setsigmask={signal.SIGINT, signal.SIGTERM})
  os.dup2(write, fd)
  os.close(read)
  os.close(write)


def copy_until_coordinator_lost(source: int, sink: BinaryIO,
                                gone: Callable[[], bytes]) -> None:
  """Copies what arrives on file descriptor `source` to `sink` as it comes, less Gloo's
  connection lines (GLOO_WORDS), until `source` closes; a C++ log line and what follows it wait
  up to HOLD_S seconds. On jaxlib's fatal line for an unreachable coordination service, writes
  `gone()` in place of that line, of the held lines and of everything after, and returns when
  `source` closes."""
  held, release_at = [], None  # Pieces of lines held back, and when to pass them on.
  unfinished = b''  # The start of a line that may be Gloo's, which writes its lines in pieces.
  while True:
    wait = None if release_at is None else max(release_at - time.monotonic(), 0.0)
    if not select.select([source], [], [], wait)[0]:  # Held HOLD_S, and no fatal line came.
      write_all(sink, held)
      held, release_at = [], None
      continue
    chunk = os.read(source, 1 << 16)
    if not chunk:  # The process has ended.
      write_all(sink, [*held, unfinished])
      return
    pieces = (unfinished + chunk).splitlines(keepends=True)
    unfinished = pieces.pop() if may_start_a_gloo_line(pieces[-1]) else b''
    for piece in pieces:
      if GLOO_WORDS.search(piece) and only_numbers_beside_gloo_words(piece):
        continue
      if COORDINATOR_GONE.search(piece):
        write_all(sink, [gone()])
        while os.read(source, 1 << 16):  # The dump that follows, until the process ends.
          pass
        return
      if release_at is None and NATIVE_LOG_LINE.match(piece):
        release_at = time.monotonic() + HOLD_S
      if release_at is None:
        sink.write(piece)
      else:
        held.append(piece)
    sink.flush()


def may_start_a_gloo_line(piece: bytes) -> bool:
  """Whether `piece`, the last of what has arrived, may be the start of a Gloo line whose end
  is still to come: unfinished, and of Gloo's words and numbers or a start of them."""
  return not piece.endswith((b'\n', b'\r')) and (
      only_numbers_beside_gloo_words(piece) or piece.startswith(b'[Gloo]')
      or b'[Gloo]'.startswith(piece))


def only_numbers_beside_gloo_words(piece: bytes) -> bool:
  """Whether `piece` holds nothing but GLOO_WORDS, digits and white space."""
  return re.fullmatch(rb'[\d\s]*', GLOO_WORDS.sub(b'', piece)) is not None


def write_all(sink: BinaryIO, pieces: list[bytes]) -> None:
  sink.write(b''.join(pieces))
  sink.flush()


def main(argv: list[str]) -> None:
  """The filter: `python -m vit_jax.distributed.gone_process WORKDIR PROCESS_COUNT
  PROCESS_INDEX COMMAND` copies its stdin to its stdout (the stdout or stderr the process had
  before `filter_output`)."""
  workdir, count, index, command = argv[1:]

  def process_0_gone() -> bytes:
    return (gone_line(coordinator_gone(count), workdir, int(count), int(index), command)
            + '\n').encode()

  copy_until_coordinator_lost(0, sys.stdout.buffer, process_0_gone)


if __name__ == '__main__':
  main(sys.argv)

"""The start of JAX's multi-process runtime, and the end of a process whose peer is gone."""
import logging
import os
import sys
from typing import NoReturn

import jax

from vit_jax import console
from vit_jax import interrupts
from vit_jax.distributed import gone_process
from vit_jax.distributed import heartbeats

# Variables by which clusters that jax.distributed.initialize() detects by itself announce
# more than one process (Slurm, Open MPI, multi-host TPU slices).
CLUSTER_SIZE_VARIABLES = ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE')


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int) -> bool:
  """Starts JAX's multi-process runtime when this is one of several processes: with
  `coordinator_address` (host:port of process 0), `num_processes` and this `process_id` where
  an address is given, else as a cluster that JAX detects announces them; returns whether it
  did."""
  if coordinator_address:
    jax.distributed.initialize(coordinator_address, num_processes, process_id)
  elif (any(int(os.environ.get(v, 1)) > 1 for v in CLUSTER_SIZE_VARIABLES)
        or ',' in os.environ.get('TPU_WORKER_HOSTNAMES', '')):
    jax.distributed.initialize()
  else:
    return False
  return True


def exit_for_gone_process(workdir: str, command: str, process: int, seconds: float) -> None:
  """heartbeats.PeerWatch's `on_gone`, `workdir` and `command` (the one that resumes this
  process) given first: says in one line which process is gone and how to resume, and ends this
  process at once (its collectives would wait for the gone one until JAX's runtime aborts
  it). Process 0 is named as the filter of gone_process names it, whichever noticed first."""
  gone = (gone_process.coordinator_gone(jax.process_count()) if process == 0 else
          f'process {process} of {jax.process_count()} sent no heartbeat for {seconds:.0f} s')
  end_with(gone_process.gone_line(gone, workdir, jax.process_count(), jax.process_index(),
                                  command))


def exit_for_failed_process(process: int, line: str) -> None:
  """heartbeats.PeerWatch's `on_failed`: says in one line that this process stops because
  `process` stopped on its error `line` (which says what to do), and ends this process."""
  end_with(f'Stopped process {jax.process_index()} of {jax.process_count()} too, because '
           f'process {process} stopped: {line}')


def exit_with_error(line: str, peers: heartbeats.PeerWatch | None,
                    signum: int | None = None) -> NoReturn:
  """Ends this process with its error's one `line`: exit status 1, or where the user stopped it
  at once (a Ctrl-C, `signum`), by that signal, as Python ends on an uncaught one. With other
  processes (`peers`), it first tells them, and they stop with the line too
  (`heartbeats.PeerWatch.fail`)."""
  if peers is None and signum is None:
    sys.exit(line)
  write_line(line)
  if peers is not None:
    peers.fail(line)
  if signum is not None:
    interrupts.end_by(signum)
  os._exit(1)


def end_with(line: str) -> NoReturn:
  """Writes `line` last and ends this process at once, with exit status 1: without JAX's
  shutdown barrier, which would wait for the other processes."""
  write_line(line)
  os._exit(1)


def write_line(line: str) -> None:
  """`line` on stderr, after every log line written before it, even while an import holds stderr
  back (console.native_info_lines_dropped): the process may end before the import does."""
  for handler in logging.getLogger().handlers:
    handler.flush()
  console.write_now(line + '\n')

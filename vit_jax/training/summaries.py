"""The run's TensorBoard summaries, written in the background and given up on a full disk.

clu's asynchronous writer logs a failed write from its thread as a long traceback; on a full
disk the summaries are the least of what fails (the checkpoint due next says so in one line,
`train_checkpoints.CheckpointSaveError`). So a write that fails for lack of space logs one
warning and ends the summaries of this run; training goes on, and any other error is raised as
before.
"""
import logging
from typing import Any, Callable

from clu import metric_writers

from vit_jax.checkpoints import npz


class _SpaceTolerant:
  """Passes each call on to `writer`; after one that failed for lack of space, does nothing."""

  def __init__(self, writer: metric_writers.MetricWriter, directory: str):
    self._writer, self._directory, self._given_up = writer, directory, False

  def __getattr__(self, name: str) -> Callable[..., Any]:
    method = getattr(self._writer, name)

    def call(*args, **kwargs):
      if self._given_up:
        return None
      try:
        return method(*args, **kwargs)
      except Exception as e:  # TensorFlow's ResourceExhaustedError, or an OSError.
        if not npz.is_out_of_space(e):
          raise
        self._given_up = True
        logging.warning('TensorBoard summaries stopped: writing them to %s failed (No space left '
                        'on device; %s free).', self._directory,
                        npz.free_space(self._directory))
        return None
    return call


def writer(directory: str, is_main: bool) -> metric_writers.MetricWriter:
  """The run's summary writer: TensorBoard events in `directory` from the main process, written
  in the background; a writer of nothing on the other processes."""
  if not is_main:
    return metric_writers.MultiWriter([])
  summary = _SpaceTolerant(metric_writers.SummaryWriter(directory), directory)
  return metric_writers.AsyncMultiWriter([summary])

"""The training state's checkpoints in `WORKDIR/checkpoints` (Orbax), for vit_jax.training.trainer.

Each step's checkpoint holds the train state (params, optimiser state, step, RNG, EMA) and the
data iterator's state, so that a resumed run continues exactly. Saves run in the background and
are confirmed before older checkpoints are deleted; a failed save is one line
(CheckpointSaveError); checkpoints that do not restore are set aside, not deleted.
"""
import atexit
import gc
import logging
import os
import re
import shutil
import time
import traceback

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import type_handlers

from vit_jax.checkpoints import npz
from vit_jax.checkpoints import runs
from vit_jax.errors import ConfigError
from vit_jax.training.step import TrainState


class CheckpointSaveError(RuntimeError):
  """A checkpoint save failed; the message is one line: what, where, free space, last good one.

  `step` is the step whose save failed; `final_state` the train state of the last step where
  its save was the one that failed (its params can still be written as model.npz).
  """
  final_state = None

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


def _reason(error: BaseException) -> str:
  """Why `error` failed a save, short: an OSError's strerror ('No space left on device'), else
  the end of its message's first line (TensorStore's '...: File too large [os_error_code=27]')."""
  if isinstance(error, OSError) and error.strerror:
    return error.strerror
  if code := re.search(r"os_error_code='?([0-9]+)", str(error)):  # TensorStore's.
    return os.strerror(int(code[1]))
  return (str(error).strip().splitlines() or [type(error).__name__])[0].rsplit(': ', 1)[-1]


def _from_orbax(record: logging.LogRecord) -> bool:
  """Whether `record` comes from Orbax: logged by its code, naming it, or with an exception
  raised in it (asyncio's 'Task exception was never retrieved' names only the task)."""
  frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info else []
  return any('orbax' in text for text in
             [record.pathname, record.getMessage()] + [frame.filename for frame in frames])


class _SaveErrorCatcher(logging.Filter):
  """Keeps Orbax's error records off the console (a failed background save logs hundreds of
  traceback lines from several threads) and holds the first as the reason of the failure."""

  def __init__(self):
    super().__init__()
    self.reason = None

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR or not _from_orbax(record):
      return True
    if self.reason is None:
      error = record.exc_info[1] if record.exc_info else None
      self.reason = _reason(error or RuntimeError(record.getMessage()))
    return False


# The loggers Orbax's errors reach: its own (absl's) and asyncio's (tasks that failed).
_ORBAX_LOGGERS = ('absl', 'asyncio')
# How Orbax names a save before it completes: STEP.orbax-checkpoint-tmp, with a suffix or not.
UNFINISHED_MARK = '.orbax-checkpoint-tmp'


def _state_handler() -> ocp.PyTreeCheckpointHandler:
  """Orbax's handler of a pytree of arrays, as StandardCheckpointHandler has it, but with
  replica-parallel saving only where several processes share the devices. That splits each
  array replicated over N devices into N slices, so that the hosts share the writing; within
  one process, where the writing is not shared, it only costs a slicing program per array and
  replica at every save, on the main thread (docs/distributed.md has the cost; Orbax's own
  default turns it off on GPUs). The arrays'
  files are the same either way. Left out is the per-host array metadata that Orbax's default
  handler adds (each array's write shape), which it reads back only for typed PRNG keys (the
  state's key is raw uint32): checkpoints of either handler restore with the other."""
  standard_types = (int, float, bytes, np.number, np.ndarray, str)
  registry = type_handlers.create_type_handler_registry(
      *[(kind, type_handlers.get_type_handler(kind)) for kind in standard_types],
      (jax.Array, type_handlers.ArrayHandler(use_replica_parallel=jax.process_count() > 1)))
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class Checkpoints:
  """Orbax checkpoints in `WORKDIR/checkpoints`: (train state, data-iterator state) per step.

  Saves run in the background; each is confirmed complete (at the next step, `confirm`) before
  older checkpoints are deleted, so the newest complete checkpoint is never deleted and a failed
  save is reported at once. `keep` (config.keep_checkpoints) of 0 or None keeps every one.
  """

  def __init__(self, workdir: str, keep: int | None):
    self.workdir = os.path.abspath(workdir)
    self.directory = os.path.join(self.workdir, runs.CHECKPOINTS)
    self.keep = keep or None
    self._remove_unfinished_saves()
    # The items' handlers named up front, so that the manager reads their metadata from the
    # step's folder (`has_ema`) before any save or restore has registered them.
    self.manager = ocp.CheckpointManager(
        self.directory, item_handlers={'state': _state_handler(),
                                       'data': ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(create=True))
    self._pending = None  # The step of the save not yet confirmed.
    # The step whose save failed, if one did: its abandoned tasks may log and write until exit.
    self._failed = None
    self._errors = _SaveErrorCatcher()
    for logger in _ORBAX_LOGGERS:
      logging.getLogger(logger).addFilter(self._errors)

  def complete_steps(self) -> list[int]:
    """The steps of the complete checkpoints, oldest first. Orbax lists a step from the start
    of its save, before its folder exists under its name: a save in progress is waited for (and
    confirmed) first, so that no reader takes it for a damaged checkpoint."""
    self.confirm(wait=True)
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return (self.complete_steps() or [None])[-1]

  def save(self, state: TrainState, data_state: dict) -> None:
    """Starts saving `state` in the background, after confirming the previous save."""
    self.confirm(wait=True)
    step = int(jax.device_get(state.step))
    try:
      self.manager.save(step, args=ocp.args.Composite(
          state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state)))
    except OSError as e:  # Failed before going to the background (e.g. no space for a folder).
      self._errors.reason = _reason(e)
      self._fail(step)
    self._pending = step
    logging.info('step %d: checkpoint -> %s', step, os.path.join(self.directory, str(step)))

  def confirm(self, wait: bool = False) -> None:
    """Checks a finished background save (`wait`: waits for it): deletes checkpoints beyond
    `keep` once it is complete; raises CheckpointSaveError if it failed.

    With several processes only `wait` checks: all must check at the same step (deleting
    synchronises them), and each may see the save finish at another one.
    """
    if self._pending is None or (not wait and (jax.process_count() > 1
                                               or self.manager.is_saving_in_progress())):
      return
    step, self._pending = self._pending, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # The save's error, from its thread.
      self._errors.reason = self._errors.reason or _reason(e)
      self._fail(step)
    self.manager.reload()
    if step not in self.manager.all_steps():
      self._fail(step)
    self.delete_old()

  def delete_old(self) -> None:
    """Deletes all but the newest `keep` checkpoints."""
    steps = self.complete_steps()
    for step in steps[:-self.keep] if self.keep else ():
      self.manager.delete(step)

  def _fail(self, step: int):
    """Stops Orbax's background work, removes the partial save of `step` and raises
    CheckpointSaveError."""
    self._failed = step
    self._close_manager()
    gc.collect()  # Orbax's abandoned tasks log their errors now, while they are filtered.
    self._remove_partial(step)
    # Orbax's close stops at the save's error, so its other threads may still write; the
    # interpreter joins them at exit, before the atexit functions run.
    atexit.register(self._remove_partial, step)
    self.manager.reload()
    last = self.manager.latest_step()
    reason, self._errors.reason = self._errors.reason or 'no finished checkpoint appeared', None
    raise CheckpointSaveError(
        f'Saving the checkpoint of step {step} to {self.directory} failed ({reason}); '
        f'{npz.free_space(self.directory)} free there; the last good checkpoint is '
        f'{f"step {last}" if last is not None else "none"}.', step)

  def _remove_partial(self, step: int) -> None:
    """Removes the unfinished save of `step` (Orbax names it STEP.orbax-checkpoint-tmp)."""
    for name in os.listdir(self.directory):
      if name.startswith(f'{step}.') and jax.process_index() == 0:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def _remove_unfinished_saves(self) -> None:
    """Removes the half-written saves of a run that was killed (process 0), before the manager
    opens the folder. Orbax's own cleanup (cleanup_tmp_directories) runs in a thread that its
    close() does not wait for: a run that stops at once, on a config error, would exit while
    that thread runs, and the thread's failure at exit would print a traceback."""
    if jax.process_index() != 0 or not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if UNFINISHED_MARK in name:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        logging.info('Removed %s, a save left unfinished by a run that was stopped.', name)

  def _close_manager(self) -> None:
    """Closes the Orbax manager; after a failed save, its error (raised again by every
    close) is already reported."""
    try:
      self.manager.close()
    except Exception:
      if self._failed is None:
        raise

  def restore(self, state: TrainState, shardings: TrainState) -> tuple[TrainState, dict] | None:
    """(state, data-iterator state) of the newest checkpoint that restores, placed with
    `shardings`; None without checkpoints.

    Newer checkpoints that fail to restore (damaged files) are logged and moved to
    `WORKDIR/damaged_checkpoints`; a ConfigError if none restores. The EMA of the params follows
    `state`: one the checkpoint lacks starts from its params, one `state` lacks is dropped
    (`adopt_ema`).
    """
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            state, shardings)
    skipped = []
    for step in reversed(self.complete_steps()):
      try:
        # The EMA is laid out as the params are.
        saved = abstract.replace(ema=abstract.params if self.has_ema(step) else None)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                saved, restore_args=ocp.checkpoint_utils.construct_restore_args(saved)),
            data=ocp.args.JsonRestore()))
      except Exception as e:  # TensorStore, JSON or missing files: the step is skipped.
        logging.warning('Skipped checkpoint %d in %s: it does not restore (%s).', step,
                        self.directory, _first_line(e))
        skipped.append((step, e))
        continue
      for damaged, _ in skipped:
        self.set_aside(damaged, 'damaged_checkpoints')
      return adopt_ema(restored.state, keep=state.ema is not None), restored.data
    if skipped:
      raise ConfigError(
          f'No checkpoint in {self.directory} restores (step {skipped[0][0]}: '
          f'{_first_line(skipped[0][1])}): restore the config the run was started with, or use '
          'another --workdir to start afresh.')
    return None

  def has_ema(self, step: int) -> bool:
    """Whether the train state saved at `step` holds an EMA of the params."""
    return self.manager.item_metadata(step).state.tree.get('ema') is not None

  def set_aside(self, step: int, folder: str) -> None:
    """Moves the checkpoint of `step` to `WORKDIR/folder/STEP` (kept, but not resumed from)."""
    if jax.process_index() == 0:
      target = os.path.join(self.workdir, folder, str(step))
      os.makedirs(os.path.dirname(target), exist_ok=True)
      if os.path.exists(target):
        target += time.strftime('-%Y%m%d-%H%M%S')
      os.replace(os.path.join(self.directory, str(step)), target)
      logging.warning('Moved the checkpoint of step %d to %s.', step, target)
    multihost_utils.sync_global_devices(f'set aside checkpoint {step}')
    self.manager.reload()

  def close(self) -> None:
    """Waits for the last save and confirms it; raises CheckpointSaveError if it failed."""
    try:
      self.confirm(wait=True)
    finally:
      self._close_manager()
      if self._failed is None:  # Else the failed save's tasks may yet log errors, up to exit.
        for logger in _ORBAX_LOGGERS:
          logging.getLogger(logger).removeFilter(self._errors)


def adopt_ema(state: TrainState, keep: bool) -> TrainState:
  """A restored `state` with an EMA of the params where `keep` (config.ema_decay is set) and
  without one otherwise: a checkpoint saved without one starts it from its params."""
  if keep and state.ema is None:
    logging.warning('The checkpoint of step %d holds no EMA of the params (saved with '
                    'config.ema_decay=0): the EMA starts from its params.', int(state.step))
    return state.replace(ema=jax.tree.map(jnp.copy, state.params))
  if not keep and state.ema is not None:
    logging.warning('config.ema_decay=0: the EMA of the params in the checkpoint of step %d '
                    'is dropped.', int(state.step))
    return state.replace(ema=None)
  return state


def _first_line(error: BaseException, limit: int = 300) -> str:
  """`TypeName: first line of the message`, at most `limit` characters."""
  lines = str(error).strip().splitlines()
  text = f'{type(error).__name__}: {lines[0] if lines else ""}'
  return text if len(text) <= limit else text[:limit - 3] + '...'

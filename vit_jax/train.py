"""Training and fine-tuning: one sharded `jax.jit` update step, evaluation, checkpoints, metrics.

The data flows one way: config -> (dataset info, mesh, model, optimiser) -> train state ->
step loop -> Orbax checkpoints in `WORKDIR/checkpoints`, TensorBoard metrics in `WORKDIR`,
and at the end the params as `WORKDIR/model.npz` in the published format.
"""
import contextlib
import itertools
import json
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

from clu import metric_writers
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import Mesh
import ml_collections

from vit_jax import checkpoint
from vit_jax import config as defaults
from vit_jax import evaluators
from vit_jax import fit
from vit_jax import hardware
from vit_jax import input_pipeline
from vit_jax import model_init
from vit_jax import models
from vit_jax import param_groups
from vit_jax import registry
from vit_jax import summaries
from vit_jax.errors import ConfigError
# The update step lives in vit_jax.train_step, free of TensorFlow; the checkpoints of the train
# state in vit_jax.train_checkpoints.
from vit_jax.train_checkpoints import Checkpoints, CheckpointSaveError
from vit_jax.train_step import TrainState, create_train_state
from vit_jax.train_step import make_optimizer
# The mesh, model and evaluation step live in vit_jax.train_setup, free of TensorFlow, for
# vit_jax.plan to compile the same step.
from vit_jax.train_setup import build_model, make_mesh
from vit_jax.train_setup import make_eval_step  # noqa: F401  (train.make_eval_step, as before)
# The evaluation of a split lives in vit_jax.evaluators.classification.
from vit_jax.evaluators.classification import evaluate  # noqa: F401  (train.evaluate, as before)
from vit_jax.validation import pretrained_file, validate_config


class NonFiniteError(RuntimeError):
  """The loss or gradient stopped being finite; no checkpoint of that state was written."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step  # The first step found non-finite.


# Setup.


def init_params(config, model, image_size: int):
  """Freshly initialised params on the host (the same as the train state's at step 0)."""
  return jax.jit(lambda rng: model_init.init_params(model, rng, image_size))(
      jax.random.PRNGKey(config.seed))


# The loop.


def flatten_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{'pp.crop': 224, ...} with TensorBoard-friendly values, for hparams."""
  return _flatten(config.to_dict())


def _flatten(tree: dict) -> dict[str, Any]:
  """{'a': {'b': 1}} -> {'a.b': 1}; values other than int, float, str and bool as str."""
  flat = {}

  def visit(prefix, value):
    if isinstance(value, dict):
      for key, sub in value.items():
        visit(f'{prefix}{key}.', sub)
    else:
      flat[prefix[:-1]] = value if isinstance(value, (int, float, str, bool)) else str(value)

  visit('', tree)
  return flat


# The config fields a checkpoint's shapes depend on; the data order's are input_pipeline's.
STATE_FIELDS = ('model', 'pp.crop', 'dataset', 'optimizer', 'scan_layers', 'posemb', 'objective',
                'mpp.target', 'frozen')
# Fields newer than some saved config.json files: a config that lacks one holds its default
# (`added_field_defaults`), the value that behaves as the versions without the field did.
ADDED_FIELDS = ('model.transformer.stochastic_depth', 'model.transformer.stochastic_depth_schedule',
                'posemb', 'objective', 'mpp.target', 'frozen')


def added_field_defaults() -> dict[str, Any]:
  """{field of ADDED_FIELDS: its default}: the registry's TRANSFORMER_DEFAULTS for the model's
  fields, config.training_defaults() for the others."""
  flat = _flatten({**defaults.training_defaults().to_dict(),
                   'model': {'transformer': registry.TRANSFORMER_DEFAULTS}})
  return {field: flat[field] for field in ADDED_FIELDS}


def resume_mismatches(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """The fields fixing the checkpoints' shapes or data order that differ between
  `WORKDIR/config.json` and `config`, as 'field (saved X, now Y)'; [] without a config.json.
  A ConfigError where config.json does not read (`checkpoint.read_run_config`)."""
  try:
    saved = checkpoint.read_run_config(workdir)
  except checkpoint.CheckpointError as e:
    raise ConfigError(str(e)) from None
  if saved is None:
    return []
  added = added_field_defaults()
  saved = {**added, **_flatten(saved)}
  now = {**added, **_flatten(json.loads(config.to_json_best_effort()))}
  fields = STATE_FIELDS + input_pipeline.ORDER_FIELDS
  return [f'{key} (saved {saved.get(key)!r}, now {now.get(key)!r})'
          for key in sorted(saved.keys() | now.keys())
          if any(key == f or key.startswith(f + '.') for f in fields)
          and saved.get(key) != now.get(key)]


# What a run writes through WORKDIR/NAME.tmp files (`write_config`, `checkpoint.save`).
WRITTEN_THROUGH_TMP = ('config.json', 'model.npz', 'model_raw.npz')


def remove_stale_temporaries(workdir: str) -> None:
  """Removes the WORKDIR/NAME.tmp of WRITTEN_THROUGH_TMP that a killed run left half-written."""
  for name in WRITTEN_THROUGH_TMP:
    path = os.path.join(workdir, name + '.tmp')
    if os.path.exists(path):
      os.remove(path)
      logging.info('Removed %s, left half-written by a run that was stopped.', path)


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes `WORKDIR/config.json` (through a temporary file: never half a file)."""
  path = os.path.join(workdir, 'config.json')
  with open(path + '.tmp', 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
  os.replace(path + '.tmp', path)


def restore_or_start(config, checkpoints: Checkpoints, state: TrainState, shardings: TrainState,
                     mesh: Mesh) -> tuple[TrainState, input_pipeline.TrainIterator]:
  """(state, training batches) from the newest intact checkpoint, or from `state` at step 0."""
  if checkpoints.latest_step() is not None:
    if mismatches := resume_mismatches(config, checkpoints.workdir):
      raise ConfigError(
          f'{checkpoints.workdir} holds a run with other {", ".join(mismatches)}: its '
          'checkpoints cannot continue with these. Run with the saved values, or start afresh '
          'with another --workdir.')
  restored = checkpoints.restore(state, shardings)
  if restored is None:
    return state, input_pipeline.get_train_iterator(config, mesh)
  state, data_state = restored
  try:
    train_iter = input_pipeline.restore_train_iterator(config, mesh, data_state)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  logging.info('Resuming from step %d of %s.', int(state.step), checkpoints.directory)
  return state, train_iter


@contextlib.contextmanager
def data_errors(prefix: str):
  """Raises the errors of the data sources (an unknown dataset, a bad split or folder, a test
  image that does not decode) as ConfigError, the message after `prefix`."""
  try:
    yield
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f'{prefix}{e}') from None


def check_data(config: ml_collections.ConfigDict, prefix: str) -> input_pipeline.DatasetInfo:
  """The dataset info of `config`; raises ConfigError, its message after `prefix`, where the
  dataset or a split does not exist or a test image does not decode."""
  with data_errors(prefix):
    return input_pipeline.get_dataset_info(config)


def check_classes(config: ml_collections.ConfigDict, info: input_pipeline.DatasetInfo) -> None:
  """Raises ConfigError where a supervised run's dataset has fewer than 2 classes: a classifier
  of one class scores every image right and learns nothing."""
  if config.objective == 'supervised' and info.num_classes < 2:
    raise ConfigError(
        f'config.dataset={config.dataset!r} has {info.num_classes} class'
        f'{"" if info.num_classes == 1 else "es"} ({", ".join(info.label_names) or "none"}): a '
        'classifier needs 2 or more. Use a dataset of several classes (an image folder: one '
        'folder per class, DIR/train/<class>/ and DIR/test/<class>/), or pre-train without '
        'labels with --config.objective=masked_patch_prediction.')


SHOWN_CLASS_NAMES = 5  # Class names the dataset line shows; '...' for the rest.


def dataset_line(config: ml_collections.ConfigDict, info: input_pipeline.DatasetInfo) -> str:
  """'Dataset NAME: N train images (SPLIT), M test images (SPLIT), K classes (a, b, ...).'"""
  names = ', '.join(info.label_names[:SHOWN_CLASS_NAMES])
  more = ', ...' if info.num_classes > SHOWN_CLASS_NAMES else ''
  return (f'Dataset {config.dataset}: {info.num_train:,} train images ({config.train_split}), '
          f'{info.num_test:,} test images ({config.test_split}), {info.num_classes} classes '
          f'({names}{more}).')


# Passes over each training image beyond which a run from scratch gets a warning: its config's
# schedule was made for more data (on 20 images, 900 steps of 128 spend minutes on a flat loss).
MAX_PASSES = 100
SMALL_DATA_CONFIG = 'configs/scratch_small.py'


def warn_of_repetition(config: ml_collections.ConfigDict,
                       info: input_pipeline.DatasetInfo) -> None:
  """Logs a warning where a run from scratch sees each training image more than MAX_PASSES
  times, naming SMALL_DATA_CONFIG. Fine-tuning is left alone: the paper fine-tunes for hundreds
  of passes over small datasets."""
  passes = config.total_steps * config.batch / info.num_train
  if passes > MAX_PASSES and not config.pretrained_path:
    logging.warning(
        'This run sees each of its %s training images about %s times (%s steps of %s images), '
        'a schedule made for more data. For a small image folder, --config=%s:DIR fits the '
        'schedule to it (about %d passes, with augmentation and regularisation); or lower '
        '--config.total_steps.', f'{info.num_train:,}', f'{passes:,.0f}',
        f'{config.total_steps:,}', config.batch, SMALL_DATA_CONFIG, MAX_PASSES)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (or fine-tunes, with `config.pretrained_path`) and evaluates; returns last metrics.

  A workdir holding a checkpoint resumes from its newest intact one. The metrics hold
  'preempted_at_step' after a SIGTERM or SIGINT (its checkpoint is then written and confirmed).
  """
  validate_config(config, jax.device_count())
  info = check_data(config, '')
  check_classes(config, info)
  logging.info('%s', dataset_line(config, info))
  warn_of_repetition(config, info)
  mesh = make_mesh(config)
  model = build_model(config, info.num_classes)
  evals = evaluators.build(config, model, mesh)  # Checks their data before anything compiles.
  logging.info('Mesh: %s over %d %s devices.', dict(mesh.shape), mesh.size,
               mesh.devices.flat[0].platform)
  limit, where = fit.device_memory_limit(mesh.local_devices[0])
  if config.accum_steps == 'auto':
    config = fit.fitted_config(config, mesh, info.num_classes, limit, where)
    logging.info('config.accum_steps=auto: %d, the fewest micro-batches whose step fits.',
                 config.accum_steps)
  optimizer = make_optimizer(config)
  is_main = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  if is_main:
    remove_stale_temporaries(workdir)

  params = None
  if config.pretrained_path:
    params = load_pretrained_params(config, model)
  state, shardings = create_train_state(config, model, optimizer, mesh, config.pp.crop, params)
  if param_groups.is_set(config):
    logging.info('%s', param_groups.summary(config, state.params))
  checkpoints = Checkpoints(workdir, config.keep_checkpoints)
  try:
    state, train_iter = restore_or_start(config, checkpoints, state, shardings, mesh)
    if is_main:  # Only now: a resume that fails keeps the config.json of the run it found.
      write_config(config, workdir)
    checkpoints.delete_old()
    state, last_metrics = train(config, model, optimizer, mesh, shardings, state, train_iter,
                                checkpoints, evals)
  except CheckpointSaveError as e:
    if e.final_state is None:
      raise
    saved = export_after_failed_save(e.final_state, model, config, workdir,
                                    info.label_names)
    raise CheckpointSaveError(f'{e} {saved}', e.step) from None
  finally:
    checkpoints.close()
  if 'preempted_at_step' not in last_metrics:
    try:
      export(state, model, config, workdir, info.label_names)
    except CheckpointSaveError as e:
      raise CheckpointSaveError(
          f'{e} The checkpoint of step {int(state.step)} is complete: free some space and run '
          'the same command again to write the file.', e.step) from None
  return last_metrics


def export_after_failed_save(state: TrainState, model, config, workdir: str,
                             label_names: list[str]) -> str:
  """Writes model.npz of the final `state` whose checkpoint failed; says whether it could."""
  try:
    export(state, model, config, workdir, label_names)
  except CheckpointSaveError as e:
    return f'{e} Free some space and run the same command again.'
  return (f'The final params are in {os.path.join(workdir, checkpoint.WORKDIR_MODEL)}; free some '
          'space and run the same command again for the final checkpoint.')


def export(state: TrainState, model, config: ml_collections.ConfigDict, workdir: str,
           label_names: list[str]) -> None:
  """Writes the final params as WORKDIR/model.npz in the published layout, with the model spec
  and the dataset's class names (`label_names`, in label order: what `predict` prints); with an
  EMA, model.npz holds the EMA and model_raw.npz the params themselves."""
  files = {'model.npz': (state.params, 'params')}
  if state.ema is not None:
    files = {'model.npz': (state.ema, 'EMA of the params'),
             'model_raw.npz': (state.params, 'params')}
  spec = {**models.model_spec(model, config.model_name), 'label_names': list(label_names)}
  for name, (params, what) in files.items():
    # Every process joins the gather (params may be split across hosts); process 0 writes.
    params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
      path = os.path.join(workdir, name)
      try:
        checkpoint.save(params, path, spec=spec)
      except OSError as e:  # A full disk: one line, and no partial file (save removes it).
        raise CheckpointSaveError(
            f'Writing the final {what} to {path} failed ({e.strerror or e}); '
            f'{checkpoint.free_space(path)} free there.', int(state.step)) from None
      logging.info('Wrote the final %s to %s.', what, os.path.join(workdir, name))


def train(config, model, optimizer, mesh, shardings, state, train_iter, checkpoints,
          evals: list[evaluators.Evaluator]):
  """Compiles the steps and runs them from `state.step` on, with the evaluators `evals`;
  returns the last state and metrics.

  A run that has already reached `config.total_steps` is evaluated once instead.
  """
  is_main = jax.process_index() == 0
  # Metrics and hparams go to TensorBoard only (the console shows the progress lines).
  writer = summaries.writer(checkpoints.workdir, is_main)
  if int(state.step) >= config.total_steps:
    logging.info('Already trained to step %d of %d: evaluating it.', int(state.step),
                 config.total_steps)
    preemption = PreemptionWatcher()
    try:
      with preemption.stops_evaluation(final_step=int(state.step)):
        # Not written: TensorBoard has this step's evaluation from the run that reached it.
        metrics = evaluate_due(config, int(state.step), state, evals,
                               metric_writers.MultiWriter([]))
      return state, metrics
    except EvaluationStopped as e:
      return state, stop_evaluation(e, int(state.step), final=True)
    finally:
      preemption.close()
  train_step = fit.checked_train_step(config, model, optimizer, mesh, shardings, state)
  if int(state.step) == 0:
    writer.write_hparams(flatten_config(config))
  flops_per_image = 3 * models.gflops_per_image(model, config.pp.crop) * 1e9
  peak_flops, peak_kind = hardware.local_peak_flops(jnp.dtype(config.dtype))
  peak_flops *= jax.process_count()
  logging.info('Model %s: %s params, %.3f GFLOPs per training image; peak %.1f TFLOP/s (%s).',
               config.model_name, f'{models.count_params(model, config.pp.crop):,}',
               flops_per_image / 1e9, peak_flops / 1e12, peak_kind)
  preemption = PreemptionWatcher()
  try:
    return run_steps(config, state, train_step, evals, train_iter, writer, checkpoints,
                     preemption, flops_per_image / peak_flops)
  finally:
    preemption.close()
    writer.flush()


def run_steps(config, state, train_step, evals: list[evaluators.Evaluator], train_iter, writer,
              checkpoints: Checkpoints, preemption, flops_per_image_over_peak):
  """The step loop, from `state.step` to `config.total_steps` or a preemption; after each
  step the evaluators of `evals` that are due (evaluators.is_due) run.

  Returns the last state and the last metrics; these hold 'preempted_at_step' after a SIGTERM
  or SIGINT. Each step's checkpoint is started before its evaluation, so a failing evaluation
  loses no training.
  """
  first_step = int(state.step)
  last_metrics = {}
  logged_losses = {}  # {step: train loss} as logged, for the message of a divergence.
  timer_start, timer_step = time.perf_counter(), first_step
  previous = None
  try:
    for step in range(first_step + 1, config.total_steps + 1):
      state, metrics = train_step(state, next(train_iter))
      checkpoints.confirm()  # A failed background save is reported at the next step.
      if previous is not None:  # Checked one step late, so the host does not wait on each step.
        check_finite(*previous)
      previous = (step, metrics)
      if step == first_step + 1:  # Leave compilation out of the throughput.
        jax.block_until_ready(state)
        timer_start, timer_step = time.perf_counter(), step
      if step % config.progress_every == 0 or step == config.total_steps:
        check_finite(step, metrics)
        logged = {k: v for k, v in jax.device_get(metrics).items() if k != 'finite'}
        speed = ''
        if step > timer_step:  # Not on the first step (its time is mostly compilation).
          elapsed = time.perf_counter() - timer_start
          images_per_second = (step - timer_step) * config.batch / elapsed
          logged.update(images_per_second=images_per_second,
                        mfu=images_per_second * flops_per_image_over_peak)
          eta = (config.total_steps - step) * elapsed / (step - timer_step)
          speed = (f', {images_per_second:.0f} img/s, MFU {logged["mfu"]:.3f}, '
                   f'ETA {_format_seconds(eta)}')
        writer.write_scalars(step, logged)
        objective = ''.join(f', {name[len("train_"):].replace("_", " ")} {value:.4f}'
                            for name, value in logged.items()
                            if name.startswith('train_') and name != 'train_loss')
        logging.info('step %d/%d: loss %.4f%s%s', step, config.total_steps, logged['train_loss'],
                     objective, speed, extra={'progress': (step, config.total_steps)})  # tty bar.
        last_metrics.update(logged)
        logged_losses[step] = float(logged['train_loss'])
        timer_start, timer_step = time.perf_counter(), step
      preempted = preemption.reached(step)
      checkpointed = (preempted or step % config.checkpoint_every == 0
                      or step == config.total_steps)
      if checkpointed:
        check_finite(step, metrics)
        checkpoints.save(state, train_iter.get_state())
      if preempted:
        logging.warning('Preempted at step %d (%s): checkpointing it and stopping.', step,
                        preemption.signal_name or 'SIGTERM')
        return state, {**last_metrics, 'preempted_at_step': step}
      eval_start = time.perf_counter()
      try:
        with preemption.stops_evaluation(
            final_step=step if step == config.total_steps else None):
          last_metrics.update(evaluate_due(config, step, state, evals, writer))
      except EvaluationStopped as e:
        if not checkpointed:
          check_finite(step, metrics)
          checkpoints.save(state, train_iter.get_state())
        return state, {**last_metrics,
                       **stop_evaluation(e, step, final=step == config.total_steps)}
      timer_start += time.perf_counter() - eval_start  # Leave evaluation out of the throughput.
    checkpoints.confirm(wait=True)  # The final save: should it fail, `state` is still here.
  except NonFiniteError as e:
    raise NonFiniteError(f'{e} {offer_finite_checkpoint(checkpoints, e.step, logged_losses)}',
                         e.step) from None
  except CheckpointSaveError as e:
    if e.step == config.total_steps:  # Training is complete: its params can still be written.
      e.final_state = state
    raise
  return state, last_metrics


def evaluate_due(config, step: int, state: TrainState, evals: list[evaluators.Evaluator],
                 writer) -> dict[str, float]:
  """Runs the evaluators of `evals` due after `step` (all of them after the last step) on the
  params of `state`, and where it keeps an EMA of them (config.ema_decay) on that too, its
  metrics named with '_ema' appended; logs each evaluator's line, writes its metrics to
  `writer` and returns them all."""
  metrics = {}
  for evaluator in evals:
    if not evaluators.is_due(evaluator, step, config.total_steps):
      continue
    start = time.perf_counter()
    evaluated = evaluator.run(state.params)
    if state.ema is not None:
      evaluated.update({f'{name}_ema': value for name, value in evaluator.run(state.ema).items()})
    writer.write_scalars(step, evaluated)
    logging.info('step %d: %s', step, evaluator.line(evaluated, time.perf_counter() - start))
    metrics.update(evaluated)
  return metrics


def stop_evaluation(stopped: 'EvaluationStopped', step: int, final: bool) -> dict[str, int]:
  """Logs the stop of the evaluation of `step`, whose checkpoint is saved; returns the metrics
  of a preemption at `step`."""
  rerun = 'only evaluates it' if final else 'resumes after it, without this evaluation'
  logging.warning('%s during the evaluation of step %d: stopping it now, with the checkpoint '
                  'of step %d; a rerun %s.', stopped.signal_name, step, step, rerun)
  return {'preempted_at_step': step}


def offer_finite_checkpoint(checkpoints: Checkpoints, bad_step: int,
                            logged_losses: dict[int, float]) -> str:
  """After a non-finite step `bad_step`: sets aside the checkpoint whose params it started from
  (to `WORKDIR/diverged_checkpoints`) and says which checkpoint a rerun resumes from."""
  checkpoints.confirm(wait=True)
  if bad_step - 1 in checkpoints.manager.all_steps():
    checkpoints.set_aside(bad_step - 1, 'diverged_checkpoints')
  offered = checkpoints.latest_step()
  advice = ('Lower config.base_lr, lengthen config.warmup_steps or check the data, then run '
            'again: ')
  if offered is None:
    return advice + 'no checkpoint was written yet, so it starts afresh.'
  earlier = [s for s in logged_losses if s <= offered]
  loss = (f'last logged loss {logged_losses[max(earlier)]:.4f} at step {max(earlier)}'
          if earlier else 'no loss logged since this run resumed')
  return advice + f'it resumes from the checkpoint of step {offered} ({loss}).'


def check_finite(step: int, metrics: dict) -> None:
  """Raises NonFiniteError, naming the step, if that step's loss or gradient was not finite."""
  if not bool(metrics['finite']):
    loss, grad_norm = float(metrics['train_loss']), float(metrics['grad_norm'])
    raise NonFiniteError(
        f'Non-finite loss or gradient at step {step} (loss {loss}, gradient norm {grad_norm}); '
        'stopped without checkpointing that state.', step)


class EvaluationStopped(Exception):
  """A SIGTERM or SIGINT came during an evaluation (PreemptionWatcher.stops_evaluation)."""

  def __init__(self, signal_name: str):
    super().__init__(signal_name)
    self.signal_name = signal_name


STOP_REPEAT_S = 0.2  # How often a stopped evaluation is told again (PreemptionWatcher).


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


def load_pretrained_params(config, model):
  """Pretrained params from `config.pretrained_path`, fitted to `model` at `config.pp.crop`."""
  fresh = init_params(config, model, config.pp.crop)
  try:
    return checkpoint.load_pretrained(pretrained_file(config), jax.device_get(fresh),
                                      model, posemb_method=config.posemb_method,
                                      keep_head=config.pretrained_keep_head)
  except (ValueError, KeyError) as e:
    raise ConfigError(f'config.pretrained_path={config.pretrained_path!r} does not fit '
                      f'{config.model_name}: {e}') from None


def _format_seconds(seconds: float) -> str:
  seconds = int(round(seconds))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'

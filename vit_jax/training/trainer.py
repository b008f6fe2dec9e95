"""Training and fine-tuning: one sharded `jax.jit` update step, evaluation, checkpoints, metrics.

The data flows one way: config -> (dataset info, mesh, model, optimiser) -> train state ->
step loop -> Orbax checkpoints in `WORKDIR/checkpoints`, TensorBoard metrics in `WORKDIR`,
and at the end the params as `WORKDIR/model.npz` in the published format.
"""
from collections.abc import Callable
import logging
import os
import signal
import time

from clu import metric_writers
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import Mesh
import ml_collections

from vit_jax import evaluators
from vit_jax import hardware
from vit_jax import tasks
from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import runs
from vit_jax.config.checks import pretrained_file, validate_config
from vit_jax.data import pipeline
from vit_jax.errors import ConfigError
from vit_jax.evaluators.classification import evaluate  # noqa: F401  (the old train.evaluate)
from vit_jax.models import blank
from vit_jax.models import flops
from vit_jax.models import registry
from vit_jax.training import dataset_checks
from vit_jax.training import fit
from vit_jax.training import param_groups
from vit_jax.training import preemption
from vit_jax.training import resume
from vit_jax.training import summaries
from vit_jax.training.setup import build_model, make_mesh
from vit_jax.training.setup import make_eval_step  # noqa: F401  (the old train.make_eval_step)
from vit_jax.training.state_checkpoints import Checkpoints, CheckpointSaveError
from vit_jax.training.step import make_optimizer
from vit_jax.training.step import TrainState, abstract_train_state, initial_train_state


class NonFiniteError(RuntimeError):
  """The loss or gradient stopped being finite; no checkpoint of that state was written."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step  # The first step found non-finite.


def init_params(config, model, image_size: int):
  """Freshly initialised params on the host (the same as the train state's at step 0)."""
  return jax.jit(lambda rng: blank.init_params(model, rng, image_size))(
      jax.random.PRNGKey(config.seed))


def restore_or_start(config, checkpoints: Checkpoints, shapes: TrainState, shardings: TrainState,
                     mesh: Mesh, start: Callable[[], TrainState],
                     ) -> tuple[TrainState, pipeline.TrainIterator]:
  """(state, training batches) from the newest intact checkpoint, restored into `shapes` (the
  state's ShapeDtypeStructs) with `shardings`, or else from `start()`, the state at step 0:
  only a fresh run compiles the init."""
  if checkpoints.latest_step() is not None:
    if mismatches := resume.resume_mismatches(config, checkpoints.workdir):
      raise ConfigError(
          f'{checkpoints.workdir} holds a run with other {", ".join(mismatches)}: its '
          'checkpoints cannot continue with these. Run with the saved values, or start afresh '
          'with another --workdir.')
  restored = checkpoints.restore(shapes, shardings)
  if restored is None:
    return start(), pipeline.get_train_iterator(config, mesh)
  state, data_state = restored
  try:
    train_iter = pipeline.restore_train_iterator(config, mesh, data_state)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  logging.info('Resuming from step %d of %s.', int(state.step), checkpoints.directory)
  return state, train_iter


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (or fine-tunes, with `config.pretrained_path`) and evaluates; returns last metrics.

  A workdir holding a checkpoint resumes from its newest intact one. After a SIGTERM or SIGINT
  the metrics hold 'preempted_at_step' (its checkpoint is then written and confirmed) and
  'preempted_by_signal', that signal's number.
  """
  validate_config(config, jax.device_count())
  resume.check_holds_no_other_files(workdir)
  info = dataset_checks.check_data(config, '')
  dataset_checks.check_classes(config, info)
  dataset_checks.check_label_kind(config, info)
  logging.info('%s', dataset_checks.dataset_line(config, info))
  dataset_checks.warn_of_repetition(config, info)
  mesh = make_mesh(config)
  model = build_model(config, info.num_classes)
  evals = evaluators.build(config, model, mesh)  # Checks their data before anything compiles.
  logging.info('Mesh: %s over %d %s devices.', dict(mesh.shape), mesh.size,
               mesh.devices.flat[0].platform)
  limit, where = fit.device_memory_limit(mesh.local_devices[0])
  if config.accum_steps == 'auto':
    config = fit.fitted_config(config, mesh, info.num_classes, limit, where, info.multi_label)
    logging.info('config.accum_steps=auto: %d, the fewest micro-batches whose step fits.',
                 config.accum_steps)
  optimizer = make_optimizer(config)
  is_main = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  if is_main:
    resume.remove_stale_temporaries(workdir)

  shapes, shardings = abstract_train_state(config, model, optimizer, mesh, config.pp.crop)
  if param_groups.is_set(config):
    logging.info('%s', param_groups.summary(config, shapes.params))
  checkpoints = Checkpoints(workdir, config.keep_checkpoints)

  def start() -> TrainState:
    """The state at step 0: only a run that restores no checkpoint reads the pretrained file
    (a resume of a fine-tune loads none of it, and compiles no init)."""
    params = load_pretrained_params(config, model) if config.pretrained_path else None
    return initial_train_state(config, model, optimizer, shardings, config.pp.crop, params)

  try:
    state, train_iter = restore_or_start(config, checkpoints, shapes, shardings, mesh, start)
    if is_main:  # Only now: a resume that fails keeps the config.json of the run it found.
      resume.write_config(config, workdir)
    checkpoints.delete_old()
    state, last_metrics = train(config, model, optimizer, mesh, shardings, state, train_iter,
                                checkpoints, evals, info.multi_label)
  except CheckpointSaveError as e:
    if e.final_state is None:
      raise
    saved = write_model_after_failed_save(e.final_state, model, config, workdir,
                                    info.label_names)
    raise CheckpointSaveError(f'{e} {saved}', e.step) from None
  finally:
    checkpoints.close()
  if 'preempted_at_step' not in last_metrics:
    try:
      write_model(state, model, config, workdir, info.label_names)
    except CheckpointSaveError as e:
      raise CheckpointSaveError(
          f'{e} The checkpoint of step {int(state.step)} is complete: free some space and run '
          'the same command again to write the file.', e.step) from None
  return last_metrics


def write_model_after_failed_save(state: TrainState, model, config, workdir: str,
                             label_names: list[str]) -> str:
  """Writes model.npz of the final `state` whose checkpoint failed; says whether it could."""
  try:
    write_model(state, model, config, workdir, label_names)
  except CheckpointSaveError as e:
    return f'{e} Free some space and run the same command again.'
  return (f'The final params are in {os.path.join(workdir, runs.WORKDIR_MODEL)}; free some '
          'space and run the same command again for the final checkpoint.')


def write_model(state: TrainState, model, config: ml_collections.ConfigDict, workdir: str,
                label_names: list[str]) -> None:
  """Writes the final params as WORKDIR/model.npz in the published layout, with the model spec,
  the dataset's class names (`label_names`, in label order: what `predict` prints), the
  (height, width) the model was trained at (`runs.native_image_size` reads it), config.pp.resize
  (`resize`: how `predict` frames an image, as evaluation did), config.loss (`loss`: how
  `predict` turns logits into probabilities) and the objective (`tasks.spec_of`: what
  `runs.load_model` rebuilds); with an EMA, model.npz holds the
  EMA and model_raw.npz the params themselves."""
  files = {'model.npz': (state.params, 'params')}
  if state.ema is not None:
    files = {'model.npz': (state.ema, 'EMA of the params'),
             'model_raw.npz': (state.params, 'params')}
  spec = {**registry.model_spec(model, config.model_name), 'label_names': list(label_names),
          'image_size': list(blank.image_hw(config.pp.crop)), 'resize': config.pp.resize,
          'loss': config.loss, **tasks.spec_of(config)}
  for name, (params, what) in files.items():
    # Every process joins the gather (params may be split across hosts); process 0 writes.
    params = multihost_utils.process_allgather(params, tiled=True)
    if jax.process_index() == 0:
      path = os.path.join(workdir, name)
      try:
        npz.save(params, path, spec=spec)
      except OSError as e:  # A full disk: one line, and no partial file (save removes it).
        raise CheckpointSaveError(
            f'Writing the final {what} to {path} failed ({e.strerror or e}); '
            f'{npz.free_space(path)} free there.', int(state.step)) from None
      logging.info('Wrote the final %s to %s.', what, os.path.join(workdir, name))


def train(config, model, optimizer, mesh, shardings, state, train_iter, checkpoints,
          evals: list[evaluators.Evaluator], multi_label: bool = False):
  """Compiles the steps (for multi-hot labels of `multi_label` data) and runs them from
  `state.step` on, with the evaluators `evals`; returns the last state and metrics.

  A run that has already reached `config.total_steps` is evaluated once instead.
  """
  is_main = jax.process_index() == 0
  # Metrics and hparams go to TensorBoard only (the console shows the progress lines).
  writer = summaries.writer(checkpoints.workdir, is_main)
  if int(state.step) >= config.total_steps:
    logging.info('Already trained to step %d of %d: evaluating it.', int(state.step),
                 config.total_steps)
    watcher = preemption.PreemptionWatcher()
    try:
      with watcher.stops_evaluation(final_step=int(state.step)):
        # Not written: TensorBoard has this step's evaluation from the run that reached it.
        metrics = evaluate_due(config, int(state.step), state, evals,
                               metric_writers.MultiWriter([]))
      return state, metrics
    except preemption.EvaluationStopped as e:
      return state, stop_evaluation(e, int(state.step), final=True)
    finally:
      watcher.close()
  train_step = fit.checked_train_step(config, model, optimizer, mesh, shardings, state,
                                      multi_label)
  if int(state.step) == 0:
    writer.write_hparams(resume.flatten_config(config))
  flops_per_image = 3 * flops.gflops_per_image(model, config.pp.crop) * 1e9
  peak_flops, peak_kind = hardware.local_peak_flops(jnp.dtype(config.dtype))
  peak_flops *= jax.process_count()
  logging.info('Model %s: %s params, %.3f GFLOPs per training image; peak %.1f TFLOP/s (%s).',
               config.model_name, f'{registry.count_leaves(state.params):,}',
               flops_per_image / 1e9, peak_flops / 1e12, peak_kind)
  watcher = preemption.PreemptionWatcher()
  try:
    return run_steps(config, state, train_step, evals, train_iter, writer, checkpoints,
                     watcher, flops_per_image / peak_flops)
  finally:
    watcher.close()
    writer.flush()


def run_steps(config, state, train_step, evals: list[evaluators.Evaluator], train_iter, writer,
              checkpoints: Checkpoints, watcher, flops_per_image_over_peak):
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
        logged = report_progress(config, step, metrics, (timer_start, timer_step), writer,
                                 flops_per_image_over_peak)
        last_metrics.update(logged)
        logged_losses[step] = float(logged['train_loss'])
        timer_start, timer_step = time.perf_counter(), step
      preempted = watcher.reached(step)
      checkpointed = (preempted or step % config.checkpoint_every == 0
                      or step == config.total_steps)
      if checkpointed:
        save_finite(checkpoints, step, state, metrics, train_iter)
      if preempted:
        signal_name = watcher.signal_name or 'SIGTERM'
        logging.warning('%s at step %d: checkpointing it and stopping.',
                        preemption.stop_name(signal_name), step)
        return state, {**last_metrics, **preempted_metrics(step, signal_name)}
      eval_start = time.perf_counter()
      try:
        with watcher.stops_evaluation(
            final_step=step if step == config.total_steps else None):
          last_metrics.update(evaluate_due(config, step, state, evals, writer))
      except preemption.EvaluationStopped as e:
        if not checkpointed:
          save_finite(checkpoints, step, state, metrics, train_iter)
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


def report_progress(config, step: int, metrics: dict, since: tuple[float, int], writer,
                    flops_per_image_over_peak: float) -> dict[str, float]:
  """Checks that `step` is finite (check_finite), then logs its line (log_progress) and writes
  its metrics to `writer`; returns them as log_progress does."""
  check_finite(step, metrics)
  logged = log_progress(config, step, metrics, since, flops_per_image_over_peak)
  writer.write_scalars(step, logged)
  return logged


def save_finite(checkpoints: Checkpoints, step: int, state: TrainState, metrics: dict,
                train_iter) -> None:
  """Starts the checkpoint of `state` at `step` and of `train_iter`'s data order, once
  check_finite passed on the step's `metrics`: a diverged state is never saved."""
  check_finite(step, metrics)
  checkpoints.save(state, train_iter.get_state())


def log_progress(config, step: int, metrics: dict, since: tuple[float, int],
                 flops_per_image_over_peak: float) -> dict[str, float]:
  """Logs the line of `step` (its losses, and images/s, MFU and ETA measured from `since`, a
  (time.perf_counter() seconds, step) pair, where `step` is past it); returns its metrics as
  host floats, the speed included."""
  logged = {k: v for k, v in jax.device_get(metrics).items() if k != 'finite'}
  speed = ''
  start, start_step = since
  if step > start_step:  # Not on the first step (its time is mostly compilation).
    elapsed = time.perf_counter() - start
    images_per_second = (step - start_step) * config.batch / elapsed
    logged.update(images_per_second=images_per_second,
                  mfu=images_per_second * flops_per_image_over_peak)
    eta = (config.total_steps - step) * elapsed / (step - start_step)
    speed = (f', {images_per_second:.0f} img/s, MFU {logged["mfu"]:.3f}, '
             f'ETA {_format_seconds(eta)}')
  objective = ''.join(f', {name[len("train_"):].replace("_", " ")} {value:.4f}'
                      for name, value in logged.items()
                      if name.startswith('train_') and name != 'train_loss')
  logging.info('step %d/%d: loss %.4f%s%s', step, config.total_steps, logged['train_loss'],
               objective, speed, extra={'progress': (step, config.total_steps)})  # tty bar.
  return logged


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


def stop_evaluation(stopped: preemption.EvaluationStopped, step: int,
                    final: bool) -> dict[str, int]:
  """Logs the stop of the evaluation of `step`, whose checkpoint is saved; returns the metrics
  of a preemption at `step`."""
  rerun = 'only evaluates it' if final else 'resumes after it, without this evaluation'
  logging.warning('%s during the evaluation of step %d: stopping it now, with the checkpoint '
                  'of step %d; a rerun %s.', preemption.stop_name(stopped.signal_name), step, step,
                  rerun)
  return preempted_metrics(step, stopped.signal_name)


def preempted_metrics(step: int, signal_name: str) -> dict[str, int]:
  """The metrics of a run that the signal `signal_name` ('SIGTERM', 'SIGINT') stopped at `step`."""
  return {'preempted_at_step': step, 'preempted_by_signal': int(signal.Signals[signal_name])}


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


def load_pretrained_params(config, model):
  """Pretrained params from `config.pretrained_path`, fitted to `model` at `config.pp.crop`: the
  position embeddings to its grid of patches (square or not), the patch kernel to its patch
  size (`finetune.load_pretrained`)."""
  fresh = init_params(config, model, config.pp.crop)
  try:
    return finetune.load_pretrained(pretrained_file(config), jax.device_get(fresh),
                                      model, posemb_method=config.posemb_method,
                                      grid=model.grid(config.pp.crop),
                                      keep_head=config.pretrained_keep_head)
  except (ValueError, KeyError) as e:
    raise ConfigError(f'config.pretrained_path={config.pretrained_path!r} does not fit '
                      f'{config.model_name}: {e}') from None


def _format_seconds(seconds: float) -> str:
  seconds = int(round(seconds))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'

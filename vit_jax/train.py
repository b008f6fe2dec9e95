"""Training and fine-tuning: one sharded `jax.jit` update step, evaluation, checkpoints, metrics.

The data flows one way: config -> (dataset info, mesh, model, optimiser) -> train state ->
step loop -> Orbax checkpoints in `WORKDIR/checkpoints`, TensorBoard metrics in `WORKDIR`,
and at the end the params as `WORKDIR/model.npz` in the published format.
"""
import logging
import os
import signal
import threading
import time
from typing import Any, Callable

from clu import metric_writers
import flax
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp

from vit_jax import checkpoint
from vit_jax import hardware
from vit_jax import input_pipeline
from vit_jax import models
from vit_jax import models_vit
from vit_jax import sharding

Batch = dict[str, jax.Array]


class ConfigError(ValueError):
  """A config value that cannot work; the message is one line naming the field and the fix."""


class NonFiniteError(RuntimeError):
  """The loss or gradient stopped being finite; no checkpoint of that state was written."""


@flax.struct.dataclass
class TrainState:
  """Everything a resumed run needs besides the data order: step, params, optimiser, rng."""
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array  # A raw uint32 PRNG key; dropout keys are folded in from it per step.


# Setup.


def make_mesh(config: ml_collections.ConfigDict, devices=None) -> Mesh:
  """A ('data', 'model') mesh over `devices` (all by default); `mesh.data = -1` takes the rest."""
  devices = np.asarray(jax.devices() if devices is None else devices)
  model_size, data_size = config.mesh.model, data_parallel_size(config, devices.size)
  if data_size * model_size != devices.size:
    raise ConfigError(
        f'config.mesh data={config.mesh.data} x model={model_size} does not cover the '
        f'{devices.size} devices: make their product {devices.size} (data=-1 fills it in).')
  return Mesh(devices.reshape(data_size, model_size), ('data', 'model'))


def data_parallel_size(config: ml_collections.ConfigDict, num_devices: int) -> int:
  """The size of the mesh's 'data' axis over `num_devices` devices."""
  return config.mesh.data if config.mesh.data != -1 else num_devices // config.mesh.model


def batch_split_error(config: ml_collections.ConfigDict, data_devices: int) -> str | None:
  """Why the batches (and micro-batches) of `config` do not split evenly over `data_devices`
  data-parallel devices, or None where they do."""
  if config.batch % (data_devices * config.accum_steps):
    return (f'config.batch={config.batch} is not divisible by {data_devices} data-parallel '
            f'devices x config.accum_steps={config.accum_steps}: make it a multiple of '
            f'{data_devices * config.accum_steps}.')
  if config.batch_eval % data_devices:
    return (f'config.batch_eval={config.batch_eval} is not divisible by {data_devices} '
            'data-parallel devices: make it a multiple of it.')
  return None


def fits_devices(config: ml_collections.ConfigDict, num_devices: int) -> bool:
  """Whether `config` can train on `num_devices` devices: its mesh covers them, and its batches
  split evenly over the data-parallel ones."""
  data = data_parallel_size(config, num_devices)
  return data * config.mesh.model == num_devices and batch_split_error(config, data) is None


def validate_config(config: ml_collections.ConfigDict, num_devices: int) -> None:
  """Raises ConfigError for a config that cannot train, before anything is compiled."""
  if not config.model:
    raise ConfigError(f'Unknown model config.model_name={config.model_name!r}. Known models: '
                      f'{", ".join(models.MODEL_CONFIGS)} (short names in configs/vit.py).')
  for field, choices in (('optimizer', ('sgd', 'adamw')), ('decay_type', ('cosine', 'linear')),
                         ('dtype', ('float32', 'bfloat16')), ('sharding', sharding.STRATEGIES),
                         ('remat_policy', (None,) + models_vit.REMAT_POLICIES)):
    if config[field] not in choices:
      raise ConfigError(f'config.{field}={config[field]!r} is not one of {choices}.')
  if error := batch_split_error(config, data_parallel_size(config, num_devices)):
    raise ConfigError(error)
  model = build_model(config, num_classes=1)
  step = model.stem_stride * np.array(model.patch_size)
  if any(config.pp.crop % step):
    raise ConfigError(
        f'config.pp.crop={config.pp.crop} is not divisible by the patch size '
        f'{step[0]}x{step[1]} of {config.model_name}: use e.g. '
        f'{max(config.pp.crop // step[0], 1) * step[0]}.')
  if config.pretrained_path and not os.path.exists(config.pretrained_path) and '://' not in (
      config.pretrained_path):
    raise ConfigError(f'config.pretrained_path={config.pretrained_path!r} does not exist: give '
                      'the path of a .npz checkpoint (published, or a WORKDIR/model.npz).')


def pretrained_overrides(config: ml_collections.ConfigDict) -> dict:
  """The model fields recorded next to `config.pretrained_path` (checkpoint.save_model_overrides;
  e.g. the exact GELU of converted Hugging Face or timm weights); {} without one."""
  if not config.pretrained_path:
    return {}
  try:
    return checkpoint.load_model_overrides(config.pretrained_path)
  except checkpoint.CheckpointError as e:
    raise ConfigError(str(e)) from None


def build_model(config: ml_collections.ConfigDict, num_classes: int):
  """The VisionTransformer of `config.model` with the config's dtype, scan and remat settings and
  the pretrained checkpoint's recorded overrides."""
  return models.get_model(config.model, num_classes=num_classes, **{
      **pretrained_overrides(config), 'dtype': jnp.dtype(config.dtype),
      'scan_layers': config.scan_layers, 'remat_policy': config.remat_policy})


def learning_rate_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0 to `base_lr` over `warmup_steps`, then cosine or linear to `min_lr`."""
  warmup = optax.linear_schedule(0.0, config.base_lr, config.warmup_steps)
  decay_steps = max(config.total_steps - config.warmup_steps, 1)
  if config.decay_type == 'cosine':
    decay = optax.cosine_decay_schedule(config.base_lr, decay_steps,
                                        alpha=config.min_lr / config.base_lr)
  else:
    decay = optax.linear_schedule(config.base_lr, config.min_lr, decay_steps)
  return optax.join_schedules([warmup, decay], [config.warmup_steps])


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """Global-norm clipping, then momentum SGD (bfloat16 accumulator) or AdamW on kernels."""
  schedule = learning_rate_schedule(config)
  if config.optimizer == 'sgd':
    update = optax.sgd(schedule, momentum=config.momentum, accumulator_dtype=jnp.bfloat16)
  else:
    decay_kernels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key == 'kernel', params)
    update = optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=config.weight_decay,
                         mask=decay_kernels)
  return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), update)


def cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0):
  """Per-example softmax cross-entropy: logits (B, C), int labels (B,) -> (B,)."""
  targets = jax.nn.one_hot(labels, logits.shape[-1])
  if label_smoothing:
    targets = optax.smooth_labels(targets, label_smoothing)
  return optax.softmax_cross_entropy(logits, targets)


def create_train_state(config, model, optimizer, mesh: Mesh, image_size: int,
                       params: Any = None) -> tuple[TrainState, TrainState]:
  """(state, its shardings), initialised on the devices; `params` replaces the fresh ones."""
  images = jnp.zeros((1, image_size, image_size, 3), jnp.float32)

  def init(rng):
    new_params = model.init(rng, images, train=False)['params'] if params is None else params
    return TrainState(step=jnp.zeros((), jnp.int32), params=new_params,
                      opt_state=optimizer.init(new_params), rng=jax.random.fold_in(rng, 1))

  rng = jax.random.PRNGKey(config.seed)
  shardings = sharding.state_shardings(
      jax.eval_shape(init, rng), sharding.param_axes(sharding.declared_params(model, image_size)),
      mesh, config.sharding, config.logical_axis_rules)
  return jax.jit(init, out_shardings=shardings)(rng), shardings


def init_params(config, model, image_size: int):
  """Freshly initialised params on the host (the same as the train state's at step 0)."""
  images = jnp.zeros((1, image_size, image_size, 3), jnp.float32)
  return jax.jit(lambda rng: model.init(rng, images, train=False)['params'])(
      jax.random.PRNGKey(config.seed))


# The step.


def microbatches(batch: Batch, accum_steps: int) -> Batch:
  """(B, ...) -> (accum_steps, B / accum_steps, ...); each micro-batch takes from every device."""
  return jax.tree.map(
      lambda x: x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1),
      batch)


def make_train_step(model, optimizer, config) -> Callable[[TrainState, Batch], tuple]:
  """update(state, batch) -> (state, metrics): forward, backward, optimiser; not yet jitted."""
  schedule = learning_rate_schedule(config)

  def loss_fn(params, images, labels, rng):
    logits = model.apply({'params': params}, images, train=True, rngs={'dropout': rng})
    return jnp.mean(cross_entropy(logits, labels, config.label_smoothing))

  def loss_and_grads(params, batch, rng):
    if config.accum_steps == 1:
      return jax.value_and_grad(loss_fn)(params, batch['image'], batch['label'], rng)

    def accumulate(carry, micro):
      index, micro_batch = micro
      loss, grads = jax.value_and_grad(loss_fn)(
          params, micro_batch['image'], micro_batch['label'], jax.random.fold_in(rng, index))
      return jax.tree.map(jnp.add, carry, (loss, grads)), None

    zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(
        accumulate, zeros, (jnp.arange(config.accum_steps), microbatches(batch, config.accum_steps)))
    return jax.tree.map(lambda x: x / config.accum_steps, (loss, grads))

  def train_step(state: TrainState, batch: Batch):
    rng = jax.random.fold_in(state.rng, state.step)
    loss, grads = loss_and_grads(state.params, batch, rng)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                              opt_state=opt_state)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # A non-finite step leaves params and optimiser state as they were (the loop then stops).
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
    metrics = {'train_loss': loss, 'grad_norm': grad_norm, 'learning_rate': schedule(state.step),
               'finite': finite}
    return new_state, metrics

  return train_step


def jit_train_step(model, optimizer, config, mesh: Mesh, shardings):
  """`make_train_step` jitted over `mesh`: the state laid out as `shardings` and donated (it is
  updated in place), the batch split along 'data', the metrics replicated, the activations
  constrained by `config.logical_axis_rules` and sharding.LOGICAL_AXIS_RULES."""
  step = sharding.with_rules(make_train_step(model, optimizer, config), mesh,
                             config.logical_axis_rules)
  return jax.jit(step,
                 in_shardings=(shardings, NamedSharding(mesh, P('data'))),
                 out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)


def make_eval_step(model) -> Callable[[Any, Batch], dict]:
  """eval(params, batch) -> sums over the unmasked examples: correct, loss, count."""

  def eval_step(params, batch):
    logits = model.apply({'params': params}, batch['image'], train=False)
    mask = batch['mask'].astype(jnp.float32)
    correct = (jnp.argmax(logits, -1) == batch['label']).astype(jnp.float32)
    return {'correct': jnp.sum(correct * mask),
            'loss': jnp.sum(cross_entropy(logits, batch['label']) * mask),
            'count': jnp.sum(mask)}

  return eval_step


def evaluate(eval_step, params, config, mesh: Mesh) -> dict[str, float]:
  """Top-1 accuracy and mean loss over the whole test split."""
  totals = {'correct': 0.0, 'loss': 0.0, 'count': 0.0}
  for batch in input_pipeline.get_eval_iterator(config, mesh):
    sums = eval_step(params, batch)
    totals = {k: totals[k] + v for k, v in sums.items()}
  totals = jax.device_get(totals)
  return {'test_accuracy': float(totals['correct'] / totals['count']),
          'test_loss': float(totals['loss'] / totals['count'])}


# Checkpoints.


def checkpoint_manager(workdir: str, config) -> ocp.CheckpointManager:
  """Orbax manager of `WORKDIR/checkpoints`; a save becomes visible only once complete."""
  return ocp.CheckpointManager(
      os.path.join(os.path.abspath(workdir), 'checkpoints'),
      options=ocp.CheckpointManagerOptions(
          max_to_keep=config.keep_checkpoints, create=True,
          cleanup_tmp_directories=True))  # Half-written saves of a killed run are dropped.


def save_checkpoint(manager: ocp.CheckpointManager, state: TrainState, data_state: dict):
  manager.save(int(jax.device_get(state.step)), args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))


def restore_checkpoint(manager: ocp.CheckpointManager, state: TrainState,
                       shardings: TrainState) -> tuple[TrainState, dict]:
  """The latest checkpoint's (state, data-iterator state), placed with `shardings`."""
  abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          state, shardings)
  restored = manager.restore(manager.latest_step(), args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
  return restored.state, restored.data


# The loop.


def flatten_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{'pp.crop': 224, ...} with TensorBoard-friendly values, for hparams."""
  flat = {}

  def visit(prefix, value):
    if isinstance(value, dict):
      for key, sub in value.items():
        visit(f'{prefix}{key}.', sub)
    else:
      flat[prefix[:-1]] = value if isinstance(value, (int, float, str, bool)) else str(value)

  visit('', config.to_dict())
  return flat


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2))


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains (or fine-tunes, with `config.pretrained_path`) and evaluates; returns last metrics.

  A workdir holding a checkpoint resumes from its latest one.
  """
  validate_config(config, jax.device_count())
  try:
    info = input_pipeline.get_dataset_info(config)
  except (ValueError, FileNotFoundError) as e:  # An unknown dataset, a bad split or folder.
    raise ConfigError(str(e)) from None
  mesh = make_mesh(config)
  logging.info('Mesh: %s over %d %s devices.', dict(mesh.shape), mesh.size,
               mesh.devices.flat[0].platform)
  model = build_model(config, info.num_classes)
  optimizer = make_optimizer(config)
  is_main = jax.process_index() == 0
  os.makedirs(workdir, exist_ok=True)
  if is_main:
    write_config(config, workdir)

  params = None
  if config.pretrained_path:
    params = load_pretrained_params(config, model)
  state, shardings = create_train_state(config, model, optimizer, mesh, config.pp.crop, params)
  manager = checkpoint_manager(workdir, config)
  if manager.latest_step() is not None:
    state, data_state = restore_checkpoint(manager, state, shardings)
    train_iter = input_pipeline.restore_train_iterator(config, mesh, data_state)
    logging.info('Resuming from step %d of %s.', int(state.step), manager.directory)
  else:
    train_iter = input_pipeline.get_train_iterator(config, mesh)

  train_step = jit_train_step(model, optimizer, config, mesh, shardings)
  eval_step = jax.jit(make_eval_step(model))

  writer = metric_writers.create_default_writer(workdir, just_logging=not is_main)
  if int(state.step) == 0:
    writer.write_hparams(flatten_config(config))
  flops_per_image = 3 * models.gflops_per_image(model, config.pp.crop) * 1e9
  peak_flops, peak_kind = hardware.local_peak_flops(jnp.dtype(config.dtype))
  peak_flops *= jax.process_count()
  logging.info('%s: %.3f GFLOPs per training image; peak %.1f TFLOP/s (%s).',
               config.model_name, flops_per_image / 1e9, peak_flops / 1e12, peak_kind)

  preemption = PreemptionWatcher()
  try:
    state, last_metrics = run_steps(config, state, train_step, eval_step, train_iter, mesh,
                                    writer, manager, preemption, flops_per_image / peak_flops)
  finally:
    preemption.close()
    manager.wait_until_finished()
    writer.flush()
  if 'preempted_at_step' not in last_metrics:
    # Every process joins the gather (params may be split across hosts); process 0 writes.
    params = multihost_utils.process_allgather(state.params, tiled=True)
    if is_main:
      export_path = os.path.join(workdir, 'model.npz')
      checkpoint.save(params, export_path)
      if overrides := pretrained_overrides(config):
        checkpoint.save_model_overrides(overrides, export_path,
                                        note=f'Fine-tuned from {config.pretrained_path}.')
      logging.info('Wrote the final params to %s.', export_path)
  return last_metrics


def run_steps(config, state, train_step, eval_step, train_iter, mesh, writer, manager,
              preemption, flops_per_image_over_peak):
  """The step loop, from `state.step` to `config.total_steps` or a preemption.

  Returns the last state and the last metrics; these hold 'preempted_at_step' after a SIGTERM.
  """
  first_step = int(state.step)
  last_metrics = {}
  timer_start, timer_step = time.perf_counter(), first_step
  previous = None
  for step in range(first_step + 1, config.total_steps + 1):
    state, metrics = train_step(state, next(train_iter))
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
      logging.info('step %d/%d: loss %.4f%s', step, config.total_steps, logged['train_loss'],
                   speed)
      last_metrics.update(logged)
      timer_start, timer_step = time.perf_counter(), step
    if step % config.eval_every == 0 or step == config.total_steps:
      eval_start = time.perf_counter()
      eval_metrics = evaluate(eval_step, state.params, config, mesh)
      writer.write_scalars(step, eval_metrics)
      logging.info('step %d: test accuracy %.4f, test loss %.4f', step,
                   eval_metrics['test_accuracy'], eval_metrics['test_loss'])
      last_metrics.update(eval_metrics)
      timer_start += time.perf_counter() - eval_start  # Leave evaluation out of the throughput.
    preempted = preemption.reached(step)
    if preempted or step % config.checkpoint_every == 0 or step == config.total_steps:
      check_finite(step, metrics)
      save_checkpoint(manager, state, train_iter.get_state())
    if preempted:
      logging.warning('Preempted at step %d (SIGTERM): wrote a checkpoint; run the same command '
                      'again to resume.', step)
      return state, {**last_metrics, 'preempted_at_step': step}
  return state, last_metrics


def check_finite(step: int, metrics: dict) -> None:
  """Raises NonFiniteError, naming the step, if that step's loss or gradient was not finite."""
  if not bool(metrics['finite']):
    loss, grad_norm = float(metrics['train_loss']), float(metrics['grad_norm'])
    raise NonFiniteError(
        f'Non-finite loss or gradient at step {step} (loss {loss}, gradient norm {grad_norm}); '
        'stopped without checkpointing that state. Lower config.base_lr, lengthen '
        'config.warmup_steps or check the data, then resume from the last checkpoint.')


class PreemptionWatcher:
  """Notices SIGTERM, the way TPU VMs and cluster schedulers announce a preemption.

  With one process a SIGTERM handler sets a flag; with several, JAX's distributed runtime
  (which listens for SIGTERM) makes every process agree on the same step to stop at.
  """

  def __init__(self):
    self.signalled = False
    self._previous = None
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

  def _on_sigterm(self, signum, frame):
    del signum, frame
    self.signalled = True

  def reached(self, step: int) -> bool:
    if jax.process_count() > 1:
      return multihost_utils.reached_preemption_sync_point(step)
    return self.signalled

  def close(self):
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)


def load_pretrained_params(config, model):
  """Pretrained params from `config.pretrained_path`, fitted to `model` at `config.pp.crop`."""
  fresh = init_params(config, model, config.pp.crop)
  try:
    return checkpoint.load_pretrained(config.pretrained_path, jax.device_get(fresh),
                                      config.model, posemb_method=config.posemb_method,
                                      keep_head=config.pretrained_keep_head)
  except (ValueError, KeyError) as e:
    raise ConfigError(f'config.pretrained_path={config.pretrained_path!r} does not fit '
                      f'{config.model_name}: {e}') from None


def _format_seconds(seconds: float) -> str:
  seconds = int(round(seconds))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'

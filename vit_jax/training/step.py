"""The update step of training: train state, optimiser, loss, and the sharded `jax.jit` step.

Imports neither TensorFlow nor clu, so that benchmarks (vit_jax.inference_time --train,
benchmarks/gpu.py) run where only jax, flax, optax and ml_collections are installed;
vit_jax.training.trainer builds the training loop around it.
"""
from typing import Any, Callable, NamedTuple

import flax
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import ml_collections
import optax

from vit_jax.training import param_groups
from vit_jax import sharding
from vit_jax import tasks
from vit_jax.models import blank
from vit_jax.tasks.task import Batch
_MIXUP = 2**31 - 1  # Folded into a step's key for its mixup key (micro-batches fold in 0, 1, ...).


@flax.struct.dataclass
class TrainState:
  """Everything a resumed run needs besides the data order: step, params, optimiser, rng."""
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array  # A raw uint32 PRNG key; dropout keys are folded in from it per step.
  # The exponential moving average of params (config.ema_decay), laid out as they are; None: off.
  ema: Any = None


class Optimizer(NamedTuple):
  """An optax GradientTransformation (`init`, `update`) and the learning-rate schedule it
  follows (logged by the step)."""
  init: optax.TransformInitFn
  update: optax.TransformUpdateFn
  schedule: optax.Schedule


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


def make_optimizer(config: ml_collections.ConfigDict) -> Optimizer:
  """Global-norm clipping, then momentum SGD (bfloat16 accumulator) or AdamW on kernels, on
  the schedule of `learning_rate_schedule`; with config.lr_mults, layer_decay or frozen, the
  updates scaled per parameter and the frozen ones split off (param_groups.transform)."""
  schedule = learning_rate_schedule(config)
  if config.optimizer == 'sgd':
    update = optax.sgd(schedule, momentum=config.momentum, accumulator_dtype=jnp.bfloat16)
  else:
    decay_kernels = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: path[-1].key == 'kernel', params)
    update = optax.adamw(schedule, b1=0.9, b2=0.999, weight_decay=config.weight_decay,
                         mask=decay_kernels)
  chain = param_groups.transform(
      optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), update), config)
  return Optimizer(chain.init, chain.update, schedule)


def mixup(rng: jax.Array, batch: Batch, alpha: float, num_classes: int) -> Batch:
  """Mixup (Zhang et al., 2018) of a whole batch with itself rolled by one example, by one ratio
  drawn from Beta(alpha, alpha) and folded to at least 1/2 (as big_vision does).

  Args:
    rng: PRNG key of this step's mixup.
    batch: {'image': (B, H, W, C), 'label': int (B,) or multi-hot (B, num_classes)}.
    alpha: Beta parameter, > 0.
    num_classes: length of the soft targets.
  Returns:
    {'image': (B, H, W, C), 'label': float32 (B, num_classes) soft targets}: example i is
    ratio * example i + (1 - ratio) * example i - 1 (mod B), in its image and its label.
  """
  ratio = jax.random.beta(rng, alpha, alpha)
  ratio = jnp.maximum(ratio, 1 - ratio)
  mix = lambda x: ratio * x + (1 - ratio) * jnp.roll(x, 1, axis=0)
  return {'image': mix(batch['image']),
          'label': mix(tasks.supervised.targets_of(batch['label'], num_classes))}


def ema_update(ema: Any, params: Any, decay: float) -> Any:
  """One step of the exponential moving average of the weights: decay * ema + (1 - decay) *
  params, leaf by leaf."""
  return jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, params)


def train_state_init(config, model, optimizer: Optimizer, image_size: int) -> Callable:
  """init(rng, params) -> the TrainState at step 0; `params` None makes fresh ones. With a
  `config.ema_decay` the EMA starts as a copy of the initial params."""
  def init(rng, params):
    if params is None:
      params = blank.init_params(model, rng, image_size)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params), rng=jax.random.fold_in(rng, 1),
                      ema=jax.tree.map(jnp.copy, params) if config.ema_decay else None)

  return init


def abstract_train_state(config, model, optimizer: Optimizer, mesh: Mesh, image_size: int,
                         params: Any = None) -> tuple[TrainState, TrainState]:
  """(state as ShapeDtypeStructs that carry their shardings, the shardings), as
  `create_train_state` lays the state out on `mesh`, without making it."""
  declared = sharding.declared_params(model, image_size)
  if params is None:  # The model's shapes, traced once: only the optimiser's state is left.
    params = flax.linen.meta.unbox(declared)
  init = train_state_init(config, model, optimizer, image_size)
  shapes = jax.eval_shape(init, jax.random.PRNGKey(config.seed), params)
  shardings = sharding.state_shardings(shapes, sharding.param_axes(declared), mesh,
                                       config.sharding, config.logical_axis_rules)
  return jax.tree.map(lambda leaf, place: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                               sharding=place),
                      shapes, shardings), shardings


def create_train_state(config, model, optimizer: Optimizer, mesh: Mesh, image_size: int,
                       params: Any = None) -> tuple[TrainState, TrainState]:
  """(state, its shardings), initialised on the devices; `params` replaces the fresh ones (they
  enter the jitted init as arguments, not as constants compiled into it). With a
  `config.ema_decay` the EMA starts as a copy of the initial params."""
  _, shardings = abstract_train_state(config, model, optimizer, mesh, image_size, params)
  return initial_train_state(config, model, optimizer, shardings, image_size, params), shardings


def initial_train_state(config, model, optimizer: Optimizer, shardings: TrainState,
                        image_size: int, params: Any = None) -> TrainState:
  """The state at step 0 made on the devices with `shardings` (`abstract_train_state`'s): the
  one program that compiles its init, which a resumed run never needs."""
  init = train_state_init(config, model, optimizer, image_size)
  return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(config.seed), params)


def abstract_batch(config, mesh: Mesh, evaluation: bool = False, multi_hot: int = 0) -> Batch:
  """The batches of the input pipeline as ShapeDtypeStructs split along 'data' over `mesh`:
  {'image': float32 (B, H, W, 3), 'label': int32 (B,)}, B = config.batch, (H, W) the sides of
  config.pp.crop; with `multi_hot` C > 0 (multi-label data of C classes) 'label' float32 (B, C),
  and where the objective labels each pixel 'label' int32 (B, H, W); for `evaluation`, B =
  config.batch_eval and with 'mask': float32 (B,)."""
  size, (h, w) = (config.batch_eval if evaluation else config.batch), blank.image_hw(config.pp.crop)
  split = NamedSharding(mesh, P('data'))
  if multi_hot:
    label = jax.ShapeDtypeStruct((size, multi_hot), jnp.float32, sharding=split)
  else:
    per_pixel = tasks.for_config(config).per_pixel_labels
    label = jax.ShapeDtypeStruct((size, h, w) if per_pixel else (size,), jnp.int32, sharding=split)
  batch = {'image': jax.ShapeDtypeStruct((size, h, w, 3), jnp.float32, sharding=split),
           'label': label}
  if evaluation:
    batch['mask'] = jax.ShapeDtypeStruct((size,), jnp.float32, sharding=split)
  return batch


def microbatches(batch: Batch, accum_steps: int) -> Batch:
  """(B, ...) -> (accum_steps, B / accum_steps, ...); each micro-batch takes from every device."""
  return jax.tree.map(
      lambda x: x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]).swapaxes(0, 1),
      batch)


def make_train_step(model, optimizer: Optimizer, config) -> Callable[[TrainState, Batch], tuple]:
  """update(state, batch) -> (state, metrics): forward, backward, optimiser, and the EMA of the
  params (`ema_update` with config.ema_decay) where the state holds one; not yet jitted.
  The loss is that of config.objective's task (vit_jax.tasks)."""
  task_loss = tasks.for_config(config).train_loss(model, config)

  def loss_fn(params, batch, rng):
    # The frozen parameters stopped inside the differentiated function, so that backpropagation
    # leaves out what only they need (for a linear probe, the whole backbone).
    return task_loss(param_groups.stop_frozen_gradients(params, config), batch, rng)

  def loss_and_grads(params, batch, rng):
    if config.accum_steps == 1:
      return jax.value_and_grad(loss_fn, has_aux=True)(params, batch, rng)

    def accumulate(carry, micro):
      index, micro_batch = micro
      result = jax.value_and_grad(loss_fn, has_aux=True)(
          params, micro_batch, jax.random.fold_in(rng, index))
      return jax.tree.map(jnp.add, carry, result), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(
        jax.value_and_grad(loss_fn, has_aux=True), params, batch, rng))
    micro = (jnp.arange(config.accum_steps), microbatches(batch, config.accum_steps))
    totals, _ = jax.lax.scan(accumulate, zeros, micro)
    return jax.tree.map(lambda x: x / config.accum_steps, totals)

  def train_step(state: TrainState, batch: Batch):
    rng = jax.random.fold_in(state.rng, state.step)
    if config.mixup.p:  # A key no micro-batch's dropout takes.
      batch = mixup(jax.random.fold_in(rng, _MIXUP), batch, config.mixup.p, model.num_classes)
    (loss, objective_metrics), grads = loss_and_grads(state.params, batch, rng)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(step=state.step + 1, opt_state=opt_state, params=params)
    if state.ema is not None:
      new_state = new_state.replace(ema=ema_update(state.ema, params, config.ema_decay))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # A non-finite step leaves params and optimiser state as they were (the loop then stops).
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
    metrics = {'train_loss': loss, 'grad_norm': grad_norm,
               'learning_rate': optimizer.schedule(state.step), 'finite': finite,
               **{f'train_{name}': value for name, value in objective_metrics.items()}}
    return new_state, metrics

  return train_step


def jit_train_step(model, optimizer: Optimizer, config, mesh: Mesh, shardings):
  """`make_train_step` jitted over `mesh`: the state laid out as `shardings` and donated (it is
  updated in place), the batch split along 'data', the metrics replicated, the activations
  constrained by `config.logical_axis_rules` and sharding.LOGICAL_AXIS_RULES."""
  step = sharding.with_rules(make_train_step(model, optimizer, config), mesh,
                             config.logical_axis_rules)
  return jax.jit(step,
                 in_shardings=(shardings, NamedSharding(mesh, P('data'))),
                 out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)

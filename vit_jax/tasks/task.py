"""What a task is: the interface every objective of `config.objective` offers (vit_jax.tasks
lists them). Imports nothing of vit_jax, so that each task module can import it."""
import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import ml_collections

# 'image' (B, H, W, 3) in [-1, 1], 'label' (B,), multi-hot (B, C) or per pixel (B, H, W); for
# eval 'mask' (B,).
Batch = dict[str, jax.Array]
# loss_fn(params, batch, rng) -> (the mean loss of the batch, {metric name: batch mean}).
LossFn = Callable[[Any, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]
# eval_step(params, batch) -> {metric name: sum over the batch's unmasked examples, 'count'};
# the supervised step of multi-label data adds per-example arrays (supervised.EXAMPLES).
EvalStep = Callable[[Any, Batch], dict[str, jax.Array]]


@dataclasses.dataclass(frozen=True)
class Task:
  """An objective: how it wraps the model, trains and evaluates it, and what it adds.

  Attributes:
    model: (VisionTransformer, config) -> the module to train, the ViT itself or a subclass
      that adds the task's parameters.
    train_loss: (that module, config) -> its LossFn, not yet jitted.
    eval_step: (that module, config) -> its EvalStep, not yet jitted.
    evaluator: the type (vit_jax.evaluators.TYPES) of the entries of config.evals that leave
      their type None.
    needs_labels: whether the loss reads the batch's labels (then 2 classes or more).
    extra_param_prefixes: the first names of the parameters the task adds to the published
      layout; fine-tuning a supervised model from its checkpoint drops them.
    config_error: config -> why the task's fields cannot work, or None; one line.
    per_pixel_labels: whether the batches label each pixel, (B, H, W), not each image, (B,).
    config_section: the config field (a ConfigDict) that `model` reads, saved with the model
      spec of model.npz so that the module can be rebuilt from the file alone; None: none.
  """
  model: Callable[[nn.Module, ml_collections.ConfigDict], nn.Module]
  train_loss: Callable[[nn.Module, ml_collections.ConfigDict], LossFn]
  eval_step: Callable[[nn.Module, ml_collections.ConfigDict], EvalStep]
  evaluator: str
  needs_labels: bool
  extra_param_prefixes: tuple[str, ...]
  config_error: Callable[[ml_collections.ConfigDict], str | None]
  per_pixel_labels: bool = False
  config_section: str | None = None

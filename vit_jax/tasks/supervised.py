"""Supervised classification, `config.objective = 'supervised'`: the softmax cross-entropy of
the head's logits against the labels, and top-1 (and top-5) accuracy in evaluation."""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from vit_jax.tasks import task

TOP_K = 5  # Top-5 accuracy is reported for models of more classes than this only.


def cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0):
  """Per-example softmax cross-entropy: logits (B, C) and int labels (B,) or soft targets (B, C)
  (each row a distribution over the classes, e.g. from mixup) -> (B,)."""
  targets = labels if labels.ndim == 2 else jax.nn.one_hot(labels, logits.shape[-1])
  if label_smoothing:
    targets = optax.smooth_labels(targets, label_smoothing)
  return optax.softmax_cross_entropy(logits, targets)


def train_loss(model: nn.Module, config: ml_collections.ConfigDict) -> task.LossFn:
  """loss_fn(params, batch, rng) -> (the batch's mean cross-entropy, smoothed by
  config.label_smoothing, {}), dropout drawn from `rng`."""

  def loss_fn(params: Any, batch: task.Batch, rng: jax.Array):
    logits = model.apply({'params': params}, batch['image'], train=True, rngs={'dropout': rng})
    return jnp.mean(cross_entropy(logits, batch['label'], config.label_smoothing)), {}

  return loss_fn


def make_eval_step(model: nn.Module) -> task.EvalStep:
  """eval(params, batch) -> sums over the unmasked examples: correct (top-1), loss, count, and
  with more than TOP_K classes correct_top5 (label among the TOP_K highest logits; with fewer
  classes it would count every example)."""

  def eval_step(params: Any, batch: task.Batch):
    logits = model.apply({'params': params}, batch['image'], train=False)
    mask = batch['mask'].astype(jnp.float32)
    labels = batch['label']
    sums = {'correct': jnp.sum((jnp.argmax(logits, -1) == labels) * mask),
            'loss': jnp.sum(cross_entropy(logits, labels) * mask),
            'count': jnp.sum(mask)}
    if logits.shape[-1] > TOP_K:
      _, top = jax.lax.top_k(logits, TOP_K)
      sums['correct_top5'] = jnp.sum(jnp.any(top == labels[:, None], axis=-1) * mask)
    return sums

  return eval_step


TASK = task.Task(model=lambda model, config: model, train_loss=train_loss,
                 eval_step=lambda model, config: make_eval_step(model),
                 evaluator='classification', needs_labels=True, extra_param_prefixes=(),
                 config_error=lambda config: None)

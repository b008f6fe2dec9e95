"""Supervised classification, `config.objective = 'supervised'`: a cross-entropy of the head's
logits against the labels (`config.loss`: the softmax one, or the sigmoid one of BiT and
big_vision), and in evaluation top-1 (and top-5) accuracy of single-label data, or mean
average precision and precision at 1 of multi-label data.

Labels are int class indices (B,), or multi-hot rows (B, C) of multi-label data (an image
folder with a labels.csv, a tfds dataset whose label is a sequence of classes).
"""
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from vit_jax.tasks import task

TOP_K = 5  # Top-5 accuracy is reported for models of more classes than this only.
# What the eval step of multi-label data returns beside its sums: per-example arrays (B, ...)
# {'scores': logits (B, C), 'labels': multi-hot (B, C), 'mask': (B,)}, for the mean average
# precision that the evaluator computes once it holds every example (`mean_average_precision`).
EXAMPLES = 'examples'


def targets_of(labels: jax.Array, num_classes: int) -> jax.Array:
  """float32 (B, C) targets: the one-hot rows of int labels (B,), or rows (B, C) as they are
  (multi-hot labels, or soft targets of mixup)."""
  if labels.ndim == 2:
    return labels.astype(jnp.float32)
  return jax.nn.one_hot(labels, num_classes)


def softmax_xent(logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.0):
  """Per-example softmax cross-entropy (B,) of logits (B, C) against targets (B, C), each row
  first normalised to sum 1: the k labels of a multi-hot row share the target (1/k each, as
  big_vision trains softmax on multi-label data), a row of no label gives no loss; then
  smoothed towards uniform by `label_smoothing`."""
  targets = targets / jnp.maximum(jnp.sum(targets, axis=-1, keepdims=True), 1e-12)
  if label_smoothing:
    targets = optax.smooth_labels(targets, label_smoothing)
  return optax.softmax_cross_entropy(logits, targets)


def sigmoid_xent(logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.0):
  """Per-example sigmoid cross-entropy (B,): each class an independent yes/no, the binary
  cross-entropies of logits (B, C) against targets (B, C) in [0, 1] summed over the classes
  (as big_vision's sigmoid_xent); targets smoothed by `label_smoothing` towards 1/C."""
  if label_smoothing:
    targets = optax.smooth_labels(targets, label_smoothing)
  return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, targets), axis=-1)


LOSSES = {'softmax_xent': softmax_xent, 'sigmoid_xent': sigmoid_xent}  # config.loss's values.
# config.loss's default, and the loss of a model.npz that records none (published files, older
# runs).
DEFAULT_LOSS = 'softmax_xent'


def cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float = 0.0,
                  loss: str = DEFAULT_LOSS):
  """Per-example cross-entropy (B,) of `loss` (a LOSSES name): logits (B, C) against int labels
  (B,), or rows (B, C) of multi-hot labels or soft targets (e.g. from mixup)."""
  return LOSSES[loss](logits, targets_of(labels, logits.shape[-1]), label_smoothing)


def head_bias_init(loss: str, num_classes: int) -> float:
  """The initial bias of the head's logits: -log(C) under the sigmoid loss, as BiT and
  big_vision start it, so that each class starts at odds of 1 : C, a probability of 1/(C + 1),
  near the share of images a class holds (not 1/2, which would spend the first steps pushing
  the C - 1 negatives of each image down); 0 under softmax."""
  return -math.log(num_classes) if loss == 'sigmoid_xent' else 0.0


def with_head(model: nn.Module, config: ml_collections.ConfigDict) -> nn.Module:
  """The ViT with the head bias init of config.loss (`head_bias_init`); a new head of a
  fine-tune gets it too."""
  return model.clone(head_bias_init=head_bias_init(config.loss, model.num_classes))


def train_loss(model: nn.Module, config: ml_collections.ConfigDict) -> task.LossFn:
  """loss_fn(params, batch, rng) -> (the batch's mean config.loss, smoothed by
  config.label_smoothing, {}), dropout drawn from `rng`."""

  def loss_fn(params: Any, batch: task.Batch, rng: jax.Array):
    logits = model.apply({'params': params}, batch['image'], train=True, rngs={'dropout': rng})
    return jnp.mean(cross_entropy(logits, batch['label'], config.label_smoothing,
                                  config.loss)), {}

  return loss_fn


def make_eval_step(model: nn.Module, loss: str = DEFAULT_LOSS) -> task.EvalStep:
  """eval(params, batch) -> sums over the unmasked examples of the loss `loss` and count, and:
  for int labels (B,), correct (top-1) and, with more than TOP_K classes, correct_top5 (label
  among the TOP_K highest logits; with fewer classes it would count every example); for
  multi-hot labels (B, C), precision_at_1 (the highest logit is one of the image's labels) and
  the per-example arrays of EXAMPLES."""

  def eval_step(params: Any, batch: task.Batch):
    logits = model.apply({'params': params}, batch['image'], train=False)
    mask = batch['mask'].astype(jnp.float32)
    labels = batch['label']
    sums = {'loss': jnp.sum(cross_entropy(logits, labels, loss=loss) * mask),
            'count': jnp.sum(mask)}
    top1 = jnp.argmax(logits, -1)
    if labels.ndim == 2:
      sums['precision_at_1'] = jnp.sum(jnp.take_along_axis(labels, top1[:, None], 1)[:, 0] * mask)
      sums[EXAMPLES] = {'scores': logits, 'labels': labels, 'mask': mask}
      return sums
    sums['correct'] = jnp.sum((top1 == labels) * mask)
    if logits.shape[-1] > TOP_K:
      _, top = jax.lax.top_k(logits, TOP_K)
      sums['correct_top5'] = jnp.sum(jnp.any(top == labels[:, None], axis=-1) * mask)
    return sums

  return eval_step


CLASS_CHUNK = 256  # Classes ranked at once: bounds the memory of `average_precisions`.


def average_precisions(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """float64 (C,): the average precision of each class, ranking the N examples by scores (N, C)
  against multi-hot labels (N, C): the mean, over the class's positives, of the precision among
  the examples scored at least as high (examples of equal score share one threshold, as
  scikit-learn's average_precision_score ranks them); NaN for a class without positives.
  Ranks CLASS_CHUNK classes at a time (about 40 bytes per example and class of a chunk)."""
  return np.concatenate([np.zeros(0)] + [
      _average_precisions(scores[:, i:i + CLASS_CHUNK], labels[:, i:i + CLASS_CHUNK])
      for i in range(0, scores.shape[1], CLASS_CHUNK)])


def _average_precisions(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
  """`average_precisions` of all the classes of scores and labels (N, C) at once."""
  order = np.argsort(-scores, axis=0, kind='stable')
  ranked = np.take_along_axis(scores, order, 0)
  hits = np.take_along_axis(labels > 0, order, 0)
  n = len(scores)
  precision = np.cumsum(hits, axis=0) / np.arange(1, n + 1)[:, None]
  # Each position takes the precision at the last position of its run of equal scores.
  is_last = np.ones_like(hits)
  is_last[:-1] = ranked[1:] != ranked[:-1]
  last = np.where(is_last, np.arange(n)[:, None], n)
  last = np.minimum.accumulate(last[::-1], axis=0)[::-1]
  precision = np.take_along_axis(precision, last, 0)
  with np.errstate(invalid='ignore', divide='ignore'):
    return np.sum(precision * hits, axis=0) / hits.sum(0)


def mean_average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
  """The mean of `average_precisions` over the classes with a positive among the examples."""
  return float(np.nanmean(average_precisions(scores, labels)))


TASK = task.Task(model=with_head, train_loss=train_loss,
                 eval_step=lambda model, config: make_eval_step(model, config.loss),
                 evaluator='classification', needs_labels=True, extra_param_prefixes=(),
                 config_error=lambda config: None)

"""Tests of Mixup and the soft-target loss: planted labels and images, a reference cross-entropy
computed with numpy, and a jitted training step on mixed batches."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax.config import checks
from vit_jax.config import defaults
from vit_jax.tasks import supervised
from vit_jax.training import step as ts
import tiny_config

LABELS = np.array([0, 3, 3, 1, 2])
IMAGES = np.arange(5 * 2 * 2 * 3, dtype=np.float32).reshape(5, 2, 2, 3) / 60 - 1


MIXUP = jax.jit(ts.mixup, static_argnums=(2, 3))  # Compiled once for all the keys.


def mixed(seed, alpha=0.4):
  return jax.device_get(MIXUP(jax.random.PRNGKey(seed), {'image': IMAGES, 'label': LABELS},
                              alpha, 4))


def test_mixup_labels_sum_to_1_and_images_mix_by_the_same_ratio():
  for seed in range(5):
    batch = mixed(seed)
    np.testing.assert_allclose(batch['label'].sum(-1), 1, rtol=1e-6)
    ratio = batch['label'][0, 0]  # Example 0 (class 0) takes the rest from example 4 (class 2).
    assert 0.5 <= ratio <= 1 and np.isclose(batch['label'][0, 2], 1 - ratio)
    for i, previous in enumerate([4, 0, 1, 2, 3]):
      expected = np.zeros(4)
      expected[LABELS[i]] += ratio
      expected[LABELS[previous]] += 1 - ratio
      np.testing.assert_allclose(batch['label'][i], expected, atol=1e-6)
      np.testing.assert_allclose(batch['image'][i],
                                 ratio * IMAGES[i] + (1 - ratio) * IMAGES[previous], atol=1e-6)


def test_mixup_ratio_follows_the_key():
  ratios = [mixed(seed)['label'][0, 0] for seed in range(8)]
  assert mixed(0)['label'][0, 0] == ratios[0]
  assert len(set(ratios)) == 8


def reference_cross_entropy(logits, targets, smoothing=0.0):
  """-sum(t * log softmax(logits)) with numpy, targets smoothed towards uniform."""
  targets = (1 - smoothing) * targets + smoothing / targets.shape[-1]
  logits = logits.astype(np.float64)
  log_softmax = logits - logits.max(-1, keepdims=True)
  log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
  return -(targets * log_softmax).sum(-1)


@pytest.mark.parametrize('smoothing', [0.0, 0.1])
def test_soft_targets_give_the_loss_of_hard_labels_and_of_the_formula(smoothing):
  logits = np.random.RandomState(0).normal(size=(5, 4)).astype(np.float32) * 3
  one_hot = np.eye(4, dtype=np.float32)[LABELS]
  hard = supervised.cross_entropy(jnp.asarray(logits), jnp.asarray(LABELS), smoothing)
  soft = supervised.cross_entropy(jnp.asarray(logits), jnp.asarray(one_hot), smoothing)
  np.testing.assert_allclose(soft, hard, rtol=1e-6)
  np.testing.assert_allclose(soft, reference_cross_entropy(logits, one_hot, smoothing), rtol=1e-5)
  targets = mixed(1)['label']
  np.testing.assert_allclose(supervised.cross_entropy(jnp.asarray(logits), targets, smoothing),
                             reference_cross_entropy(logits, targets, smoothing), rtol=1e-5)


class LinearClassifier(nn.Module):
  """The smallest model the step trains (it compiles in moments): logits of the flat pixels."""
  num_classes: int

  @nn.compact
  def __call__(self, images, train):
    del train
    return nn.Dense(self.num_classes)(images.reshape(images.shape[0], -1))


def test_step_with_mixup_trains_on_mixed_targets_and_differs_from_without():
  config = tiny_config.get_config()
  config.label_smoothing = 0.1
  model = LinearClassifier(num_classes=4)
  optimizer = ts.make_optimizer(config)
  params = model.init(jax.random.PRNGKey(0), IMAGES, train=False)['params']
  state = ts.TrainState(step=jnp.zeros((), jnp.int32), params=params,
                        opt_state=optimizer.init(params), rng=jax.random.PRNGKey(1))
  batch = {'image': jnp.asarray(IMAGES), 'label': jnp.asarray(LABELS)}
  losses = {}
  for p in (0.0, 0.5):
    config.mixup.p = p
    _, metrics = jax.jit(ts.make_train_step(model, optimizer, config))(state, batch)
    losses[p] = float(metrics['train_loss'])
    assert metrics['finite']
  assert losses[0.0] != losses[0.5]


@pytest.mark.parametrize('p', [-0.1, float('nan')])
def test_negative_mixup_is_a_one_line_config_error(p):
  config = defaults.get_config()
  config.mixup.p = p
  assert checks.values_error(config).startswith('config.mixup.p=')

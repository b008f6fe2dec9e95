"""Tests of the update step, vit_jax/training/step.py, on a tiny model and random images."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import pytest

from vit_jax.config import defaults
from vit_jax.models import registry
from vit_jax.training import step as train_step

pytestmark = pytest.mark.xdist_group('train_step')  # Its module fixtures are built once.


@pytest.fixture(scope='module')
def setup():
  """(config, model, optimizer, mesh, batch) of the 'testing' model at 16 px on one device."""
  config = defaults.with_model(defaults.training_defaults(), 'testing')
  config.update(dict(batch=4, optimizer='adamw', base_lr=0.1, warmup_steps=4, total_steps=10))
  model = registry.get_model('testing', num_classes=10)
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  batch = {'image': jax.random.uniform(jax.random.key(0), (4, 16, 16, 3), minval=-1, maxval=1),
           'label': jnp.arange(4)}
  return config, model, train_step.make_optimizer(config), mesh, batch


def test_logged_learning_rate_follows_the_warmup(setup):
  config, model, optimizer, mesh, batch = setup
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh, 16)
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  rates = []
  for _ in range(3):
    state, metrics = step(state, batch)
    assert bool(metrics['finite'])
    rates.append(float(metrics['learning_rate']))
  np.testing.assert_allclose(rates, [0.0, 0.025, 0.05], rtol=1e-6)  # 0.1 * step / 4.
  assert int(state.step) == 3


def test_given_params_start_the_state(setup):
  config, model, optimizer, mesh, _ = setup
  params = jax.tree.map(lambda x: np.full(x.shape, 0.5, x.dtype), registry.param_shapes(model, 16))
  state, _ = train_step.create_train_state(config, model, optimizer, mesh, 16, params)
  jax.tree.map(lambda x: np.testing.assert_array_equal(x, 0.5), state.params)
  fresh, _ = train_step.create_train_state(config, model, optimizer, mesh, 16)
  assert not np.allclose(fresh.params['embedding']['kernel'], 0.5)


def test_the_step_the_benchmarks_and_config_validation_import_neither_tensorflow_nor_clu():
  # What the GPU machine lacks: vit_jax.inference_time and benchmarks/gpu.py must run there.
  # vit_jax.main checks a config (vit_jax.config.checks) before it imports TensorFlow.
  script = os.path.join(os.path.dirname(__file__), '..', 'benchmarks', 'gpu.py')
  code = ('import runpy, sys; import vit_jax.training.step, vit_jax.tools.inference_time; '
          'import vit_jax.main, vit_jax.config.checks; '
          f'runpy.run_path({script!r}); '
          'print(sorted({m.split(".")[0] for m in sys.modules} & '
          '{"tensorflow", "tensorflow_datasets", "clu"}))')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == '[]'


def test_bfloat16_vit_b16_training_step_lowers_for_gpu_with_cudnn_attention_both_ways():
  # Deviceless: lowered for CUDA on whatever host runs the test; skipped without cuDNN.
  config = defaults.with_model(defaults.training_defaults(), 'ViT-B_16')
  config.update(dict(batch=2, optimizer='adamw'))
  model = registry.get_model('ViT-B_16', num_classes=1000, dtype=jnp.bfloat16, attention='cudnn')
  optimizer = train_step.make_optimizer(config)
  params = registry.param_shapes(model.clone(attention='xla'))  # Same tree; traced without cuDNN.
  state = train_step.TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
      opt_state=jax.eval_shape(optimizer.init, params), rng=jax.ShapeDtypeStruct((2,), jnp.uint32))
  batch = {'image': jax.ShapeDtypeStruct((2, 224, 224, 3), jnp.float32),
           'label': jax.ShapeDtypeStruct((2,), jnp.int32)}
  step = jax.jit(train_step.make_train_step(model, optimizer, config))
  try:
    text = step.trace(state, batch).lower(lowering_platforms=('cuda',)).as_text()
  except RuntimeError as e:
    if 'cuDNN' not in str(e):
      raise
    pytest.skip(f'lowering cuDNN attention needs jax-cuda12-plugin and cuDNN installed ({e})')
  assert text.count('custom_call @__cudnn$fmhaSoftmax(') == 12  # 197 tokens, padded to 208.
  assert text.count('custom_call @__cudnn$fmhaSoftmaxBackward(') == 12

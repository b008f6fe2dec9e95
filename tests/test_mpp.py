"""Tests of masked patch prediction (vit_jax/tasks/mpp.py): targets, corruption, loss and
fine-tuning."""
import functools
import logging
import os
import re
import shutil

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
from PIL import Image
import pytest

import helpers
import tiny_config
from vit_jax import sharding
from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.config import checks
from vit_jax.config import defaults
from vit_jax.models import analysis
from vit_jax.models import registry
from vit_jax.tasks import mpp
from vit_jax.training import step as train_step
from vit_jax.training import trainer

pytestmark = pytest.mark.xdist_group('mpp')  # Its module fixtures are built once.


def pixels(uint8_image):
  """uint8 pixels -> the model's [-1, 1] floats, as the input pipeline scales them."""
  return jnp.asarray(uint8_image, jnp.float32) / 127.5 - 1


def test_mean_color_3bit_of_planted_patches():
  image = np.zeros((1, 14, 14, 3), np.uint8)  # 2 x 2 patches of 7 x 7.
  image[0, :7, :7] = (200, 30, 100)  # Levels 200 // 32, 30 // 32, 100 // 32 = 6, 0, 3.
  image[0, :7, 7:] = 255  # White: level 7 in each channel.
  image[0, 7:, 7:, 0] = 255  # Red in 21 of 49 pixels: mean 109.3, level 3 (109 // 32).
  image[0, 7:, 10:, 0] = 0
  colors = mpp.targets(pixels(image), (7, 7), 'mean_color_3bit')
  np.testing.assert_array_equal(colors, [[6 * 64 + 0 * 8 + 3, 511, 0, 3 * 64]])


def test_downsampled_3bit_of_a_planted_patch():
  image = np.zeros((1, 8, 8, 3), np.uint8)  # One patch of 8 x 8: cells of 2 x 2 pixels.
  image[0, :4, :4] = (255, 0, 0)  # Red top-left quarter: cells (0, 0), (0, 1), (1, 0), (1, 1).
  image[0, 6:, 6:] = (0, 0, 255)  # Blue bottom-right cell (3, 3).
  image[0, 0, 6] = (0, 200, 0)  # One green pixel of four in cell (0, 3): green 50, level 1.
  cells = mpp.targets(pixels(image), (8, 8), 'downsampled_3bit').reshape(4, 4)
  red, blue, dim_green = 7 * 64, 7, 1 * 8
  np.testing.assert_array_equal(cells, [[red, red, 0, dim_green], [red, red, 0, 0], [0, 0, 0, 0],
                                        [0, 0, 0, blue]])


def test_area_weights_average_7_pixels_into_4_cells():
  # Cells 1.75 pixels wide: the first holds pixel 0 whole and 3/4 of pixel 1.
  weights = mpp.area_weights(7, 4)
  np.testing.assert_allclose(weights[0], [1 / 1.75, 0.75 / 1.75, 0, 0, 0, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(weights.sum(axis=1), 1, rtol=1e-6)


@pytest.mark.parametrize('num_patches, chosen', [(16, 8), (196, 98)])
def test_corruption_plan_proportions_over_many_draws(num_patches, chosen):
  plan = mpp.corruption_plan(jax.random.key(0), 1024, num_patches, 0.5, (0.8, 0.1, 0.1))
  kinds = np.asarray(plan.kinds)
  corrupted = kinds != mpp.UNCHOSEN
  assert (corrupted.sum(axis=1) == chosen).all()  # Exactly half of every image.
  # Every position equally likely: 1024 draws of probability 1/2 (standard deviation 0.016).
  np.testing.assert_allclose(corrupted.mean(axis=0), 0.5, atol=0.08)
  shares = [np.mean(kinds[corrupted] == kind) for kind in (mpp.MASK, mpp.RANDOM, mpp.KEEP)]
  np.testing.assert_allclose(shares, [0.8, 0.1, 0.1], atol=0.02)  # Over >= 8192 patches.
  sources = np.asarray(plan.sources)
  assert ((sources >= 0) & (sources < sources.size)).all()
  assert (sources != np.arange(sources.size).reshape(sources.shape)).all()  # Never itself.


def test_corruption_plan_is_a_function_of_the_key():
  draw = lambda seed: mpp.corruption_plan(jax.random.key(seed), 8, 16, 0.5, (0.8, 0.1, 0.1))
  jax.tree.map(np.testing.assert_array_equal, draw(1), draw(1))
  assert (np.asarray(draw(1).kinds) != np.asarray(draw(2).kinds)).any()


def tiny_model(num_classes=10, **overrides):
  """The registry's 'testing' ViT (width 16, one block) on 8 x 8 patches: 2 x 2 of a 16 px image."""
  return registry.get_model('testing', num_classes=num_classes, patch_size=(8, 8), **overrides)


@pytest.fixture(scope='module')
def model():
  """`testing_model` predicting 3-bit mean colours."""
  return mpp.with_mpp(tiny_model(), 'mean_color_3bit')


def init_params(model, images, seed=0):
  """`model`'s initial params for `images`, in one compiled program (not one per operation)."""
  init = jax.jit(functools.partial(model.init, train=False))
  return init(jax.random.key(seed), images)['params']


@pytest.fixture(scope='module')
def random_params(model):
  """Params of `model` with every leaf random, so that every output depends on its inputs."""
  return helpers.random_params(model, 16, seed=1, scale=0.1)


def test_extra_params_sit_beside_the_published_layout(model, random_params):
  published = registry.param_shapes(tiny_model(), 16)
  assert set(random_params) == set(published) | {'mpp_mask_embedding', 'mpp_head'}
  assert random_params['mpp_head']['kernel'].shape == (16, 512)
  axes = sharding.param_axes(sharding.declared_params(model, 16))
  assert axes[('mpp_mask_embedding',)] == ('embed',)
  sharding.check_rules(axes, sharding.full_rules())


def test_masked_and_replaced_patches_get_no_gradient_through_their_pixels(model, random_params):
  # Image 0, patch 0 masked, patch 1 given image 1's patch 3 (index 4 + 3), patch 2 kept.
  kinds = jnp.array([[mpp.MASK, mpp.RANDOM, mpp.KEEP, mpp.UNCHOSEN], [mpp.UNCHOSEN] * 4])
  sources = jnp.zeros((2, 4), jnp.int32).at[0, 1].set(7)
  plan = mpp.Plan(kinds, sources)
  images = jax.random.uniform(jax.random.key(2), (2, 16, 16, 3), minval=-1, maxval=1)
  predict = lambda x: jnp.sum(model.apply({'params': random_params}, x, train=False,
                                          plan=plan)**2)
  grads = mpp.patches_of(jax.jit(jax.grad(predict))(images), (8, 8))
  norms = np.asarray(jnp.sqrt(jnp.sum(grads**2, axis=(2, 3, 4))))
  assert norms[0, 0] == 0 and norms[0, 1] == 0  # Masked; replaced by another patch.
  assert norms[0, 2] > 0 and norms[1, 3] > 0  # Kept; the source of the replacement.


@pytest.mark.parametrize('target, outputs', [('downsampled_3bit', 16 * 512), ('patch_l2', 192)])
def test_other_targets_give_a_loss_and_accuracy_per_image(target, outputs):
  model = mpp.with_mpp(tiny_model(classifier='gap', scan_layers=True), target)
  images = jax.random.uniform(jax.random.key(3), (2, 16, 16, 3), minval=-1, maxval=1)
  params = init_params(model, images)
  assert params['mpp_head']['kernel'].shape == (16, outputs)
  plan = mpp.corruption_plan(jax.random.key(4), 2, 4, 0.5, (0.8, 0.1, 0.1))
  losses = jax.jit(functools.partial(mpp.image_losses, model, target=target, train=False))
  loss, accuracy = losses(params, images, plan)
  # The zero-initialised head predicts uniform colours, or black-grey pixels (all 0).
  expected = np.log(512) if target != 'patch_l2' else jnp.mean(images**2)
  np.testing.assert_allclose(loss, expected, rtol=0.1 if target == 'patch_l2' else 1e-5)
  assert loss.shape == accuracy.shape == (2,) and ((0 <= accuracy) & (accuracy <= 1)).all()


def test_head_learns_a_planted_colour_problem():
  # Each image one colour of 4, so that any uncorrupted patch tells the corrupted ones' colour.
  config = defaults.with_model(defaults.training_defaults(), 'testing')
  config.update(dict(batch=32, optimizer='adamw', base_lr=1e-2, warmup_steps=5, total_steps=60,
                     objective='masked_patch_prediction', sharding='fsdp'))
  model = mpp.with_mpp(tiny_model(), config.mpp.target)
  mesh = Mesh(np.asarray(jax.devices()).reshape(-1, 1), ('data', 'model'))
  optimizer = train_step.make_optimizer(config)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh, 16)
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  palette = pixels(np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255]]))
  metrics = []
  for i in range(config.total_steps):
    colours = jax.random.randint(jax.random.key(i), (32,), 0, 4)
    images = jnp.broadcast_to(palette[colours][:, None, None], (32, 16, 16, 3))
    state, m = step(state, {'image': images, 'label': jnp.zeros(32, jnp.int32)})
    metrics.append(jax.device_get(m))
  assert metrics[-1]['train_loss'] < 0.2 * metrics[0]['train_loss']  # From log(512).
  assert metrics[-1]['train_mpp_accuracy'] > 0.9  # Chance with 4 colours: 0.25.


def test_fine_tuning_drops_the_extra_params_and_keeps_the_rest(model, random_params, tmp_path,
                                                               caplog):
  path = str(tmp_path / 'pretrained.npz')
  npz.save(jax.device_get(random_params), path)
  supervised = tiny_model(num_classes=3)
  fresh = init_params(supervised, jnp.zeros((1, 16, 16, 3)), seed=5)
  with caplog.at_level(logging.INFO):
    loaded = finetune.load_pretrained(path, jax.device_get(fresh), supervised)
  assert 'Dropped the pre-training parameters mpp_head, mpp_mask_embedding' in caplog.text
  assert set(loaded) == set(fresh)
  np.testing.assert_array_equal(loaded['head']['kernel'], fresh['head']['kernel'])
  kept = {k: v for k, v in random_params.items() if not k.startswith('mpp_') and k != 'head'}
  jax.tree.map(np.testing.assert_array_equal, {k: loaded[k] for k in kept}, kept)


@pytest.mark.parametrize('overrides, message', [
    ({'mpp.target': 'mean_colour'}, "config.mpp.target='mean_colour' is not one of"),
    ({'objective': 'mpp'}, "config.objective='mpp' is not one of"),
    ({'mpp.corruption_rate': 1.5}, 'config.mpp.corruption_rate=1.5 must be in (0, 1]'),
    ({'mpp.mask_random_keep': (0.8, 0.1)}, 'config.mpp.mask_random_keep=(0.8, 0.1) must be 3'),
    ({'model_name': 'R26+ViT-S_32'}, 'needs a model without a ResNet stem'),
])
def test_bad_values_are_one_line_errors(overrides, message):
  config = tiny_config.get_config()
  config.objective = 'masked_patch_prediction'
  for field, value in overrides.items():
    if field == 'model_name':
      defaults.with_model(config, value)
    else:
      parent, _, name = field.rpartition('.')
      (config[parent] if parent else config)[name] = value
  with pytest.raises(checks.ConfigError, match=re.escape(message)) as error:
    checks.validate_config(config, 1)
  assert '\n' not in str(error.value)


def mpp_config(dataset, **overrides):
  """The tiny run of tests/tiny_config.py pre-training by masked patch prediction on `dataset`,
  4 steps, checkpoints of steps 2 and 4 kept."""
  config = tiny_config.get_config()
  config.update(dict(objective='masked_patch_prediction', dataset=dataset, test_split='test',
                     batch=16, batch_eval=16, total_steps=4, warmup_steps=1, progress_every=2,
                     eval_every=4, checkpoint_every=2, **overrides))
  return config


@pytest.fixture(scope='module')
def unlabelled_folder(tmp_path_factory):
  """An image folder of random 28 px PNGs in one class folder, `all`: no class meaning."""
  folder = tmp_path_factory.mktemp('images')
  rng = np.random.default_rng(0)
  for split, count in (('train', 48), ('test', 20)):
    os.makedirs(folder / split / 'all')
    for i in range(count):
      image = rng.integers(0, 256, (28, 28, 3), dtype=np.uint8)
      Image.fromarray(image).save(folder / split / 'all' / f'{i}.png')
  return str(folder)


@pytest.fixture(scope='module')
def mpp_workdir(tmp_path_factory, unlabelled_folder):
  workdir = str(tmp_path_factory.mktemp('mpp'))
  return workdir, trainer.train_and_evaluate(mpp_config(unlabelled_folder), workdir)


def test_run_logs_mpp_metrics_and_writes_the_published_layout(mpp_workdir):
  workdir, metrics = mpp_workdir
  scalars = analysis.read_scalars(workdir)
  for tag in ('train_loss', 'train_mpp_accuracy', 'test_mpp_loss', 'test_mpp_accuracy'):
    assert tag in scalars, tag
  assert 0 <= metrics['test_mpp_accuracy'] <= 1 and 'test_accuracy' not in metrics
  assert metrics['test_mpp_loss'] < np.log(512)  # Below chance after 4 steps.
  params = npz.load(os.path.join(workdir, 'model.npz'))
  assert {'embedding', 'cls', 'Transformer', 'head', 'mpp_head', 'mpp_mask_embedding'} == set(
      params)


def test_a_resumed_run_ends_where_the_uninterrupted_one_did(mpp_workdir, unlabelled_folder,
                                                            tmp_path):
  workdir = str(tmp_path / 'run')
  shutil.copytree(mpp_workdir[0], workdir)
  shutil.rmtree(os.path.join(workdir, 'checkpoints', '4'))  # As if stopped after step 2.
  os.remove(os.path.join(workdir, 'model.npz'))
  metrics = trainer.train_and_evaluate(mpp_config(unlabelled_folder), workdir)
  # The corruption of steps 3 and 4 is drawn again from the same keys.
  jax.tree.map(np.testing.assert_array_equal, npz.load(os.path.join(workdir, 'model.npz')),
               npz.load(os.path.join(mpp_workdir[0], 'model.npz')))
  assert metrics['test_mpp_loss'] == mpp_workdir[1]['test_mpp_loss']

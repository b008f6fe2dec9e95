"""Tests of segmentation: the canvases of fashion_mnist_segmentation, the per-pixel loss and its
ignore label, pixel accuracy and mIoU, fine-tuning from a classifier, encoding in tiles
(config.seg.window), and a run of configs/segmentation.py as a user types it."""
import os
import subprocess
import sys

from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
import pytest

import helpers
from vit_jax import cache
from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import runs
from vit_jax.config import defaults
from vit_jax.data import pipeline
from vit_jax.data import segmentation as canvases
from vit_jax.data import embedded as shipped_data
from vit_jax.errors import ConfigError
from vit_jax.evaluators import fewshot as fewshot_evaluator
from vit_jax.models import blank
from vit_jax.models import registry
from vit_jax.tasks import segmentation
from vit_jax.tools import predict
from vit_jax.training import dataset_checks

ROOT = os.path.dirname(helpers.TESTS)


@pytest.fixture(scope='module')
def embedded():
  """The embedded Fashion-MNIST's arrays, the items the canvases are made of."""
  return shipped_data.arrays()


def test_the_canvases_are_the_same_every_time(embedded):
  first, again = canvases.split_of(embedded, 'test'), canvases.split_of(embedded, 'test')
  np.testing.assert_array_equal(first[0], again[0])
  np.testing.assert_array_equal(first[1], again[1])
  assert first[0].shape[1:] == (56, 56)
  assert not np.array_equal(canvases.split_of(embedded, 'train')[0][:10], first[0][:10])


def test_each_canvas_holds_2_to_4_items_each_used_once(embedded):
  items, _ = canvases.layout(len(embedded['test_labels']), (canvases.SEED, 1))
  per_canvas = (items >= 0).sum(1)
  assert per_canvas.min() == 2 and per_canvas.max() == 4
  used = items[items >= 0]
  assert len(np.unique(used)) == len(used)


def test_the_mask_is_nonzero_exactly_where_the_pasted_items_show(embedded):
  images, masks = canvases.split_of(embedded, 'test')
  np.testing.assert_array_equal(masks > 0, images > 0)
  assert masks.max() == 10  # Ankle boot (class 9) + 1; 0 is the background.


def test_the_last_item_pasted_shows_whole_with_its_class(embedded):
  items, corners = canvases.layout(len(embedded['test_labels']), (canvases.SEED, 1))
  images, masks = canvases.split_of(embedded, 'test')
  for canvas in range(20):
    chosen = items[canvas][items[canvas] >= 0]
    item, (row, column) = chosen[-1], corners[canvas][len(chosen) - 1]
    pixels = embedded['test_images'][item]
    window = np.s_[row:row + 28, column:column + 28]
    shown = pixels > 0
    np.testing.assert_array_equal(images[canvas][window][shown], pixels[shown])
    assert (masks[canvas][window][shown] == embedded['test_labels'][item] + 1).all()


def test_training_batches_flip_image_and_mask_together(embedded):
  config = defaults.get_config()
  config.update(dataset='fashion_mnist_segmentation', batch=32)
  config.pp.crop = 56
  batch = next(pipeline.train_batches(config))
  assert batch['label'].shape == (32, 56, 56) and batch['label'].dtype == np.int32
  images, masks = canvases.split_of(embedded, 'train')
  index = {image.tobytes(): i for i, image in enumerate(images)}
  flips = []
  for image, label in zip(batch['image'], batch['label']):
    pixels = np.round((image[..., 0] + 1) * 127.5).astype(np.uint8)
    flipped = pixels[:, ::-1].tobytes() in index
    i = index[pixels[:, ::-1].tobytes() if flipped else pixels.tobytes()]
    np.testing.assert_array_equal(label, masks[i][:, ::-1] if flipped else masks[i])
    flips.append(flipped)
  assert 0 < sum(flips) < len(flips)  # Some flipped, some not.


def test_the_upsampling_is_jax_image_resizes_bilinear():
  maps = np.random.default_rng(0).normal(size=(2, 8, 4, 3)).astype(np.float32)
  np.testing.assert_allclose(segmentation.upsample(maps, (56, 12)),
                             jax.image.resize(maps, (2, 56, 12, 3), 'bilinear'), atol=1e-5)


def test_ignored_pixels_do_not_change_the_loss():
  rng = np.random.default_rng(0)
  labels = rng.integers(0, 4, (2, 6, 6))
  labels[0, :3] = 255
  logits = rng.normal(size=(2, 6, 6, 4)).astype(np.float32)
  other = logits.copy()
  other[0, :3] = rng.normal(size=(3, 6, 4)) * 100  # Only the ignored pixels change.
  loss, labelled = segmentation.pixel_losses(logits, labels, 255)
  loss_other, _ = segmentation.pixel_losses(other, labels, 255)
  assert float(jnp.sum(loss)) == float(jnp.sum(loss_other))
  assert float(jnp.sum(labelled)) == 72 - 18
  assert float(loss[1, 0, 0]) > 0


def test_pixel_accuracy_and_miou_of_a_hand_worked_example():
  labels = np.array([[[0, 1, 255], [1, 2, 2]]])  # One pixel ignored.
  predicted = np.array([[[0, 1, 3], [2, 2, 2]]])
  _, labelled = segmentation.pixel_losses(jnp.zeros((1, 2, 3, 4)), labels, 255)
  matrix = segmentation.confusion(labels, predicted, labelled, 4)
  # 4 of 5 labelled pixels right. IoU: class 0 1/1, class 1 1/2 (one of its two pixels taken
  # for 2), class 2 2/3 (two right, and that one); class 3 predicted only where ignored: absent.
  accuracy, miou = segmentation.scores(matrix)
  assert accuracy == pytest.approx(4 / 5)
  assert miou == pytest.approx((1 + 1 / 2 + 2 / 3) / 3)


def test_scores_summed_over_batches_are_those_of_the_whole():
  labels = np.array([[[0, 1]], [[1, 1]]])
  predicted = np.array([[[0, 0]], [[1, 1]]])
  ones = np.ones((1, 1, 2))
  parts = sum(segmentation.confusion(labels[i:i + 1], predicted[i:i + 1], ones, 2)
              for i in range(2))
  assert segmentation.scores(parts) == pytest.approx((3 / 4, (1 / 2 + 2 / 3) / 2))


def classifier_checkpoint(tmp_path, model, image_size):
  """A .npz of `model`'s random params (head included), with its spec, as training writes it."""
  params = helpers.random_params(model, image_size)
  path = str(tmp_path / 'classifier.npz')
  npz.save(params, path, spec=registry.model_spec(model, 'tiny'))
  return path, params


def test_fine_tuning_from_a_classifier_keeps_its_vit_bit_for_bit(tmp_path):
  classifier = helpers.tiny_vit(num_classes=10)
  path, params = classifier_checkpoint(tmp_path, classifier, 16)
  model = segmentation.with_segmentation(helpers.tiny_vit(num_classes=11))
  fresh = blank.init_params(model, jax.random.key(0), 16)
  loaded = traverse_util.flatten_dict(finetune.load_pretrained(path, jax.device_get(fresh), model))
  saved = traverse_util.flatten_dict(params)
  assert {p for p in saved if p not in loaded} == {('head', 'kernel'), ('head', 'bias')}
  for name, value in loaded.items():
    if name[0] == 'seg_head':
      np.testing.assert_array_equal(value, traverse_util.flatten_dict(fresh)[name])
    else:
      assert value.tobytes() == saved[name].tobytes(), name
  logits = model.apply({'params': traverse_util.unflatten_dict(loaded)},
                       helpers.images_of(16), train=False)
  assert logits.shape == (2, 16, 16, 11)


def test_a_classifier_fine_tuned_from_a_segmentation_drops_its_head(tmp_path):
  model = segmentation.with_segmentation(helpers.tiny_vit(num_classes=11))
  params = helpers.random_params(model, 16)
  path = str(tmp_path / 'segmentation.npz')
  npz.save(params, path)
  classifier = helpers.tiny_vit(num_classes=3)
  loaded = finetune.load_pretrained(path, jax.device_get(blank.init_params(
      classifier, jax.random.key(0), 16)), classifier)
  assert 'seg_head' not in loaded and loaded['head']['kernel'].shape == (12, 3)
  np.testing.assert_array_equal(loaded['cls'], params['cls'])


def one_pixel_patch_model(window):
  """A segmentation ViT on 1 px patches, whose upsampling leaves each patch's logits as its
  pixel's: what a pixel's logits depend on is what its patch token depends on."""
  return segmentation.with_segmentation(
      helpers.tiny_vit(num_classes=3, patch_size=(1, 1)), window=window)


def test_each_window_is_encoded_apart():
  """With window=4, the logits of an 8 x 8 image's pixels outside its top-left tile ignore that
  tile's pixels; encoded whole, every pixel sees them."""
  images = helpers.images_of(8)
  changed = images.copy()
  changed[:, :4, :4] *= -1
  outside = np.ones((8, 8), bool)
  outside[:4, :4] = False
  for window, unchanged in ((4, True), (None, False)):
    model = one_pixel_patch_model(window)
    params = helpers.random_params(model, 8)
    before, after = (model.apply({'params': params}, x, train=False) for x in (images, changed))
    assert np.array_equal(before[:, outside], after[:, outside]) == unchanged, window
    assert not np.array_equal(before[:, :4, :4], after[:, :4, :4])


def test_the_features_of_a_tiled_image_are_the_mean_of_its_tiles_features():
  model = one_pixel_patch_model(4)
  params = helpers.random_params(model, 8)
  images = helpers.images_of(8)
  whole = model.apply({'params': params}, images, method='features')
  tiles = [model.apply({'params': params}, images[:, r:r + 4, c:c + 4], method='features')
           for r in (0, 4) for c in (0, 4)]
  np.testing.assert_allclose(whole, np.mean(tiles, axis=0), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match='not a whole number of the 4 px tiles'):
    model.apply({'params': params}, helpers.images_of(6), train=False)


def test_the_intermediates_of_a_tiled_image_are_its_tiles_joined():
  """Block 0's tokens of an 8 x 8 image in 4 px tiles: the top-right tile's patch tokens are
  those of that tile encoded alone, in the image's map and among its rows of tokens; the class
  token is the mean of the tiles'."""
  model = one_pixel_patch_model(4)
  params = helpers.random_params(model, 8)
  images = helpers.images_of(8)
  apply = lambda x, maps: model.apply({'params': params}, x, method='intermediates', blocks=(0,),
                                      maps=maps)
  whole_maps, whole_tokens = apply(images, True), apply(images, False)
  tiles = [apply(images[:, r:r + 4, c:c + 4], True) for r in (0, 4) for c in (0, 4)]
  top_right = tiles[1].tokens[0]  # (2, 4, 4, D)
  np.testing.assert_allclose(whole_maps.tokens[0][:, :4, 4:], top_right, rtol=1e-4, atol=1e-4)
  rows = np.asarray(whole_tokens.tokens[0])[:, 1:].reshape(2, 8, 8, -1)  # After the class token.
  np.testing.assert_allclose(rows[:, :4, 4:], top_right, rtol=1e-4, atol=1e-4)
  mean_class_token = np.mean([t.class_tokens[0] for t in tiles], axis=0)
  np.testing.assert_allclose(whole_maps.class_tokens[0], mean_class_token, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(whole_tokens.tokens[0][:, 0], mean_class_token, rtol=1e-4, atol=1e-4)


def test_fine_tuning_at_twice_the_window_keeps_the_classifiers_position_embeddings(tmp_path):
  """A classifier of 16 px images, fine-tuned on 32 px ones in 16 px windows: its position
  embeddings load as they are (not resized to the 32 px grid), and apply to every tile."""
  path, params = classifier_checkpoint(tmp_path, helpers.tiny_vit(num_classes=10), 16)
  model = segmentation.with_segmentation(helpers.tiny_vit(num_classes=11), window=16)
  fresh = blank.init_params(model, jax.random.key(0), 32)
  loaded = finetune.load_pretrained(path, jax.device_get(fresh), model, grid=model.grid(32))
  posemb = loaded['Transformer']['posembed_input']['pos_embedding']
  assert posemb.tobytes() == params['Transformer']['posembed_input']['pos_embedding'].tobytes()
  assert model.apply({'params': loaded}, helpers.images_of(32), train=False).shape == (
      2, 32, 32, 11)


def test_a_model_npz_saved_before_windows_existed_loads_encoding_whole_images(tmp_path):
  model = segmentation.with_segmentation(helpers.tiny_vit(num_classes=11))
  spec = {**registry.model_spec(model, 'tiny'), 'objective': 'segmentation'}  # No 'seg' in it.
  npz.save(helpers.random_params(model, 16), tmp_path / 'model.npz', spec=spec)
  loaded, _ = runs.load_model(tmp_path / 'model.npz')
  assert isinstance(loaded, segmentation.SegmentationViT) and loaded.window is None


def test_a_window_that_does_not_tile_the_crop_or_cut_into_patches_is_one_line():
  config = helpers.tiny_config(objective='segmentation')
  config.pp.crop, config.seg.window = 28, 14
  assert segmentation.config_error(config) is None
  config.seg.window = 10
  assert segmentation.config_error(config).startswith(
      'config.seg.window=10 does not tile config.pp.crop=28: ')
  config.pp.crop = 20
  assert segmentation.config_error(config) == (
      "config.seg.window=10 is not a whole number of the model's 7x7 px patches: make it a "
      'multiple of them.')


def test_segmentation_of_a_dataset_labelled_per_image_is_one_line():
  config = defaults.get_config()
  config.objective = 'segmentation'
  info = pipeline.DatasetInfo(10, [str(i) for i in range(10)], 100, 10, per_pixel_labels=False)
  with pytest.raises(ConfigError, match='needs them per pixel: use a dataset'):
    dataset_checks.check_label_kind(config, info)


def test_few_shot_evaluation_leaves_out_a_dataset_labelled_per_pixel(caplog):
  """The default config's few-shot evaluation of the run's own dataset, on the canvases."""
  config = defaults.get_config()
  config.update(objective='segmentation', dataset='fashion_mnist_segmentation')
  config.evals.fewshot.datasets = (defaults.OWN_DATASET,)
  assert fewshot_evaluator.plan('fewshot', config.evals.fewshot, config) == {}
  assert ('Few-shot evaluation skips fashion_mnist_segmentation: its images are labelled per '
          'pixel') in caplog.text


def test_config_refuses_randaugment_and_mixup():
  config = helpers.tiny_config(objective='segmentation')
  config.pp.randaug = (2, 10)
  assert 'pp.randaug' in segmentation.config_error(config)
  config.pp.randaug, config.mixup.p = None, 0.2
  assert 'mixup.p' in segmentation.config_error(config)


def test_the_segmentation_config_fine_tunes_a_classifier_on_the_command_line(tmp_path, capsys,
                                                                            embedded):
  """configs/segmentation.py from a checkpoint of the default run's model, as the README runs it,
  shortened to 2 steps: it prints pixel accuracy and mIoU and writes a model.npz that loads as a
  segmentation model, whose masks `predict` writes."""
  model = registry.get_model(defaults.get_config().model, num_classes=10)
  path, _ = classifier_checkpoint(tmp_path, model, 28)
  workdir = tmp_path / 'seg'
  harness = ('XLA_FLAGS', 'JAX_PLATFORMS', 'JAX_COMPILATION_CACHE_DIR', 'JAX_NUM_CPU_DEVICES')
  env = {name: value for name, value in os.environ.items() if name not in harness}
  result = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', f'--config=configs/segmentation.py:{path}',
       f'--workdir={workdir}', '--config.total_steps=2', '--config.batch=8',
       '--config.batch_eval=50', '--config.test_split=test[:50]'],
      cwd=ROOT, env={**env, cache.CACHE_ENV: str(tmp_path / 'cache')}, capture_output=True,
      text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'Dataset fashion_mnist_segmentation: 6,676 train images' in result.stderr
  assert 'step 2: test pixel accuracy ' in result.stderr and ', mIoU ' in result.stderr
  loaded, params = runs.load_model(workdir)
  assert isinstance(loaded, segmentation.SegmentationViT) and 'seg_head' in params
  # Encoded in 28 px windows: the classifier's 4 x 4 position embeddings, as they were.
  assert loaded.window == 28
  assert params['Transformer']['posembed_input']['pos_embedding'].shape == (1, 17, 128)
  logits = loaded.apply({'params': params}, np.zeros((1, 56, 56, 3), np.float32), train=False)
  assert logits.shape == (1, 56, 56, 11)
  # predict gives the classes that cover the most pixels, and writes the mask.
  image = tmp_path / 'canvas.png'
  Image.fromarray(canvases.split_of(embedded, 'test')[0][0]).save(image)
  predict.main(['--checkpoint', str(workdir), '--masks', str(tmp_path / 'masks'), str(image)])
  printed = capsys.readouterr().out
  assert f'{image} (56x56 px, pixels per class):' in printed and '(0)' in printed
  mask = np.asarray(Image.open(tmp_path / 'masks' / 'canvas.png'))
  assert mask.shape == (56, 56) and mask.max() < 11
  # The mask is kept: predicting into the same folder again is refused before anything runs.
  assert predict.main(['--checkpoint', str(workdir), '--masks', str(tmp_path / 'masks'),
                       str(image)]) == 1
  assert capsys.readouterr().err == (
      f"error: {tmp_path / 'masks' / 'canvas.png'} exists: give another --masks, or move it away "
      'first (nothing is overwritten).\n')
  assert predict.main(['--checkpoint', str(workdir), '--image_size', '63', str(image)]) == 1
  assert 'error: Image size 63x63 is not a whole number of the 28 px tiles' in (
      capsys.readouterr().err)

"""Few-shot evaluation as training runs it: which images it fits on, compilations, bad models."""
import functools

import jax
import numpy as np
from PIL import Image
import pytest

from vit_jax.config import checks
from vit_jax.data import embedded
from vit_jax.data import sources
from vit_jax.evaluators import fewshot as fewshot_evaluator
from vit_jax.evaluators import linear_probe
from vit_jax.training import trainer
import tiny_config

pytestmark = pytest.mark.xdist_group('fewshot_training')  # Its module fixtures are built once.

SHOTS, SEEDS, HOLDOUT = (1, 5), (0, 1), 3


@pytest.fixture(scope='module')
def tiny():
  """The few-shot config of a tiny run on the embedded data, its model and initial params."""
  config = tiny_config.get_config()
  config.batch_eval = 200
  config.evals.fewshot.update(train_split='train[:1000]', num_test=400)
  config = fewshot_evaluator.dataset_config(config.evals.fewshot, config, 'fashion_mnist_embedded')
  model = trainer.build_model(config, num_classes=10)
  init = jax.jit(functools.partial(model.init, train=False))  # One compilation, not one per op.
  return config, model, init(jax.random.key(0), np.zeros((1, 28, 28, 3)))['params']


def test_held_out_images_that_choose_the_l2_are_never_among_the_shots(tiny):
  config, _, _ = tiny
  labels = linear_probe.split_labels(config, config.train_split)
  draws = [linear_probe.choose_shots(labels, 10, max(SHOTS), HOLDOUT, seed) for seed in SEEDS]
  batches = list(linear_probe.train_batches(config, labels, draws, SHOTS,
                                            linear_probe.default_mesh()))
  # Which training image each row is, found by its pixels among those of the split.
  raw_images, raw_labels = sources.get_source(config).select(config.train_split)
  raw = raw_images.reshape(len(raw_images), -1) / 127.5 - 1
  rows = np.concatenate([np.asarray(b['image'])[..., 0].reshape(len(b['image']), -1)
                         for b in batches])
  distances = ((rows ** 2).sum(1)[:, None] - 2 * rows @ raw.T + (raw ** 2).sum(1))
  index = distances.argmin(1)
  is_shot, is_held_out = (np.concatenate([np.asarray(b[name]) for b in batches])
                          for name in ('shots', 'holdout'))
  used = (is_shot + is_held_out).max(1) > 0
  assert np.all(distances[used].min(1) < 1e-3)  # Real rows are training images (others: > 1).
  for c, (k, seed) in enumerate((k, seed) for k in SHOTS for seed in SEEDS):
    shots, held_out = index[is_shot[:, c] > 0], index[is_held_out[:, c] > 0]
    assert not set(shots) & set(held_out)
    np.testing.assert_array_equal(np.bincount(raw_labels[shots], minlength=10), [k] * 10)
    np.testing.assert_array_equal(np.bincount(raw_labels[held_out], minlength=10), [HOLDOUT] * 10)
    np.testing.assert_array_equal(np.sort(shots), np.sort(draws[seed][0][:, :k].ravel()))


def compilations(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records if r.getMessage().startswith('Compiling')]


def test_a_second_evaluation_compiles_nothing(tiny, caplog):
  config, model, params = tiny
  evaluate = functools.partial(linear_probe.evaluate, model, config=config, shots=SHOTS,
                               seeds=SEEDS, holdout=HOLDOUT)
  with jax.log_compiles(), caplog.at_level('WARNING'):
    first = evaluate(params=params)
  assert any('features' in line for line in compilations(caplog))
  trained = jax.tree.map(lambda x: 1.5 * x, params)  # Other values, as after more steps.
  caplog.clear()
  with jax.log_compiles(), caplog.at_level('WARNING'):
    second = evaluate(params=trained)
  assert compilations(caplog) == []
  assert first['num_test'] == second['num_test'] == 400
  assert first[5]['accuracy'] != second[5]['accuracy']  # It did evaluate the other params.


def test_the_shots_and_a_small_test_split_share_one_batch_that_fits_them(tiny, caplog):
  config, model, params = tiny
  small = config.copy_and_resolve_references()
  small.test_split, small.batch_eval = 'test[:50]', 512
  with jax.log_compiles(), caplog.at_level('WARNING'):
    result = linear_probe.evaluate(model, params, small, shots=(1,), seeds=(0,), holdout=3)
  compiled = [line for line in compilations(caplog) if 'features' in line]
  # 40 training images (1 shot and 3 held out of each of 10 classes) and 50 test images: one
  # batch of 52 rows (4 devices) for both, not two shapes, nor 512 rows.
  assert len(compiled) == 1 and 'float32[52,28,28,3]' in compiled[0], compiled
  assert result['num_test'] == 50


def test_a_model_without_one_feature_vector_per_image_is_a_one_line_error(tiny):
  config = tiny_config.get_config()
  config.evals.fewshot.update(datasets=('fashion_mnist_embedded',), num_train=1000, num_test=400)
  config.model.classifier = 'unpooled'
  model = trainer.build_model(config, num_classes=10)
  with pytest.raises(checks.ConfigError) as error:
    fewshot_evaluator.FewshotEvaluator('fewshot', config.evals.fewshot, config, model,
                                       trainer.make_mesh(config))
  assert str(error.value) == (
      "config.evals.fewshot.datasets: classifier='unpooled' gives features per token; few-shot "
      "evaluation needs one vector per image: a 'token' or 'gap' model.")


def test_an_image_folder_is_a_fewshot_dataset(tiny, tmp_path):
  _, model, params = tiny
  folder = tmp_path / 'three_classes'
  with np.load(embedded.PATH) as data:
    for split, count in (('train', 15), ('test', 10)):
      labels = data[f'{split}_labels']
      for class_id in (1, 7, 8):  # Trouser, sneaker, bag.
        (folder / split / f'class{class_id}').mkdir(parents=True)
        for i, image in enumerate(data[f'{split}_images'][labels == class_id][:count]):
          Image.fromarray(image).save(folder / split / f'class{class_id}' / f'{i}.png')
  config = tiny_config.get_config()
  config.batch_eval = 200
  config.evals.fewshot.update(datasets=(str(folder),), shots=(5,), train_split='train')
  metrics = fewshot_evaluator.FewshotEvaluator('fewshot', config.evals.fewshot, config, model,
                                               trainer.make_mesh(config)).run(params)
  assert list(metrics) == ['fewshot/three_classes_5shot']
  assert metrics['fewshot/three_classes_5shot'] > 0.6  # Chance is 1/3.

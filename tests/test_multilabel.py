"""Tests of the sigmoid loss and of multi-label data: the head bias the sigmoid loss starts from,
both losses on hand-worked logits, mean average precision on a hand-worked ranking, multi-hot
batches from an image folder with a labels.csv and from a tfds dataset whose label is a
sequence of classes, and a run on such a folder as docs/training.md shows it.
"""
import importlib.util
import io
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image
import pytest
import tensorflow_datasets as tfds

from helpers import images_of
from helpers import TESTS
from helpers import TINY_CONFIG
from helpers import tiny_config
from helpers import tiny_vit
from helpers import xla_flags
import preloaded
from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import runs
from vit_jax.config import checks
from vit_jax.config import command_line
from vit_jax.data import image_files
from vit_jax.data import pipeline
from vit_jax.data import embedded
from vit_jax.data import sources
from vit_jax.models import blank
from vit_jax.tasks import supervised
from vit_jax.training import dataset_checks
from vit_jax.tools import predict
from vit_jax.training import setup
from vit_jax.training import step
from vit_jax.errors import ConfigError

# scripts/build_multilabel_folder.py: scenes of 1 to 3 embedded images, a labels.csv.
_spec = importlib.util.spec_from_file_location(
    'build_multilabel_folder', os.path.join(TESTS, '..', 'scripts', 'build_multilabel_folder.py'))
build_multilabel_folder = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_multilabel_folder)


def csv_rows(folder, split) -> dict[str, list[str]]:
  """{file: class names} of the rows of FOLDER/labels.csv in `split`, read as a user would."""
  with open(os.path.join(folder, 'labels.csv')) as f:
    lines = f.read().splitlines()[1:]
  return {file: names.split() for file, names in (line.split(',') for line in lines)
          if file.startswith(f'{split}/')}


def test_the_sigmoid_loss_starts_the_head_bias_at_minus_log_classes(tmp_path):
  config = tiny_config(loss='sigmoid_xent')
  model = setup.build_model(config, num_classes=10)
  params = blank.init_params(model, jax.random.key(0), 28)
  np.testing.assert_allclose(params['head']['bias'], np.full(10, -math.log(10)), rtol=1e-6)
  # The zero head kernel: every class starts at odds 1 : C, probability 1 / (C + 1).
  logits = model.apply({'params': params}, images_of(28), train=False)
  np.testing.assert_allclose(jax.nn.sigmoid(logits), np.full((2, 10), 1 / 11), rtol=1e-5)
  softmax_params = blank.init_params(setup.build_model(tiny_config(), 10), jax.random.key(0), 28)
  np.testing.assert_array_equal(softmax_params['head']['bias'], np.zeros(10))

  # A fine-tune to 4 new classes gets a new head, with the bias of the sigmoid loss.
  path = str(tmp_path / 'pretrained.npz')
  npz.save(jax.device_get(softmax_params), path)
  new_model = setup.build_model(config, num_classes=4)
  fresh = jax.device_get(blank.init_params(new_model, jax.random.key(1), 28))
  loaded = finetune.load_pretrained(path, fresh, new_model)
  np.testing.assert_allclose(loaded['head']['bias'], np.full(4, -math.log(4)), rtol=1e-6)
  np.testing.assert_array_equal(loaded['embedding']['kernel'],
                                softmax_params['embedding']['kernel'])


def test_the_sigmoid_loss_sums_each_classes_binary_cross_entropy():
  # Class 0 (a label) at logit 0: -log(1/2); class 1 (no label) at log 3, p = 3/4: -log(1/4).
  logits = jnp.array([[0.0, math.log(3)]])
  expected = math.log(2) + math.log(4)
  for labels in (jnp.array([0]), jnp.array([[1.0, 0.0]])):  # A class index or multi-hot.
    np.testing.assert_allclose(supervised.cross_entropy(logits, labels, loss='sigmoid_xent'),
                               [expected], rtol=1e-6)


def test_softmax_spreads_a_multi_hot_target_over_the_images_labels():
  # Softmax of (0, 0, log 2) is (1/4, 1/4, 1/2); labels 0 and 2 get half the target each.
  logits = jnp.array([[0.0, 0.0, math.log(2)]])
  loss = supervised.cross_entropy(logits, jnp.array([[1.0, 0.0, 1.0]]))
  np.testing.assert_allclose(loss, [-(0.5 * math.log(1 / 4) + 0.5 * math.log(1 / 2))], rtol=1e-6)


def test_mixup_mixes_multi_hot_rows_as_they_are():
  batch = {'image': jnp.zeros((2, 4, 4, 3)), 'label': jnp.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])}
  mixed = step.mixup(jax.random.key(0), batch, 0.5, 3)['label']
  ratio = float(mixed[0, 0])  # Row 0 is ratio x row 0 + (1 - ratio) x row 1.
  assert 0.5 <= ratio <= 1
  np.testing.assert_allclose(mixed, [[ratio, 1 - ratio, ratio], [1 - ratio, ratio, 1 - ratio]],
                             rtol=1e-6)


def test_mean_average_precision_of_a_hand_worked_ranking():
  scores = np.array([[0.9, 0.1, 0.5, 0.3],
                     [0.8, 0.2, 0.5, 0.3],
                     [0.7, 0.3, 0.5, 0.3],
                     [0.6, 0.4, 0.5, 0.3]])
  labels = np.array([[1, 0, 1, 0],
                     [0, 0, 0, 0],
                     [1, 0, 0, 0],
                     [0, 1, 1, 0]])
  # Class 0: positives at ranks 1 and 3, precisions 1/1 and 2/3. Class 1: its one positive
  # ranks first. Class 2: four equal scores, one threshold: precision 2/4 for both positives.
  # Class 3 has no positive: left out of the mean.
  aps = supervised.average_precisions(scores, labels)
  np.testing.assert_allclose(aps[:3], [(1 + 2 / 3) / 2, 1.0, 0.5])
  assert np.isnan(aps[3])
  assert supervised.mean_average_precision(scores, labels) == pytest.approx(
      ((1 + 2 / 3) / 2 + 1.0 + 0.5) / 3)


def test_the_eval_step_of_multi_hot_labels_sums_precision_at_1_and_returns_the_examples():
  model = tiny_vit(num_classes=3, head_bias_init=0.0)
  params = blank.init_params(model, jax.random.key(0), 16)
  params['head']['bias'] = jnp.array([0.0, 1.0, 0.0])  # The zero kernel: class 1 scores highest.
  labels = jnp.array([[0.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])
  batch = {'image': jnp.asarray(images_of(batch=3)), 'label': labels,
           'mask': jnp.array([1.0, 1.0, 0.0])}
  sums = jax.jit(supervised.make_eval_step(model, 'sigmoid_xent'))(params, batch)
  assert sums['count'] == 2 and sums['precision_at_1'] == 1  # The third is padding.
  assert 'correct' not in sums
  np.testing.assert_array_equal(sums[supervised.EXAMPLES]['labels'], labels)
  np.testing.assert_allclose(sums[supervised.EXAMPLES]['scores'], np.tile([0, 1, 0], (3, 1)))


def test_a_folder_with_a_labels_csv_gives_multi_hot_batches(tmp_path):
  folder = build_multilabel_folder.write_folder(str(tmp_path / 'scenes'),
                                                {'train': 30, 'test': 6})
  config = tiny_config(dataset=folder, test_split='test', batch=4, batch_eval=4)
  info = pipeline.get_dataset_info(config)
  classes = sorted({name for names in csv_rows(folder, 'train').values() for name in names})
  assert (info.label_names, info.multi_label) == (classes, True)
  assert dataset_checks.dataset_line(config, info).endswith(
      f'{len(classes)} classes ({", ".join(classes[:5])}, ...). Multi-label.')
  batch = next(pipeline.train_batches(config))
  assert batch['label'].dtype == np.float32 and batch['label'].shape == (4, len(classes))
  assert set(batch['label'].ravel()) <= {0, 1} and 1 <= batch['label'].sum(1).min()
  batches = list(pipeline.eval_batches(config))
  labels = np.concatenate([b['label'][b['mask'] > 0] for b in batches])
  expected = [tuple(int(c in names) for c in classes)
              for names in csv_rows(folder, 'test').values()]
  assert sorted(map(tuple, labels.astype(int).tolist())) == sorted(expected)


def test_a_labels_csv_naming_a_class_the_train_split_lacks_is_a_one_line_error(tmp_path):
  folder = build_multilabel_folder.write_folder(str(tmp_path / 'scenes'),
                                                {'train': 6, 'test': 2})
  with open(os.path.join(folder, 'labels.csv'), 'a') as f:
    f.write('test/0.png,Unicorn\n')
  with pytest.raises(ConfigError, match=r"labels test/0.png 'Unicorn', a class no image of the "
                                        r'train split has') as error:
    dataset_checks.check_data(tiny_config(dataset=folder, test_split='test'), '')
  assert '\n' not in str(error.value)


class TinyMultiLabel(tfds.core.GeneratorBasedBuilder):
  """8 train and 4 test images of the embedded data, each with the classes of LABEL_SETS in turn
  as a `labels` sequence, as voc's."""
  VERSION = tfds.core.Version('1.0.0')
  LABEL_SETS = [(0,), (1, 2), (), (0, 1, 2)]

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(shape=(28, 28, 1)),
        'labels': tfds.features.Sequence(tfds.features.ClassLabel(names=['a', 'b', 'c'])),
    }))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {'train': self._generate_examples(8), 'test': self._generate_examples(4)}

  def _generate_examples(self, count):
    with np.load(embedded.PATH) as data:
      images = data['train_images'][:count]
    for i, image in enumerate(images):
      png = io.BytesIO()
      Image.fromarray(image).save(png, format='png')
      png.seek(0)
      yield i, {'image': png, 'labels': list(self.LABEL_SETS[i % len(self.LABEL_SETS)])}


def test_a_tfds_sequence_of_class_labels_gives_multi_hot_batches(tmp_path):
  TinyMultiLabel(data_dir=str(tmp_path)).download_and_prepare()
  config = tiny_config(dataset='tiny_multi_label', tfds_data_dir=str(tmp_path),
                       test_split='test', batch=8, batch_eval=4)
  info = pipeline.get_dataset_info(config)
  assert (info.label_names, info.multi_label) == (['a', 'b', 'c'], True)
  rows = sorted(map(tuple, next(pipeline.train_batches(config))['label'].tolist()))
  # Each label set twice over the 8 training images, the empty one as a row of zeros.
  assert rows == sorted(2 * [(1, 0, 0), (0, 1, 1), (0, 0, 0), (1, 1, 1)])
  eval_batch = next(pipeline.eval_batches(config))
  assert eval_batch['label'].dtype == np.float32 and eval_batch['label'].shape == (4, 3)
  # The labels alone, as few-shot evaluation reads them: one row of each label set.
  assert sorted(map(tuple, sources.get_source(config).labels('test').tolist())) == sorted(
      [(1, 0, 0), (0, 1, 1), (0, 0, 0), (1, 1, 1)])


def test_the_loss_is_checked_before_anything_compiles():
  assert checks.values_error(tiny_config(loss='hinge')) == (
      "config.loss='hinge' is not one of ('softmax_xent', 'sigmoid_xent').")


def test_the_augreg_imagenet21k_presets_train_with_the_sigmoid_loss():
  load = lambda arg: command_line.load_config([f'--config=configs/augreg.py:{arg}'])
  assert load('B/16,i21k').loss == 'sigmoid_xent'
  assert load('B/16,i1k').loss == 'softmax_xent'


def test_a_run_on_a_multi_label_folder_reports_map_and_precision_at_1(tmp_path, capsys):
  folder = build_multilabel_folder.write_folder(str(tmp_path / 'scenes'),
                                                {'train': 48, 'test': 12})
  command = ['-m', 'vit_jax.main', f'--config={TINY_CONFIG}',
             f'--config.dataset={folder}', '--config.test_split=test',
             '--config.loss=sigmoid_xent', '--config.total_steps=10', '--config.warmup_steps=2',
             "--config.evals.fewshot.datasets=('config.dataset',)", f'--workdir={tmp_path / "run"}']
  result = preloaded.run(command, cwd=tmp_path, env={**os.environ, 'XLA_FLAGS': xla_flags(None)})
  log = result.stdout + result.stderr
  assert result.returncode == 0, log
  assert re.search(r'test mAP [\d.]+, precision@1 [\d.]+, test loss [\d.]+', log), log
  assert re.search(r'Done: test_loss [\d.]+, test_mAP [\d.]+, test_precision_at_1 [\d.]+', log), log
  assert re.search(r'Few-shot evaluation skips .*scenes: its images are multi-label', log), log
  assert 'accuracy' not in log

  # predict prints each class's own sigmoid probability for the run's model.
  image = os.path.join(folder, 'test', '0.png')
  assert predict.main(['--checkpoint', str(tmp_path / 'run'), '--top=10', image]) == 0
  printed = [float(p) for p in re.findall(r'([\d.]+)%', capsys.readouterr().out)]
  model, params = runs.load_model(str(tmp_path / 'run'))
  logits = model.apply({'params': params}, image_files.load_image(image, 28)[None], train=False)
  np.testing.assert_allclose(printed, sorted(100 / (1 + np.exp(-logits[0])), reverse=True),
                             atol=0.006)

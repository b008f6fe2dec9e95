"""Tests of a first run on one's own image folder, as docs/training.md shows it:
`python -m vit_jax.main --config.dataset=DIR` in a fresh folder, a process with the device count
JAX picks for itself (forked from one that has imported the libraries: tests/preloaded.py),
twice, then `vit_jax.predict` on its model.

What the run says about the data, a dataset of one class, the warning of a run that sees each
image too often, the few-shot evaluation on the run's own data, top-5, the default workdir, the
class names that `predict` prints, the `fewshot` and `visualize` commands on the run's own data,
and a folder of class folders with no split folders.
"""
import json
import os
import re

import pytest
import tensorflow_datasets as tfds

from helpers import read_scalars
from helpers import tiny_config
from helpers import write_image_folder
from helpers import xla_flags
import preloaded
from vit_jax.config import checks
from vit_jax.config import command_line
from vit_jax.config import defaults
from vit_jax.evaluators import fewshot as fewshot_evaluator
from vit_jax.tools import fewshot as fewshot_command
from vit_jax.tools import predict
from vit_jax.tools import visualize
from vit_jax.training import trainer
from vit_jax.training import workdirs
import tiny_tfds

pytestmark = pytest.mark.xdist_group('own_data')  # The module fixture runs once.
TIMEOUT = 300  # Seconds any one process may run.
FOLDER = 'my_photos'  # In the run's current folder, as --config.dataset=my_photos names it.
# 15 training images of each class: 5-shot (5 shots, 10 held out) fits, 10-shot does not.
PER_CLASS = {'train': 15, 'test': 5}
# Shorter than the default run's 900 steps, still 24 x 128 = 3,072 images of 30: 102 passes, just
# over the 100 that the warning names.
SHORTER = ['--config.total_steps=24', '--config.warmup_steps=5']
OWN_DATA_RUN = ['vit_jax.main', f'--config.dataset={FOLDER}', *SHORTER]


def run(args, cwd) -> tuple[int, str]:
  """(exit status, output) of `python -m ARGS` in `cwd`, on the devices JAX picks itself."""
  result = preloaded.run(['-m', *args], cwd=cwd, timeout=TIMEOUT,
                         env={**os.environ, 'XLA_FLAGS': xla_flags(None)})
  return result.returncode, result.stdout + result.stderr


@pytest.fixture(scope='module')
def own_run(tmp_path_factory):
  """(folder the commands ran in, log of the run, log of the same command run again)."""
  cwd = tmp_path_factory.mktemp('own_data')
  write_image_folder(cwd / FOLDER, PER_CLASS)
  status, log = run(OWN_DATA_RUN, cwd)
  assert status == 0, log
  status, again = run(OWN_DATA_RUN, cwd)
  assert status == 0, again
  return cwd, log, again


def test_the_run_names_its_dataset_image_counts_and_classes_first(own_run):
  _, log, _ = own_run
  line = re.search(r'^.*Dataset my_photos: .*$', log, re.MULTILINE)
  assert line, log
  assert line[0].endswith('Dataset my_photos: 30 train images (train), 10 test images (test), '
                          '2 classes (Bag, Trouser).'), line[0]
  assert log.index('Dataset my_photos') < log.index('Mesh:') < log.index('Model ')


def test_few_shot_runs_on_the_runs_own_data_and_skips_the_shots_it_lacks_images_for(own_run):
  cwd, log, _ = own_run
  assert 'fashion_mnist_embedded' not in log, log
  done = log.strip().splitlines()[-1]
  assert re.search(r'Done: .*my_photos_5shot [\d.]+', done), log
  assert 'shot' not in done.replace('my_photos_5shot', ''), done
  assert re.search(r"WARNING: Few-shot evaluation on my_photos skips 10-shot: k-shot needs k \+ 10 "
                   r"images of each class in 'train\[:30\]' \(k shots, 10 held out to choose "
                   r'the L2\), and its smallest class has 15\.', log), log
  assert set(read_scalars(cwd / 'workdirs' / 'default_my_photos')) >= {'fewshot/my_photos_5shot'}


def test_top5_is_not_reported_with_5_classes_or_fewer(own_run):
  cwd, log, again = own_run
  assert re.search(r'step 24: test accuracy [\d.]+, test loss', log), log
  assert not re.search('top-?5', log + again, re.IGNORECASE), log + again
  assert 'test_top5_accuracy' not in read_scalars(cwd / 'workdirs' / 'default_my_photos')


def test_a_run_that_sees_each_image_over_100_times_warns_in_one_line(own_run):
  _, log, _ = own_run
  warnings = [line for line in log.splitlines() if 'times' in line]
  assert len(warnings) == 1, log
  assert re.search(r'WARNING: This run sees each of its 30 training images about 102 times '
                   r'\(24 steps of 128 images\), .* --config=configs/scratch_small\.py:DIR ',
                   warnings[0]), warnings


def test_the_default_workdir_names_the_overridden_dataset_and_the_command_resumes(own_run):
  cwd, log, again = own_run
  workdir = cwd / 'workdirs' / 'default_my_photos'
  for output in (log, again):
    assert f'Workdir: {workdir}\n' in output, output
  assert 'Already trained to step 24 of 24: evaluating it.' in again, again
  assert not (cwd / 'workdirs' / 'default').exists()  # The quick start's stays free.
  assert workdirs.default_workdir(command_line.DEFAULT_CONFIG, '/data/my_photos/') == (
      os.path.join('workdirs', 'default_data_my_photos'))
  assert workdirs.default_workdir('configs/vit.py:ti16,cifar10', '~/photos') == os.path.join(
      'workdirs', 'vit_ti16_cifar10_photos')


def test_predict_prints_the_class_names_of_the_runs_folder(own_run, monkeypatch, capsys):
  # In this process: tests/test_commands.py runs the command in a process of its own.
  cwd, _, _ = own_run
  monkeypatch.chdir(cwd)
  images = [f'{FOLDER}/test/Bag/0.png', f'{FOLDER}/test/Trouser/0.png']
  assert predict.main(['--checkpoint', 'workdirs/default_my_photos', *images]) == 0
  out = capsys.readouterr().out
  for image in images:
    lines = out.split(f'{image} (28x28 px):\n')[1].splitlines()[:2]
    assert sorted(re.sub(r'^ *[\d.]+% +', '', line) for line in lines) == [
        'Bag (0)', 'Trouser (1)'], out


def test_the_fewshot_command_on_the_runs_workdir_evaluates_on_its_own_data(own_run, monkeypatch,
                                                                          capsys, tmp_path):
  # In this process: tests/test_commands.py runs the command in a process of its own.
  cwd, _, _ = own_run
  monkeypatch.chdir(cwd)
  results = tmp_path / 'fewshot.json'
  assert fewshot_command.main(['--checkpoint', 'workdirs/default_my_photos', '--seeds', '1',
                               '--out', str(results)]) == 0
  out, err = capsys.readouterr()
  assert out.startswith(f'{FOLDER} few-shot linear accuracy over 1 seed, 10 test images (test):')
  # Of the default 1, 5, 10 and 25 shots, those that 15 images of each class leave 10 beside.
  assert ("Skipping 10/25-shot: k-shot needs k + 10 images of each class in 'train' (k shots, 10 "
          'held out to choose the L2), and its smallest class has 15.') in err
  saved = json.loads(results.read_text())
  assert saved['dataset'] == FOLDER and {'1', '5'} <= set(saved) and '10' not in saved


def test_visualize_draws_on_the_runs_own_test_images(own_run, monkeypatch, capsys):
  cwd, _, _ = own_run
  monkeypatch.chdir(cwd)
  assert visualize.run_images('workdirs/default_my_photos', 3) == [
      f'{FOLDER}/test/Bag/0.png', f'{FOLDER}/test/Trouser/0.png', f'{FOLDER}/test/Bag/1.png']
  assert visualize.main(['--checkpoint', 'workdirs/default_my_photos', '--figures',
                         'attention_rollout', '--num_images', '2']) == 0
  assert capsys.readouterr().out.strip().endswith('attention_rollout.png')


def test_a_flat_folder_of_class_folders_trains_and_tests_on_a_tenth_held_out(tmp_path):
  """`--config.dataset=DIR` on DIR/<class>/*.png with no split folders (torchvision's layout)."""
  os.rename(write_image_folder(tmp_path / 'split', {'train': 20}) + '/train', tmp_path / 'flat')
  status, log = run(['vit_jax.main', '--config.dataset=flat', '--config.total_steps=2',
                     '--config.batch=8', '--config.batch_eval=8'], tmp_path)
  assert status == 0, log
  assert ('flat has no train/ and test/ folders: 10% of the images of each class folder are '
          'held out as its test split') in log
  assert ('Dataset flat: 36 train images (train), 4 test images (test), 2 classes (Bag, '
          'Trouser).') in log
  assert re.search(r'step 2: test accuracy [\d.]+', log) and 'Done: ' in log, log


def test_a_folder_of_one_class_is_refused_before_anything_compiles(tmp_path, monkeypatch, caplog):
  # The line `vit_jax.main` prints for a ConfigError, and its exit status 1:
  # tests/test_config_errors.py.
  write_image_folder(tmp_path / 'one_class', PER_CLASS, class_ids=(8,))
  monkeypatch.chdir(tmp_path)  # --config.dataset=one_class names the folder in the current one.
  config = defaults.get_config()
  config.dataset = 'one_class'
  with pytest.raises(checks.ConfigError) as refused:
    trainer.train_and_evaluate(config, str(tmp_path / 'workdir'))
  assert str(refused.value) == (
      "config.dataset='one_class' has 1 class (Bag): a classifier needs 2 or more. "
      'Use a dataset of several classes (an image folder: one folder per class, '
      'DIR/train/<class>/ and DIR/test/<class>/), or pre-train without labels with '
      '--config.objective=masked_patch_prediction.')
  assert 'Mesh:' not in caplog.text and 'Model ' not in caplog.text, caplog.text
  assert not (tmp_path / 'workdir' / 'checkpoints').exists()


class OneClassFashionMnist(tiny_tfds.TinyFashionMnist):
  """tiny_fashion_mnist's images of class 0 (T-shirt/top), the dataset's one class."""

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(shape=(28, 28, 1)),
        'label': tfds.features.ClassLabel(names=['T-shirt/top'])}))

  def _generate_examples(self, split, count):
    for key, example in super()._generate_examples(split, count):
      if example['label'] == 0:
        yield key, example


def test_a_tfds_dataset_of_one_class_is_refused(tmp_path):
  config = tiny_config(dataset='one_class_fashion_mnist', tfds_data_dir=str(tmp_path),
                       test_split='test')
  with pytest.raises(checks.ConfigError, match=r"^config.dataset='one_class_fashion_mnist' "
                     r'has 1 class \(T-shirt/top\): a classifier needs 2 or more\.'):
    trainer.train_and_evaluate(config, str(tmp_path / 'workdir'))
  assert not (tmp_path / 'workdir' / 'checkpoints').exists()


def test_own_dataset_in_the_few_shot_datasets_is_the_runs_dataset():
  config = tiny_config(dataset='/data/photos')
  config.evals.fewshot.datasets = (defaults.OWN_DATASET, 'fashion_mnist_embedded', '/data/photos')
  assert fewshot_evaluator.datasets(config.evals.fewshot, config) == [
      '/data/photos', 'fashion_mnist_embedded']


def test_few_shot_evaluation_leaves_out_a_dataset_of_one_class(tmp_path, caplog):
  # As when pre-training by masked patch prediction on a folder of one class, DIR/train/all/.
  config = tiny_config(dataset=write_image_folder(tmp_path, PER_CLASS, class_ids=(8,)),
                       test_split='test')
  config.evals.fewshot.datasets = (defaults.OWN_DATASET,)
  assert fewshot_evaluator.plan('fewshot', config.evals.fewshot, config) == {}
  assert f'Few-shot evaluation skips {tmp_path}: it has 1 class' in caplog.text

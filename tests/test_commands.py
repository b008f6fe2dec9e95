"""Every command a user types, run once as README.md and docs/ show it, in a process of its own.

Nothing of the test harness reaches these processes: no XLA_FLAGS (so no forced device count and
no quick compilation), no JAX settings, no compilation cache of the harness. Each command picks its
devices as it does for a user, one XLA:CPU device per core here, keeps what it compiles in vit_jax's
cache, empty at first as on a fresh machine, and shows the project's lines only. The commands
share one short run of the quick start's command, at the batch of 16 under which its closing
few-shot evaluation used to abort on 2 devices. Further checks of commands that have run so once
call their main() in this process.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator

from helpers import DATA
from helpers import noting_tensorflow
from helpers import PHOTOS
from helpers import random_params
from helpers import TESTS
from helpers import TINY_CONFIG
from helpers import tiny_config
from helpers import user_env
from vit_jax import cache
from vit_jax.checkpoints import npz
from vit_jax.config import defaults
from vit_jax.models import registry
from vit_jax.tools import export
from vit_jax.tools import predict

# The tests of each shared run share one worker, which trains it; the others go to any worker.
SHORT_RUN_WORKER = pytest.mark.xdist_group('commands_short_run')
NON_SQUARE_RUN_WORKER = pytest.mark.xdist_group('commands_non_square_run')


@pytest.fixture(scope='module', autouse=True)
def fresh_user_cache(tmp_path_factory):
  """vit_jax's cache (downloads, compiled programs) as on a fresh machine: empty at first."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setenv(cache.CACHE_ENV, str(tmp_path_factory.mktemp('user_cache')))
    yield


def vit_jax(*args, cwd=None, timeout=600, note_tensorflow=False) -> subprocess.CompletedProcess:
  """`python -m vit_jax.ARGS...` as a user runs it; stdout and stderr as text. With
  `note_tensorflow`, stdout ends with whether it imported TensorFlow (helpers.noting_tensorflow)."""
  module = f'vit_jax.{args[0]}'
  python = noting_tensorflow(module) if note_tensorflow else ['-m', module]
  return subprocess.run([sys.executable, *python, *args[1:]], env=user_env(), cwd=cwd,
                        capture_output=True, text=True, timeout=timeout)


# What TensorFlow's C++ runtime prints while it loads, before its logging is set up.
NATIVE_INFO_LINES = re.compile(r'^I\d{4} |oneDNN|absl::InitializeLog', re.MULTILINE)


def succeeded(result: subprocess.CompletedProcess) -> str:
  """The output of a command that must have exited 0 (else the test fails with its end), and
  printed none of TensorFlow's start-up lines."""
  assert result.returncode == 0, (result.returncode, result.stdout[-2000:], result.stderr[-4000:])
  assert not NATIVE_INFO_LINES.search(result.stderr), result.stderr
  return result.stdout + result.stderr


# The quick start's command, shortened to 6 steps at a batch of 16 (evaluation and few-shot too),
# evaluated on 500 test images, its few-shot evaluation drawing its shots from 2,000 training
# images (125 batches of features, more than the 100 that aborted) and scoring 500.
SHORT_RUN = ('main', '--config.total_steps=6', '--config.batch=16', '--config.batch_eval=16',
             '--config.test_split=test[:500]', '--config.evals.fewshot.num_train=2000',
             '--config.evals.fewshot.num_test=500')


@pytest.fixture(scope='module')
def short_run(tmp_path_factory):
  """(workdir, console, folder) of SHORT_RUN in a fresh folder: training, then its test
  evaluation, its few-shot evaluation and model.npz."""
  folder = tmp_path_factory.mktemp('fresh_folder')
  console = succeeded(vit_jax(*SHORT_RUN, cwd=folder))
  return folder / 'workdirs' / 'default', console, folder  # Named after the config: it resumes.


@SHORT_RUN_WORKER
def test_main_prints_the_projects_lines_only_on_one_device_per_core(short_run):
  workdir, console, _ = short_run
  lines = console.splitlines()
  assert len(lines) <= 12, console  # Workdir, dataset, mesh, model, step, checkpoint, evaluations.
  assert max(map(len, lines)) <= 200, console
  assert all(re.match(r'\d\d:\d\d:\d\d ', line) for line in lines), console  # All logged.
  assert not re.search(r'orbax|CheckpointManager|Hyperparameters|TPU', console, re.IGNORECASE)
  devices = min(os.cpu_count(), len(os.sched_getaffinity(0)))
  config = defaults.get_config()
  params = registry.count_params(registry.get_model(config.model, num_classes=10), config.pp.crop)
  for expected in (f'Workdir: {re.escape(str(workdir))}',
                   fr"Mesh: {{'data': {devices}, 'model': 1}} over {devices} cpu devices\.",
                   fr'Model ViT-mini_7: {params:,} params, [\d.]+ GFLOPs', r'step 6/6: loss [\d.]+',
                   f'step 6: checkpoint -> {re.escape(str(workdir))}/checkpoints/6',
                   r'step 6: test accuracy [\d.]+', r'step 6: few-shot linear accuracy', r'Done: '):
    assert re.search(expected, console), (expected, console)
  assert (workdir / 'model.npz').exists()
  # The metrics and hyperparameters went to TensorBoard instead.
  events = event_accumulator.EventAccumulator(str(workdir))
  events.Reload()
  assert {'_hparams_/session_start_info', 'train_loss', 'test_accuracy'} <= set(
      events.Tags()['tensors'])


@SHORT_RUN_WORKER
def test_main_keeps_its_compiled_programs_in_vit_jaxs_cache(short_run):
  kept = {name.split('-')[0] for name in os.listdir(os.path.join(os.environ[cache.CACHE_ENV],
                                                                 'xla'))}
  # The train step, and small programs that compile in well under a second (JAX's own threshold
  # for keeping one): the few-shot solver's.
  assert {'jit_constrained', 'jit_solve_each', 'jit_count_correct'} <= kept, kept


@SHORT_RUN_WORKER
def test_fewshot_command(short_run):
  # It aborted on 2 devices before hardware.Pacer; tests/test_fewshot.py checks the cause, which
  # aborted every time.
  workdir, _, _ = short_run
  output = succeeded(vit_jax('fewshot', '--checkpoint', str(workdir), '--shots', '5', '--seeds',
                             '2', '--train_split', 'train[:2000]', '--test_split', 'test[:500]'))
  assert 'few-shot linear accuracy over 2 seeds, 500 test images' in output, output


@SHORT_RUN_WORKER
def test_the_run_continued_ends_again_with_its_few_shot_evaluation(short_run):
  """The same command, one step longer: it resumes and ends with the few-shot evaluation that
  aborted on 2 devices at this batch (the fixture's is the first)."""
  _, _, folder = short_run
  output = succeeded(vit_jax(*SHORT_RUN, '--config.total_steps=7', cwd=folder))
  assert 'step 7/7: loss' in output, output
  assert re.search(r'step 7: few-shot linear accuracy .*_10shot [\d.]+', output), output


@SHORT_RUN_WORKER
def test_predict_command_on_a_folder_into_a_csv_file(short_run, tmp_path):
  workdir, _, _ = short_run
  out = tmp_path / 'predictions.csv'
  output = succeeded(vit_jax('predict', '--checkpoint', str(workdir), DATA, '--out', str(out),
                             note_tensorflow=True))
  assert f'Wrote the top 5 classes of {len(PHOTOS)} images to {out}.' in output
  assert sorted(line.split(',')[0] for line in out.read_text().splitlines()[1:]) == sorted(PHOTOS)
  assert 'tensorflow imported: False' in output, output  # PIL reads the images.


@SHORT_RUN_WORKER
def test_visualize_command(short_run, tmp_path):
  workdir, _, _ = short_run
  output = succeeded(vit_jax('visualize', '--checkpoint', str(workdir), '--output', str(tmp_path),
                             '--num_images', '2', note_tensorflow=True))
  assert {'attention_rollout.png', 'training_curves.png'} <= set(os.listdir(tmp_path))
  # The figures of a run on the embedded data, its training curves included, need no TensorFlow.
  assert 'tensorflow imported: False' in output, output


@SHORT_RUN_WORKER
def test_export_and_convert_commands_round_trip_the_weights(short_run, tmp_path):
  workdir, _, _ = short_run
  exported = tmp_path / 'model_timm.safetensors'
  succeeded(vit_jax('export', '--checkpoint', str(workdir), '--format', 'timm',
                    '--out', str(exported)))
  back = tmp_path / 'back.npz'
  succeeded(vit_jax('convert', str(exported), str(back)))  # The heads come from its metadata.
  with np.load(workdir / 'model.npz') as original, np.load(back) as converted:
    kernels = [name for name in original.files if name.endswith('/kernel')]
    assert len(kernels) > 10
    for name in kernels:
      np.testing.assert_array_equal(original[name], converted[name], err_msg=name)


@pytest.fixture(scope='module')
def non_square_run(tmp_path_factory):
  """(workdir, console) of the tiny run at 28 x 42 px with 14 px patches, fine-tuned for 6
  steps from a file in the published layout (no spec) of its model with 7 px patches at 28 px."""
  folder = tmp_path_factory.mktemp('non_square')
  model = registry.get_model(tiny_config().model, num_classes=10)
  npz.save(random_params(model, 28, scale=0.1), folder / 'published.npz')
  console = succeeded(vit_jax(
      'main', f'--config={TINY_CONFIG}', f'--workdir={folder / "run"}', '--config.pp.crop=(28,42)',
      '--config.model.patches.size=(14,14)', f'--config.pretrained_path={folder}/published.npz',
      '--config.total_steps=6', '--config.batch=16'))
  return folder / 'run', console


@NON_SQUARE_RUN_WORKER
def test_main_trains_non_square_images_from_another_patch_size(non_square_run):
  workdir, console = non_square_run
  assert 'step 6/6: loss' in console
  spec = npz.read_spec(workdir / 'model.npz')
  assert spec['image_size'] == [28, 42] and spec['model']['patch_size'] == [14, 14]
  with np.load(workdir / 'model.npz') as saved:
    assert saved['embedding/kernel'].shape == (14, 14, 3, 32)
    assert saved['Transformer/posembed_input/pos_embedding'].shape == (1, 1 + 2 * 3, 32)


# The predict and export commands of a non-square run, in this process: each command has run as a
# user runs it above.
@NON_SQUARE_RUN_WORKER
def test_predict_command_at_another_size_of_a_non_square_run(non_square_run, capsys):
  workdir, _ = non_square_run
  assert predict.main(['--checkpoint', str(workdir), '--image_size', '56x56', PHOTOS[0]]) == 0
  assert f'{PHOTOS[0]} (56x56 px):' in capsys.readouterr().out


@NON_SQUARE_RUN_WORKER
def test_export_command_of_a_non_square_run(non_square_run, tmp_path, capsys):
  workdir, _ = non_square_run
  assert export.main(['--checkpoint', str(workdir), '--format', 'timm',
                      '--out', str(tmp_path / 'timm.safetensors')]) == 0
  output = capsys.readouterr().out
  assert '(28x42 px, 10 classes)' in output and "'img_size': [28, 42]" in output


def test_checkpoint_list_and_models_commands():
  assert 'augreg:B/16' in succeeded(vit_jax('checkpoint', '--list'))
  lines = succeeded(vit_jax('models')).strip().splitlines()
  rows = [line.split()[0] for line in lines[1:-1]]
  assert rows[-1] == 'ViT-mini_7' and 'ViT-B_16' in rows and 'testing' not in rows
  assert lines[-1].startswith('The last row, ViT-mini_7, is the model of the default run')


def test_inference_time_command(tmp_path):
  # As README.md shows it; its --train mode: tests/test_inference_time.py.
  out = tmp_path / 'speed.json'
  succeeded(vit_jax('inference_time', '--model', 'testing', '--batch', '4', '--image_size',
                    '16', '--rounds', '1', '--round_seconds', '0.2', '--out', str(out)))
  assert json.loads(out.read_text())['images_per_second'] > 0


def test_multilabel_folder_script(tmp_path):
  """docs/training.md's script, shortened: a folder of scenes and its labels.csv (the run on
  such a folder: tests/test_multilabel.py)."""
  script = os.path.join(TESTS, '..', 'scripts', 'build_multilabel_folder.py')
  output = succeeded(subprocess.run(
      [sys.executable, script, 'fashion_scenes', '--train=64', '--test=16'], env=user_env(),
      cwd=tmp_path, capture_output=True, text=True, timeout=300))
  assert output == 'Wrote fashion_scenes: 64 train and 16 test scenes, and their labels.csv.\n'
  assert len(os.listdir(tmp_path / 'fashion_scenes' / 'train')) == 64
  labels = (tmp_path / 'fashion_scenes' / 'labels.csv').read_text()
  assert labels.startswith('file,labels\n') and len(labels.splitlines()) == 1 + 64 + 16
  # The folder is kept: the command again is one line.
  again = subprocess.run([sys.executable, script, 'fashion_scenes', '--train=8', '--test=8'],
                         env=user_env(), cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
  assert again.returncode == 1 and again.stderr == (
      'error: fashion_scenes exists: give another folder, or move it away first (nothing is '
      'overwritten).\n')
  assert (tmp_path / 'fashion_scenes' / 'labels.csv').read_text() == labels

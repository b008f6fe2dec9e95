"""Tests of few-shot linear evaluation, vit_jax/evaluators/linear_probe.py."""
import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import ml_collections
import numpy as np
import pytest

from vit_jax.checkpoints import npz
from vit_jax.evaluators import linear_probe
from vit_jax.tools import fewshot as fewshot_command
from vit_jax.models import registry
from helpers import write_image_folder
from helpers import xla_flags

pytestmark = pytest.mark.xdist_group('fewshot')  # Its module fixtures are built once.

# The tiny model of tests/tiny_config.py, as training records it in a workdir's config.json.
TINY_MODEL = {
    'name': 'tiny', 'patches': {'size': [7, 7]}, 'hidden_size': 32,
    'transformer': {'mlp_dim': 64, 'num_heads': 2, 'num_layers': 1, 'dropout_rate': 0.0,
                    'attention_dropout_rate': 0.0},
    'classifier': 'token', 'representation_size': None,
}


def test_solver_matches_numpy_least_squares_with_an_unregularised_bias():
  rng = np.random.default_rng(0)
  x = (rng.normal(size=(70, 6)) + 3).astype(np.float32)
  labels = rng.integers(0, 4, size=70)
  stats = linear_probe.zero_statistics(6, 4)
  for rows in np.array_split(np.arange(70), 5):  # Sums over 5 batches.
    stats = linear_probe.accumulate(stats, x[rows], linear_probe.targets(labels[rows], 4),
                                    np.ones(14))
  w, b = linear_probe.solve(stats, 0.5)
  # min ||[x 1] [w; b] - y||^2 + 0.5 ||w||^2 as one least-squares problem, in float64.
  y = np.where(np.eye(4)[labels] > 0, 1.0, -1.0)
  a = np.block([[x, np.ones((70, 1))], [np.sqrt(0.5) * np.eye(6), np.zeros((6, 1))]])
  reference = np.linalg.lstsq(a, np.concatenate([y, np.zeros((6, 4))]), rcond=None)[0]
  np.testing.assert_allclose(w, reference[:6], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(b, reference[6], rtol=1e-4, atol=1e-4)


def test_the_regressions_are_solved_one_matrix_per_lapack_call_each_as_alone():
  # XLA:CPU's LAPACK kernels spread a batch of matrices over the thread pool that runs each
  # device's share of a computation, and wait: with the statistics on 2 devices, both threads of
  # the pool can wait in a batched Cholesky, and `python -m vit_jax.fewshot` hangs. A single
  # matrix runs inline.
  rng = np.random.default_rng(2)
  stats = linear_probe.zero_statistics(8, 3, (4,))
  for c in range(4):  # Regression c: its own rows.
    x = rng.normal(size=(20, 8)).astype(np.float32)
    one = linear_probe.accumulate(linear_probe.zero_statistics(8, 3), x,
                                  linear_probe.targets(rng.integers(0, 3, 20), 3), np.ones(20))
    for total, value in zip(stats, one):
      total[c] = value
  l2 = np.array([0.1, 1.0, 10.0, 100.0], np.float32)
  w, b = linear_probe.solve_each(stats, l2)
  for c in range(4):
    w_c, b_c = linear_probe.solve(linear_probe.Statistics(*(s[c] for s in stats)), l2[c])
    np.testing.assert_allclose(w[c], w_c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b[c], b_c, rtol=1e-5, atol=1e-6)
  hlo = linear_probe.solve_each.lower(stats, l2).compile().as_text()
  calls = [line for line in hlo.splitlines() if 'custom_call_target="lapack_' in line]
  assert {re.search(r'custom_call_target="lapack_(\w+)_ffi"', line)[1] for line in calls} == {
      'spotrf', 'strsm'}  # The Cholesky factor, then two triangular solves.
  for line in calls:  # The shapes of each call's results: one (8, 8) or (8, 3) matrix.
    results = line.split(' = ')[1].split(' custom-call(')[0]
    shapes = re.findall(r'f32\[([\d,]+)\]', results)
    assert shapes and all(len(shape.split(',')) == 2 for shape in shapes), line


def test_planted_separable_features_are_classified_perfectly():
  rng = np.random.default_rng(1)
  centres = 4 * rng.normal(size=(5, 16))
  sample = lambda labels: centres[labels] + 0.3 * rng.normal(size=(len(labels), 16))
  train_labels = np.repeat(np.arange(5), 20)
  shots, holdout = linear_probe.choose_shots(train_labels, 5, 5, 3, seed=0)
  train = sample(train_labels)
  w, b, l2, holdout_accuracy = linear_probe.probe(
      (train[shots.ravel()], train_labels[shots.ravel()]),
      (train[holdout.ravel()], train_labels[holdout.ravel()]), 5)
  test_labels = rng.integers(0, 5, size=500)
  assert holdout_accuracy == 1.0 and l2 in linear_probe.L2_GRID
  np.testing.assert_array_equal(linear_probe.predict(sample(test_labels), w, b), test_labels)


def test_shot_choice_is_seeded_balanced_nested_and_apart_from_the_holdout():
  labels = np.random.default_rng(2).integers(0, 10, size=1000)
  shots, holdout = linear_probe.choose_shots(labels, 10, 25, 10, seed=3)
  assert shots.shape == (10, 25) and holdout.shape == (10, 10)
  np.testing.assert_array_equal(labels[shots], np.arange(10)[:, None].repeat(25, 1))
  np.testing.assert_array_equal(labels[holdout], np.arange(10)[:, None].repeat(10, 1))
  assert len(set(shots.ravel()) | set(holdout.ravel())) == 350  # No image twice.
  again, _ = linear_probe.choose_shots(labels, 10, 25, 10, seed=3)
  np.testing.assert_array_equal(again, shots)
  five, _ = linear_probe.choose_shots(labels, 10, 5, 10, seed=3)
  np.testing.assert_array_equal(five, shots[:, :5])  # The 5 shots are among the 25.
  other, _ = linear_probe.choose_shots(labels, 10, 25, 10, seed=4)
  assert not np.array_equal(other, shots)


def test_too_few_images_of_a_class_is_a_clear_error():
  with pytest.raises(ValueError, match=r'Classes \[1\] have fewer than 5 shots \+ 2 held-out'):
    linear_probe.choose_shots(np.array([0] * 9 + [1] * 6), 2, 5, 2, seed=0)


@pytest.fixture(scope='module')
def tiny_workdir(tmp_path_factory):
  """A workdir of the tiny model with its initial (random) parameters, as training lays it out."""
  workdir = tmp_path_factory.mktemp('workdir')
  model = registry.get_model(ml_collections.ConfigDict(TINY_MODEL), num_classes=10)
  params = model.init(jax.random.key(0), np.zeros((1, 28, 28, 3)), train=False)['params']
  npz.save(params, str(workdir / 'model.npz'))
  (workdir / 'config.json').write_text(json.dumps({'model': TINY_MODEL, 'pp': {'crop': 28}}))
  return workdir


def test_command_prints_a_table_and_writes_json_on_the_embedded_data(tiny_workdir, tmp_path,
                                                                     capsys):
  out = tmp_path / 'linear_probe.json'
  assert fewshot_command.main(['--checkpoint', str(tiny_workdir), '--shots', '1,5', '--seeds', '2',
                       '--holdout', '3', '--train_split', 'train[:1000]',
                       '--test_split', 'test[:400]', '--batch', '200', '--out', str(out)]) == 0
  printed = capsys.readouterr().out
  assert 'over 2 seeds, 400 test images (test[:400])' in printed
  results = json.loads(out.read_text())
  assert results['num_test'] == 400
  for k in ('1', '5'):
    assert len(results[k]['accuracy']) == 2 and f'\n    {k}  ' in printed
  # Even random features of Fashion-MNIST separate its classes well above chance (10%).
  assert results['5']['mean'] > 0.3 and results['5']['mean'] > results['1']['mean']
  # The results of that evaluation are kept: the same --out again is refused at once.
  written = out.read_text()
  assert fewshot_command.main(['--checkpoint', str(tiny_workdir), '--out', str(out)]) == 1
  assert capsys.readouterr().err == (f'error: {out} exists: give another --out, or move it away '
                                     'first (nothing is overwritten).\n')
  assert out.read_text() == written


def test_command_frames_the_images_as_the_models_run_evaluated_them(tmp_path, capsys):
  """A model.npz of a run with config.pp.resize=40 at 28 px: the 28 px centre of each image
  resized to 40 px, unless --resize says otherwise."""
  model = registry.get_model(ml_collections.ConfigDict(TINY_MODEL), num_classes=10)
  params = model.init(jax.random.key(0), np.zeros((1, 28, 28, 3)), train=False)['params']
  spec = {**registry.model_spec(model, 'tiny'), 'image_size': [28, 28], 'resize': 40}
  npz.save(params, str(tmp_path / 'model.npz'), spec=spec)

  def accuracies(*resize):
    out = tmp_path / f'fewshot{"".join(resize)}.json'
    assert fewshot_command.main(['--checkpoint', str(tmp_path / 'model.npz'), '--shots', '5',
                                 '--seeds', '1', '--holdout', '3', '--train_split', 'train[:300]',
                                 '--test_split', 'test[:200]', '--batch', '100', '--out',
                                 str(out), *resize]) == 0
    return json.loads(out.read_text())['5']['accuracy']

  framed = accuracies()
  assert framed == accuracies('--resize', '40')
  assert framed != accuracies('--resize', '28')  # 28 px images as they are.
  capsys.readouterr()


def test_bad_shots_are_a_clear_error(tiny_workdir, capsys):
  assert fewshot_command.main(['--checkpoint', str(tiny_workdir), '--shots', '5,x']) == 1
  assert "--shots='5,x': give positive integers" in capsys.readouterr().err



def test_shots_a_class_is_too_small_for_name_the_class(tiny_workdir, tmp_path, capsys):
  folder = write_image_folder(tmp_path, {'train': 8, 'test': 2})  # Bag and Trouser.
  for i in range(4, 8):
    os.remove(os.path.join(folder, 'train', 'Trouser', f'{i}.png'))
  assert fewshot_command.main(['--checkpoint', str(tiny_workdir), '--dataset', folder,
                               '--shots', '3', '--holdout', '2', '--batch', '4']) == 1
  assert "error: Classes ['Trouser'] have fewer than 3 shots + 2 held-out images" in (
      capsys.readouterr().err)

# 100 batches of features already on 2 CPU devices, fitted 3 times: queued unpaced, their
# all-reduces aborted XLA:CPU in every try (a thread at the all-reduce, the other waiting for an
# in-flight slot; see hardware.Pacer).
MANY_BATCHES_ON_TWO_DEVICES = textwrap.dedent("""
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from vit_jax.evaluators import linear_probe
    rows = NamedSharding(Mesh(np.array(jax.devices()), ('data',)), P('data'))
    rng = np.random.default_rng(0)
    batches = [jax.device_put({
        'features': rng.normal(size=(16, 32)).astype(np.float32),
        'label': rng.integers(0, 4, 16).astype(np.int32),
        'shots': (rng.random((16, 6)) < 0.5).astype(np.float32),
        'holdout': (rng.random((16, 6)) < 0.5).astype(np.float32)}, rows) for _ in range(100)]
    for _ in range(3):
      w, b, l2, accuracy = linear_probe.fit(batches, 4)
    print(jax.device_count(), 'devices:', w.shape)
""")


def test_fit_of_many_batches_on_two_cpu_devices_does_not_abort():
  env = {**os.environ, 'XLA_FLAGS': xla_flags(None), 'JAX_NUM_CPU_DEVICES': '2'}
  result = subprocess.run([sys.executable, '-c', MANY_BATCHES_ON_TWO_DEVICES], env=env,
                          capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.split() == ['2', 'devices:', '(6,', '32,', '4)']

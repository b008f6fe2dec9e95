"""Tests of the evaluators of config.evals (vit_jax/evaluators/) and of the loop that runs them."""
import json

import jax
import pytest

from helpers import read_scalars
from helpers import tiny_config
from vit_jax import evaluators
from vit_jax.config import checks
from vit_jax.training import resume
from vit_jax.training import trainer


def built(config, name):
  """The evaluator of config.evals[name], looked up by its type's name, with fresh params."""
  checks.validate_config(config, jax.device_count())
  model = trainer.build_model(config, num_classes=10)
  entry = config.evals[name]
  evaluator = evaluators.TYPES[evaluators.type_of(entry, config)](
      name, entry, config, model, trainer.make_mesh(config))
  return evaluator, trainer.init_params(config, model, config.pp.crop)


def test_a_classification_evaluator_reports_accuracy_and_loss_under_its_name():
  config = tiny_config()
  config.evals.test.update(type='classification', split='test[:300]')
  evaluator, params = built(config, 'test')
  metrics = evaluator.run(params)
  assert sorted(metrics) == ['test_accuracy', 'test_loss', 'test_top5_accuracy']
  assert 0 <= metrics['test_accuracy'] <= metrics['test_top5_accuracy'] <= 1
  assert evaluator.line(metrics, 1.0).startswith('test accuracy ')


def test_a_split_smaller_than_batch_eval_is_one_batch_of_its_size_with_the_same_metrics():
  config = tiny_config(batch_eval=64)
  config.evals.test.update(type='classification', split='test[:10]')
  evaluator, params = built(config, 'test')
  assert evaluator.data.batch_eval == 12  # 10 images on 4 devices, not 64.
  padded_to_64 = evaluator.data.copy_and_resolve_references()
  padded_to_64.batch_eval = 64
  expected = evaluators.classification.evaluate(evaluator.eval_step, params, padded_to_64,
                                                evaluator.mesh)
  assert evaluator.run(params) == pytest.approx(expected, rel=1e-5)


def test_the_objectives_evaluator_of_masked_patch_prediction_is_mpp():
  config = tiny_config(objective='masked_patch_prediction')
  config.evals.test.split = 'test[:200]'
  evaluator, params = built(config, 'test')
  assert evaluators.type_of(config.evals.test, config) == 'mpp'
  metrics = evaluator.run(params)
  assert sorted(metrics) == ['test_mpp_accuracy', 'test_mpp_loss']
  assert metrics['test_mpp_loss'] > 0


def test_an_entry_with_its_own_split_and_cadence_is_evaluated_at_its_steps(tmp_path, caplog):
  config = tiny_config(total_steps=30, checkpoint_every=30, eval_every=30, progress_every=10)
  config.evals.holdout = dict(type='classification', split='train[95%:]', every=10)
  with caplog.at_level('INFO'):
    metrics = trainer.train_and_evaluate(config, str(tmp_path))
  scalars = read_scalars(str(tmp_path))
  assert sorted(scalars['holdout_accuracy']) == [10, 20, 30]
  assert sorted(scalars['test_accuracy']) == [30]
  assert 'val_accuracy' not in scalars  # Its split is None: off.
  assert metrics['holdout_loss'] != metrics['test_loss']  # Other images.
  assert 'step 20: holdout accuracy ' in caplog.text
  assert 'Deprecated' not in caplog.text


def test_an_old_field_logs_one_deprecation_line_naming_what_to_write(caplog):
  config = tiny_config(val_split='train[95%:]', val_every=20)
  config.fewshot.shots = (1, 5)
  for _ in range(2):  # As the command line validates, then train_and_evaluate again.
    checks.validate_config(config, jax.device_count())
  assert [r.getMessage() for r in caplog.records if r.levelname == 'WARNING'] == [
      "Deprecated: config.val_split, config.val_every, config.fewshot.shots; write "
      "--config.evals.val.split='train[95%:]' --config.evals.val.every=20 "
      '--config.evals.fewshot.shots="(1, 5)" instead (docs/evaluation.md, "Evaluators").']
  assert (config.evals.val.split, config.evals.val.every) == ('train[95%:]', 20)
  assert tuple(config.evals.fewshot.shots) == (1, 5)
  assert config.val_split is None and config.fewshot.shots is None


def test_an_unknown_type_is_a_one_line_error():
  config = tiny_config()
  config.evals.test.type = 'detection'
  with pytest.raises(checks.ConfigError, match=(
      r"config.evals.test.type='detection' is not one of \('classification', 'mpp', "
      r"'segmentation', 'fewshot'\)")):
    checks.validate_config(config, jax.device_count())


def test_the_config_json_of_a_run_older_than_config_evals_resumes(tmp_path):
  older = json.loads(tiny_config().to_json_best_effort())
  del older['evals']
  older.update(val_split='train[95%:]', val_every=20, fewshot=dict(
      datasets=['fashion_mnist_embedded'], shots=[5, 10], every=None, num_train=None,
      num_test=1000, seeds=1, train_split='train', test_split='test'))
  (tmp_path / 'config.json').write_text(json.dumps(older))
  config = tiny_config(val_split='train[95%:]', val_every=20)  # The same command, rerun.
  checks.validate_config(config, jax.device_count())
  assert resume.resume_mismatches(config, str(tmp_path)) == []

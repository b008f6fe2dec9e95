"""The 'fewshot' evaluator: linear k-shot accuracy of the frozen representation on each of its
datasets (the solver of vit_jax/fewshot.py), as NAME/DATASET_Kshot, the mean over its seeds.

Its entry in config.evals: `datasets` (as config.dataset names them; config.OWN_DATASET: the
run's own; (): off), `shots`, `every` (None: after the last step only), `num_train` and
`num_test` (the first this many images of `train_split` and `test_split`; None: all), `seeds`.
"""
import logging
import os

from jax.sharding import Mesh
import ml_collections

from vit_jax.config import defaults
from vit_jax.errors import ConfigError
from vit_jax.evaluators import linear_probe as solver

# The input pipeline (it imports TensorFlow) is imported where it is used: vit_jax.validation
# imports this package to check config.evals before TensorFlow loads.


def datasets(entry: ml_collections.ConfigDict, config: ml_collections.ConfigDict) -> list[str]:
  """The entry's datasets, defaults.OWN_DATASET replaced by config.dataset, each once."""
  return list(dict.fromkeys(config.dataset if dataset == defaults.OWN_DATASET else dataset
                            for dataset in entry.datasets))


def first_images(config: ml_collections.ConfigDict, split: str, count: int | None) -> str:
  """The split string of the first `count` images of `split` of config.dataset (all of them
  where it has fewer); `split` itself for `count` None, or where it holds a slice of its own
  ('train[:1000]': split strings cannot slice a slice)."""
  from vit_jax.data import pipeline
  if not count or '[' in split:
    return split
  return f'{split}[:{min(count, pipeline.num_examples(config, split))}]'


def dataset_config(entry: ml_collections.ConfigDict, config: ml_collections.ConfigDict,
                   dataset: str) -> ml_collections.ConfigDict:
  """The run's `config` with the dataset and splits of the entry's evaluation on `dataset`:
  the first entry.num_train and num_test images of its train_split and test_split."""
  config = config.copy_and_resolve_references()
  config.dataset = dataset
  config.train_split = first_images(config, entry.train_split, entry.num_train)
  config.test_split = first_images(config, entry.test_split, entry.num_test)
  return config


def plan(name: str, entry: ml_collections.ConfigDict,
         config: ml_collections.ConfigDict) -> dict[str, tuple[int, ...]]:
  """{dataset: shots}: for each of `datasets`, the k of entry.shots for which every class of
  its train_split has k shots and solver.HOLDOUT further images; logs a warning for each
  dataset that lacks images for some, and for each of fewer than 2 classes, of multi-label data
  or of labels per pixel (left out: the regression takes one class per image).
  Raises ConfigError, naming the dataset, where a dataset or split does not exist or a test
  image does not decode."""
  from vit_jax.data import pipeline
  shots_of = {}
  for dataset in datasets(entry, config):
    try:
      data = dataset_config(entry, config, dataset)
      info = pipeline.get_dataset_info(data)
      one_class_each = not (info.multi_label or info.per_pixel_labels)
      sizes = solver.class_sizes(data, data.train_split) if one_class_each else None
    except (ValueError, FileNotFoundError) as e:
      raise ConfigError(f'config.evals.{name}.datasets, {dataset!r}: {e}') from None
    if not one_class_each:
      logging.warning('Few-shot evaluation skips %s: its images are %s, and k-shot takes k '
                      'images of each class, each of one class.', dataset,
                      'labelled per pixel' if info.per_pixel_labels else 'multi-label')
      continue
    if len(sizes) < 2:
      logging.warning('Few-shot evaluation skips %s: it has %d class, and a classifier needs 2 '
                      'or more.', dataset, len(sizes))
      continue
    shots, why_not = solver.shots_that_fit(entry.shots, int(sizes.min()), solver.HOLDOUT,
                                           data.train_split)
    if why_not:
      logging.warning('Few-shot evaluation on %s skips %s', dataset, why_not)
    if shots:
      shots_of[dataset] = shots
  return shots_of


class FewshotEvaluator:
  """Few-shot linear evaluation of the model's features on the datasets of `plan`."""

  def __init__(self, name: str, entry: ml_collections.ConfigDict,
               config: ml_collections.ConfigDict, model, mesh: Mesh):
    self.name, self.entry, self.config, self.model, self.mesh = name, entry, config, model, mesh
    self.plan = plan(name, entry, config)
    self.every = (entry.get('every') or config.total_steps) if self.plan else 0  # 0: none.
    if self.plan:
      try:
        solver.check_model(model)
      except ValueError as e:
        raise ConfigError(f'config.evals.{name}.datasets: {e}') from None

  @staticmethod
  def is_on(entry: ml_collections.ConfigDict) -> bool:
    return bool(entry.datasets)

  @staticmethod
  def config_error(where: str, entry: ml_collections.ConfigDict,
                   config: ml_collections.ConfigDict) -> str | None:
    del config
    if entry.get('datasets') and not (entry.shots and min(entry.shots) > 0 and entry.seeds > 0):
      return (f'{where}.shots={tuple(entry.shots)} and {where}.seeds={entry.seeds} must be '
              'positive, e.g. (5, 10) and 1.')
    return None

  def run(self, params) -> dict[str, float]:
    """{'NAME/<dataset>_<k>shot': the mean accuracy over the entry's seeds} of `plan`."""
    metrics = {}
    for dataset, shots in self.plan.items():
      results = solver.evaluate(self.model, params, dataset_config(self.entry, self.config,
                                                                   dataset),
                                shots, range(self.entry.seeds), solver.HOLDOUT, self.mesh)
      short = os.path.basename(os.path.normpath(dataset))  # Image folders: the folder's name.
      metrics.update({f'{self.name}/{short}_{k}shot': results[k]['mean'] for k in shots})
    return metrics

  def line(self, metrics: dict[str, float], seconds: float) -> str:
    """'few-shot linear accuracy DATASET_5shot A, ... (S s)'."""
    return 'few-shot linear accuracy {} ({:.1f} s)'.format(', '.join(
        f'{tag[len(self.name) + 1:]} {value:.4f}' for tag, value in metrics.items()), seconds)

"""The 'classification' evaluator: top-1 (and top-5) accuracy and loss of the model's head on a
split, as NAME_accuracy, NAME_top5_accuracy, NAME_loss; on multi-label data, mean average
precision and precision at 1 instead, as NAME_mAP and NAME_precision_at_1.

Its entry in config.evals: `split` (None: the entry is off), `every` (None: config.eval_every),
and optionally `dataset`, `batch_eval` and `pp` (a dict of config.pp fields) where they differ
from the run's.
"""
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
from jax.sharding import Mesh
import ml_collections
import numpy as np

from vit_jax import hardware
from vit_jax.errors import ConfigError
from vit_jax.tasks import supervised

# The input pipeline (it imports TensorFlow) is imported where it is used: vit_jax.validation
# imports this package to check config.evals before TensorFlow loads.

# The names under which `evaluate` reports the sums of an evaluation step (others keep theirs).
EVAL_NAMES = {'correct': 'accuracy', 'correct_top5': 'top5_accuracy'}


@jax.jit
def added(totals, sums):
  """`totals` + `sums`, leaf by leaf, in one dispatch rather than one per leaf."""
  return jax.tree.map(jnp.add, totals, sums)


def unmasked_rows(examples: dict[str, jax.Array]) -> tuple[np.ndarray, np.ndarray]:
  """(float32 scores (n, C), bool labels (n, C)) on the host of the unmasked examples of a
  batch's supervised.EXAMPLES, gathered from every process."""
  examples = multihost_utils.process_allgather(examples, tiled=True)
  keep = examples['mask'] > 0
  return examples['scores'][keep], examples['labels'][keep] > 0


def summed(eval_step, params, config, mesh: Mesh) -> tuple[dict, list]:
  """(what `eval_step(params, batch)` sums, summed over the whole of config.test_split, as numpy
  arrays on the host; the `unmasked_rows` of each batch where the step also returns
  per-example arrays, supervised.EXAMPLES (multi-label data), else [])."""
  from vit_jax.data import pipeline
  totals, examples, pacer = None, [], hardware.Pacer()
  for batch in pipeline.get_eval_iterator(config, mesh):
    sums = eval_step(params, batch)
    if supervised.EXAMPLES in sums:
      examples.append(unmasked_rows(sums.pop(supervised.EXAMPLES)))
    totals = pacer.step(sums if totals is None else added(totals, sums))
  return jax.device_get(totals), examples


def evaluate(eval_step, params, config, mesh: Mesh, name: str = 'test') -> dict[str, float]:
  """The means over the whole of config.test_split of what `eval_step(params, batch)` sums,
  as {name}_METRIC: {name}_accuracy, {name}_top5_accuracy (more than TOP_K classes) and
  {name}_loss of supervised.make_eval_step, or {name}_mpp_loss and {name}_mpp_accuracy of
  mpp.make_eval_step. Where the step returns per-example arrays (supervised.EXAMPLES:
  multi-label data), they are kept on the host, and {name}_mAP is the mean average precision
  of all examples (supervised.mean_average_precision)."""
  totals, examples = summed(eval_step, params, config, mesh)
  metrics = {f'{name}_{EVAL_NAMES.get(key, key)}': float(total / totals['count'])
             for key, total in totals.items() if key != 'count'}
  if examples:
    scores, labels = (np.concatenate(parts) for parts in zip(*examples))
    metrics[f'{name}_mAP'] = supervised.mean_average_precision(scores, labels)
  return metrics


def evaluation_line(name: str, metrics: dict[str, float]) -> str:
  """'NAME accuracy A (top-5 B), EMA C, NAME loss L'; on multi-label data 'NAME mAP M,
  precision@1 P, EMA mAP E, NAME loss L'; or for other metrics 'NAME metric V, ...'."""
  if f'{name}_mAP' in metrics:
    ema = metrics.get(f'{name}_mAP_ema')
    return (f'{name} mAP {metrics[f"{name}_mAP"]:.4f}, precision@1 '
            f'{metrics[f"{name}_precision_at_1"]:.4f}'
            f'{"" if ema is None else f", EMA mAP {ema:.4f}"}, {name} loss '
            f'{metrics[f"{name}_loss"]:.4f}')
  if f'{name}_accuracy' in metrics:
    accuracy, loss = metrics[f'{name}_accuracy'], metrics[f'{name}_loss']
    top5, ema = metrics.get(f'{name}_top5_accuracy'), metrics.get(f'{name}_accuracy_ema')
    return (f'{name} accuracy {accuracy:.4f}{"" if top5 is None else f" (top-5 {top5:.4f})"}'
            f'{"" if ema is None else f", EMA {ema:.4f}"}, {name} loss {loss:.4f}')
  return ', '.join(f'{key.replace("_", " ")} {value:.4f}' for key, value in metrics.items())


def data_config(entry: ml_collections.ConfigDict,
                config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The run's `config` with the entry's data: its split as test_split (what the input
  pipeline evaluates), and its dataset, batch_eval and pp fields where it sets them."""
  config = config.copy_and_resolve_references()
  config.test_split = entry.split
  for field in ('dataset', 'batch_eval'):
    if entry.get(field) is not None:
      config[field] = entry[field]
  config.pp.update(entry.get('pp') or {})
  return config


def objective_error(where: str, kind: str, objective: str,
                    config: ml_collections.ConfigDict) -> str | None:
  """Why an entry of type `kind`, which evaluates models trained with `objective` only, cannot
  run in the run of `config`, or None where it can; one line."""
  if config.objective == objective:
    return None
  return (f'{where}.type={kind!r} evaluates a model trained with --config.objective={objective}; '
          f"this run's objective is {config.objective!r}: use type 'classification'.")


class ClassificationEvaluator:
  """Evaluates the params with `eval_step` (here: the classifier's) on the entry's data."""

  def __init__(self, name: str, entry: ml_collections.ConfigDict,
               config: ml_collections.ConfigDict, model, mesh: Mesh):
    self.name, self.mesh = name, mesh
    self.every = entry.get('every') or config.eval_every
    self.data = data_config(entry, config)
    from vit_jax.data import pipeline
    if (self.data.dataset, self.data.test_split) != (config.dataset, config.test_split):
      try:  # The run's own test split was checked with its training data.
        pipeline.get_dataset_info(self.data)
      except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f'config.evals.{name}.split={entry.split!r}: {e}') from None
    self.data.batch_eval = pipeline.eval_batch_size(self.data, mesh)
    self.eval_step = jax.jit(self.make_eval_step(model, config))

  @staticmethod
  def make_eval_step(model, config: ml_collections.ConfigDict):
    """eval(params, batch) -> sums of correct, loss (config.loss), count
    (supervised.make_eval_step)."""
    return supervised.make_eval_step(model, config.loss)

  @staticmethod
  def is_on(entry: ml_collections.ConfigDict) -> bool:
    return entry.get('split') is not None

  @staticmethod
  def config_error(where: str, entry: ml_collections.ConfigDict,
                   config: ml_collections.ConfigDict) -> str | None:
    del where, entry, config
    return None

  def run(self, params) -> dict[str, float]:
    return evaluate(self.eval_step, params, self.data, self.mesh, self.name)

  def line(self, metrics: dict[str, float], seconds: float) -> str:
    del seconds
    return evaluation_line(self.name, metrics)

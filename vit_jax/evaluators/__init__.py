"""Evaluators as plug-ins: each entry of `config.evals` names a `type` whose Evaluator runs it.

    config.evals = {NAME: {'type': TYPE, 'every': STEPS, <the type's data fields>}, ...}

TYPES maps each type to its class: 'classification' (accuracy and loss on a split,
evaluators/classification.py), 'mpp' (masked patch prediction's loss and accuracy,
evaluators/mpp.py), 'segmentation' (pixel accuracy and mean IoU, evaluators/segmentation.py)
and 'fewshot' (linear k-shot accuracy of the frozen features, evaluators/fewshot.py). An entry's
type None is the objective's (its task's `evaluator`, vit_jax.tasks): 'mpp' under
masked_patch_prediction, 'segmentation' under segmentation, else 'classification'. Each evaluator
names its metrics after its entry (NAME_accuracy, NAME/DATASET_5shot), so that the default
entries 'test', 'val' and 'fewshot' report what they always have. The training loop runs the
evaluators that are due (`is_due`), on the params and, where the run keeps one, on their EMA.

The fields `config.val_split`, `config.val_every` and `config.fewshot.*` are deprecated:
`migrate` moves them into `config.evals` with one log line that says what to write instead.
"""
import logging
from typing import Any, Protocol

import ml_collections

from vit_jax import tasks
from vit_jax.config import checks
from vit_jax.evaluators import classification
from vit_jax.evaluators import fewshot
from vit_jax.evaluators import mpp
from vit_jax.evaluators import segmentation


class Evaluator(Protocol):
  """One entry of config.evals, ready to run on the params of the model it was built for."""

  name: str  # The entry's name in config.evals, the prefix of its metrics.
  every: int  # Steps between its evaluations (it also runs after the last step).

  def run(self, params: Any) -> dict[str, float]:
    """{metric name: value} of `params` (a pytree of the model's parameters)."""

  def line(self, metrics: dict[str, float], seconds: float) -> str:
    """The console text of `metrics` (those of `run`, EMA's included), `seconds` to compute."""


TYPES = {'classification': classification.ClassificationEvaluator,
         'mpp': mpp.MppEvaluator,
         'segmentation': segmentation.SegmentationEvaluator,
         'fewshot': fewshot.FewshotEvaluator}


def type_of(entry: ml_collections.ConfigDict, config: ml_collections.ConfigDict) -> str:
  """The entry's type; None is the objective's ('mpp' under masked_patch_prediction)."""
  if entry.get('type'):
    return entry.type
  return tasks.for_config(config).evaluator


def config_error(config: ml_collections.ConfigDict) -> str | None:
  """Why an entry of config.evals, the deprecated fields moved in (`migrate`), cannot run (an
  unknown type, or the type's own check), or None; one line."""
  if moved := deprecated(config):
    config = config.copy_and_resolve_references()
    move(config, moved)
  for name, entry in config.evals.items():
    kind = type_of(entry, config)
    if kind not in TYPES:
      return f'config.evals.{name}.type={kind!r} is not one of {tuple(TYPES)}.'
    if error := TYPES[kind].config_error(f'config.evals.{name}', entry, config):
      return error
  return None


def build(config: ml_collections.ConfigDict, model, mesh) -> list[Evaluator]:
  """The evaluators of the entries of config.evals that are on, for `model` on `mesh`, by
  entry name (as config.evals lists them), the few-shot ones, the slowest, last; raises
  ConfigError (naming the entry) where an entry's data does not exist."""
  built = []
  for name, entry in config.evals.items():
    kind = TYPES[type_of(entry, config)]
    if kind.is_on(entry):
      built.append(kind(name, entry, config, model, mesh))
  return sorted((evaluator for evaluator in built if evaluator.every),
                key=lambda evaluator: isinstance(evaluator, fewshot.FewshotEvaluator))


def is_due(evaluator: Evaluator, step: int, total_steps: int) -> bool:
  """Whether `evaluator` runs after `step`: every `evaluator.every` steps, and after the last
  (`total_steps`, or a later step of a run trained further before)."""
  return step % evaluator.every == 0 or step >= total_steps


def deprecated(config: ml_collections.ConfigDict) -> dict[str, tuple[str, Any]]:
  """{old field: (its field in config.evals, value)} of the deprecated fields set in `config`
  (None: unset): config.val_split, config.val_every (with val_split only), config.fewshot.*."""
  old = {'val_split': 'val.split', 'val_every': 'val.every',
         **{f'fewshot.{field}': f'fewshot.{field}' for field in config.fewshot}}
  return {name: (field, value) for name, field in old.items()
          if (value := checks.field_at(config, name)) is not None
          and (name != 'val_every' or config.val_split)}


def move(config: ml_collections.ConfigDict, moved: dict[str, tuple[str, Any]]) -> None:
  """Sets the fields of config.evals to the values of `moved` (`deprecated`), and unsets the
  old fields."""
  for name, (field, value) in moved.items():
    entry, key = field.split('.')
    config.evals[entry][key] = value
    parent, _, leaf = name.rpartition('.')
    (config[parent] if parent else config)[leaf] = None


def migrate(config: ml_collections.ConfigDict) -> None:
  """Moves the deprecated fields set in `config` into config.evals (`move`), and logs one
  warning that lists what to write instead; nothing where none is set."""
  if moved := deprecated(config):
    move(config, moved)
    logging.warning('Deprecated: %s; write %s instead (docs/evaluation.md, "Evaluators").',
                    ', '.join(f'config.{name}' for name in moved),
                    ' '.join(f'--config.evals.{field}={_flag_value(value)}'
                             for field, value in moved.values()))


def _flag_value(value) -> str:
  """`value` as a shell command line writes it: strings in single quotes, sequences as tuples
  in double quotes."""
  return f'"{tuple(value)!r}"' if isinstance(value, (tuple, list)) else repr(value)

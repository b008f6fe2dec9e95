"""Objectives as tasks: `config.objective` names one of TASKS, which wraps the model to train,
gives its loss, evaluation step and default evaluator, and names the parameters it adds
(vit_jax.tasks.task.Task).

- 'supervised' (supervised.py): classification of the labels.
- 'masked_patch_prediction' (mpp.py): self-supervised pre-training, labels unused.
- 'segmentation' (segmentation.py): a class per pixel, from labels per pixel.

    task = tasks.for_config(config)
    model = task.model(vit_model, config)
    loss_fn = task.train_loss(model, config)  # (params, batch, rng) -> (loss, metrics)
"""
import ml_collections

from vit_jax.tasks import mpp
from vit_jax.tasks import segmentation
from vit_jax.tasks import supervised
from vit_jax.tasks.task import Task

TASKS: dict[str, Task] = {'supervised': supervised.TASK, 'masked_patch_prediction': mpp.TASK,
                          'segmentation': segmentation.TASK}
OBJECTIVES = tuple(TASKS)
# What any task adds to the published layout: what fine-tuning drops where the model lacks it.
EXTRA_PARAM_PREFIXES = tuple(prefix for task in TASKS.values()
                             for prefix in task.extra_param_prefixes)


def get(name: str) -> Task:
  """The task of objective `name`; a ValueError naming the objectives for another name."""
  if name not in TASKS:
    raise ValueError(objective_error(name))
  return TASKS[name]


def for_config(config: ml_collections.ConfigDict) -> Task:
  """The task of `config.objective`."""
  return get(config.objective)


def objective_error(name: str) -> str:
  """The one line that says `name` is no objective."""
  return f'config.objective={name!r} is not one of {OBJECTIVES}.'


def config_error(config: ml_collections.ConfigDict) -> str | None:
  """Why config.objective, or the fields of its task, cannot work, or None where they can; one
  line."""
  if config.objective not in TASKS:
    return objective_error(config.objective)
  return TASKS[config.objective].config_error(config)


def spec_of(config: ml_collections.ConfigDict) -> dict:
  """What a model spec of model.npz records of the objective, for `saved_model`:
  {'objective': name} and, for a task with a `config_section`, that section as a dict."""
  section = for_config(config).config_section
  return {'objective': config.objective,
          **({section: config[section].to_dict()} if section else {})}


def saved_model(model, spec: dict):
  """The VisionTransformer `model` of a saved `spec` as the task of its objective wraps it
  (`spec_of`); the model itself for specs without an objective (supervised runs, older files)."""
  objective = spec.get('objective', 'supervised')
  section = get(objective).config_section
  # What the task's model reads of the run's config: its section, and config.loss (the head's
  # bias init).
  config = ml_collections.ConfigDict({'objective': objective,
                                      'loss': spec.get('loss', supervised.DEFAULT_LOSS),
                                      **({section: spec.get(section, {})} if section else {})})
  return get(objective).model(model, config)

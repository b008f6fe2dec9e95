"""A run's workdir: its `config.json`, the fields a resume must match (`resume_mismatches`), the
temporary files a killed run leaves behind (`remove_stale_temporaries`), and the files of
something else that a run there would overwrite (`check_holds_no_other_files`).
"""
import json
import logging
import os
from typing import Any

import ml_collections

from vit_jax.checkpoints import npz
from vit_jax.checkpoints import runs
from vit_jax.config import defaults
from vit_jax.data import pipeline
from vit_jax.errors import ConfigError
from vit_jax.errors import WorkdirError
from vit_jax.models import registry


def flatten_config(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """{'pp.crop': 224, ...} with TensorBoard-friendly values, for hparams."""
  return _flatten(config.to_dict())


def _flatten(tree: dict) -> dict[str, Any]:
  """{'a': {'b': 1}} -> {'a.b': 1}; values other than int, float, str and bool as str."""
  flat = {}

  def visit(prefix, value):
    if isinstance(value, dict):
      for key, sub in value.items():
        visit(f'{prefix}{key}.', sub)
    else:
      flat[prefix[:-1]] = value if isinstance(value, (int, float, str, bool)) else str(value)

  visit('', tree)
  return flat


# The config fields a checkpoint's shapes depend on; the data order's are input_pipeline's.
STATE_FIELDS = ('model', 'pp.crop', 'dataset', 'optimizer', 'scan_layers', 'posemb', 'objective',
                'mpp.target', 'frozen')


# Fields newer than some saved config.json files: a config that lacks one holds its default
# (`added_field_defaults`), the value that behaves as the versions without the field did.
ADDED_FIELDS = ('model.transformer.stochastic_depth', 'model.transformer.stochastic_depth_schedule',
                'posemb', 'objective', 'mpp.target', 'frozen')


def added_field_defaults() -> dict[str, Any]:
  """{field of ADDED_FIELDS: its default}: the registry's TRANSFORMER_DEFAULTS for the model's
  fields, config.training_defaults() for the others."""
  flat = _flatten({**defaults.training_defaults().to_dict(),
                   'model': {'transformer': registry.TRANSFORMER_DEFAULTS}})
  return {field: flat[field] for field in ADDED_FIELDS}


def resume_mismatches(config: ml_collections.ConfigDict, workdir: str) -> list[str]:
  """The fields fixing the checkpoints' shapes or data order that differ between
  `WORKDIR/config.json` and `config`, as 'field (saved X, now Y)'; [] without a config.json.
  A ConfigError where config.json does not read (`runs.read_run_config`)."""
  try:
    saved = runs.read_run_config(workdir)
  except npz.CheckpointError as e:
    raise ConfigError(str(e)) from None
  if saved is None:
    return []
  added = added_field_defaults()
  saved = {**added, **_flatten(saved)}
  now = {**added, **_flatten(json.loads(config.to_json_best_effort()))}
  fields = STATE_FIELDS + pipeline.ORDER_FIELDS
  return [f'{key} (saved {saved.get(key)!r}, now {now.get(key)!r})'
          for key in sorted(saved.keys() | now.keys())
          if any(key == f or key.startswith(f + '.') for f in fields)
          and saved.get(key) != now.get(key)]


# What a run writes through WORKDIR/NAME.tmp files (`write_config`, `npz.save`).
WRITTEN_THROUGH_TMP = (runs.RUN_CONFIG, runs.WORKDIR_MODEL, 'model_raw.npz')
# What a run writes in its workdir under fixed names, which a run would overwrite.
RUN_FILES = WRITTEN_THROUGH_TMP + (runs.CHECKPOINTS,)


def holds_a_run(workdir: str) -> bool:
  """Whether `workdir` holds a vit_jax run: a step folder of its checkpoints, or the config.json
  of a run (one with `total_steps`; a damaged one counts, and its own line reports it)."""
  if runs.checkpoint_steps(workdir):
    return True
  try:
    saved = runs.read_run_config(workdir)
  except npz.CheckpointError:
    return True
  return saved is not None and 'total_steps' in saved


def check_holds_no_other_files(workdir: str) -> None:
  """A WorkdirError where `workdir` holds a file of RUN_FILES but no vit_jax run (`holds_a_run`):
  a user's own model.npz or config.json, which the run would overwrite."""
  paths = [os.path.join(workdir, name) for name in RUN_FILES]
  found = [os.path.basename(path) for path in paths  # An empty folder holds nothing to lose.
           if os.path.lexists(path) and not (os.path.isdir(path) and not os.listdir(path))]
  if found and not holds_a_run(workdir):
    them = ', '.join(found)
    raise WorkdirError(f'{workdir} holds {them} but no checkpoint or config of a vit_jax run, and '
                       f'a run there would overwrite {"it" if len(found) == 1 else "them"}: give '
                       f'another --workdir, or move {them} away.')


def remove_stale_temporaries(workdir: str) -> None:
  """Removes the WORKDIR/NAME.tmp of WRITTEN_THROUGH_TMP that a killed run left half-written."""
  for name in WRITTEN_THROUGH_TMP:
    path = os.path.join(workdir, name + '.tmp')
    if os.path.exists(path):
      os.remove(path)
      logging.info('Removed %s, left half-written by a run that was stopped.', path)


def write_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """Writes `WORKDIR/config.json` (through a temporary file: never half a file)."""
  path = os.path.join(workdir, 'config.json')
  with open(path + '.tmp', 'w') as f:
    f.write(config.to_json_best_effort(indent=2))
  os.replace(path + '.tmp', path)

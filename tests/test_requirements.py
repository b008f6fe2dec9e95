"""Tests of the installed requirements: what the README's commands import resolves, and a tfds
dataset prepares and trains by name without the internet, as `cifar10` does with it.
"""
import ast
import glob
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import tensorflow_datasets as tfds

import tiny_tfds
from vit_jax.training import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, 'tests')
# tfds's catalogue of optional extras (apache_beam, pandas, ...), imported only by the datasets
# that need them.
TFDS_OPTIONAL_EXTRAS = 'tensorflow_datasets.core.utils.lazy_imports_utils'


def readme_modules() -> set[str]:
  """The modules the commands of the README and docs/ run (`python -m M`) and their Python
  examples import."""
  readme = ''
  for path in ['README.md', *sorted(glob.glob('docs/*.md', root_dir=ROOT))]:
    with open(os.path.join(ROOT, path)) as f:
      readme += f.read()
  modules = set(re.findall(r'python -m ([\w.]+)', readme))
  code = '\n'.join(re.findall(r'^```.*?\n(.*?)^```', readme, re.MULTILINE | re.DOTALL))
  modules.update(re.findall(r'^import ([\w.]+)', code, re.MULTILINE))
  for package, names in re.findall(r'^from ([\w.]+) import ([\w, ]+)$', code, re.MULTILINE):
    modules.update(f'{package}.{name.split()[0]}' for name in names.split(','))
  return modules


def lazy_imports(module) -> set[str]:
  """The modules that `module`'s `with epy.lazy_imports(): import ...` blocks import on first
  use (an ImportError there surfaces only when a dataset is prepared)."""
  with open(module.__file__) as f:
    tree = ast.parse(f.read())
  names = set()
  for block in ast.walk(tree):
    if isinstance(block, ast.With) and any(
        'lazy_imports' in ast.unparse(item.context_expr) for item in block.items):
      for node in ast.walk(block):
        if isinstance(node, ast.Import):
          names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
          names.add(node.module)
  return names


def tfds_lazy_imports_after(modules: set[str]) -> set[str]:
  """What the tensorflow_datasets modules loaded by importing `modules` import lazily."""
  for name in modules:
    importlib.import_module(name)
  lazy = set()
  for name, module in list(sys.modules.items()):
    if (name.startswith('tensorflow_datasets') and name != TFDS_OPTIONAL_EXTRAS
        and (getattr(module, '__file__', None) or '').endswith('.py')):
      lazy |= lazy_imports(module)
  return lazy


def test_readme_commands_and_tfds_lazy_imports_resolve():
  modules = readme_modules()
  assert {'vit_jax.main', 'vit_jax.predict', 'vit_jax.visualize', 'vit_jax.models'} <= modules
  # In a fresh interpreter: what the README's commands load, not what other tests loaded.
  result = subprocess.run(
      [sys.executable, '-c', 'import json, sys, test_requirements as t; '
       'print(json.dumps(sorted(t.tfds_lazy_imports_after(set(sys.argv[1:])))))', *modules],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env={**os.environ, 'PYTHONPATH': os.pathsep.join([ROOT, TESTS])})
  assert result.returncode == 0, result.stderr
  lazy = json.loads(result.stdout.splitlines()[-1])
  assert 'importlib_resources' in lazy  # What tfds 4.9.10 imports to prepare a dataset.
  missing = sorted(name for name in lazy if importlib.util.find_spec(name) is None)
  assert not missing, f'Not installed, but tfds imports them lazily: {missing}'


def test_tfds_dataset_prepares_and_trains_by_name(tmp_path):
  # Importing tiny_tfds (above) registered its builder, as `--config=tests/tiny_tfds.py` does.
  data_dir, workdir = tmp_path / 'tfds', tmp_path / 'workdir'
  config = tiny_tfds.get_config()
  config.update(dict(dataset='tiny_fashion_mnist', tfds_data_dir=str(data_dir), test_split='test',
                     batch=8, batch_eval=8, total_steps=4, progress_every=2, eval_every=4,
                     checkpoint_every=4))
  trainer.train_and_evaluate(config, str(workdir))
  # tfds reads back what the run prepared: the builder's splits, under the given data_dir.
  prepared = tfds.builder('tiny_fashion_mnist', data_dir=str(data_dir))
  assert prepared.is_prepared()
  assert {name: split.num_examples for name, split in prepared.info.splits.items()} == (
      tiny_tfds.SPLIT_SIZES)
  with np.load(workdir / 'model.npz') as params:
    assert params['head/kernel'].shape[-1] == 10

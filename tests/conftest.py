"""Test setup: 8 simulated CPU devices and one XLA compilation cache, set before anything
imports jax; shared fixtures. The helpers that test files import are in helpers.py.
"""
import atexit
import os
import shutil
import tempfile

import pytest

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
# The tests compile the same tiny programs many times, in this process and in the command-line
# processes they start (which inherit the environment): each compiles once. The cache starts
# empty in every session, as in a fresh clone.
_CACHE = tempfile.mkdtemp(prefix='vit_jax_tests_xla_cache_')
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', _CACHE)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')


@pytest.fixture(scope='session')
def trained_run(tmp_path_factory):
  """(workdir, final metrics) of one run of tests/tiny_config.py (60 steps, checkpoints of steps
  40 and 60 kept, model.npz), trained once for every test that reads what a run writes."""
  import helpers  # pylint: disable=g-import-not-at-top (after the environment above)
  from vit_jax import train  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp('trained_run'))
  return workdir, train.train_and_evaluate(helpers.tiny_config(), workdir)

"""Test setup: 4 simulated CPU devices, quick XLA compilation, one XLA compilation cache and this
checkout first on the path, set before anything imports jax; shared fixtures. The helpers that
test files import are in helpers.py.
"""
import atexit
import fcntl
import gc
import json
import os
import shutil
import tempfile

import pytest

from quick_compile import QUICK_COMPILE

# quick_compile.py's options and 4 simulated devices, for this session and the processes it starts
# (those with other devices keep the options: helpers.xla_flags).
_DEVICES = '--xla_force_host_platform_device_count'
os.environ['XLA_FLAGS'] = ' '.join(
    [flag for flag in os.environ.get('XLA_FLAGS', '').split()
     if flag not in QUICK_COMPILE and not flag.startswith(_DEVICES)]
    + list(QUICK_COMPILE) + [f'{_DEVICES}=4'])
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# The processes the tests start import the vit_jax of this checkout, as pytest does, whichever
# checkout an install elsewhere on sys.path points to.
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ['PYTHONPATH'] = os.pathsep.join(
    [_CHECKOUT] + [path for path in os.environ.get('PYTHONPATH', '').split(os.pathsep)
                   if path and path != _CHECKOUT])
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
# The tests compile the same tiny programs many times, in this process, in pytest-xdist's workers
# and in the command-line processes they start (all inherit the environment): each compiles once.
# The cache starts empty in every session, as in a fresh clone, and the process that made it
# removes it.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  os.environ['JAX_COMPILATION_CACHE_DIR'] = tempfile.mkdtemp(prefix='vit_jax_tests_xla_cache_')
  atexit.register(shutil.rmtree, os.environ['JAX_COMPILATION_CACHE_DIR'], ignore_errors=True)
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')


def pytest_sessionfinish():
  """As vit_jax.main does at exit (where it saved 1.2 to 3 s a process): the exit's garbage
  collection skips the objects of the libraries imported, TensorFlow's and JAX's."""
  gc.freeze()


@pytest.fixture(scope='session')
def trained_run(tmp_path_factory, worker_id):
  """(workdir, final metrics) of one run of tests/tiny_config.py (60 steps, checkpoints of steps
  40 and 60 kept, model.npz), trained once for every test that reads what a run writes.

  Under pytest-xdist, the first worker that needs it trains it in the session's folder, which all
  workers share, while the others wait on a file lock; then each reads the metrics it saved.
  """
  if worker_id == 'master':  # One process: nothing to share.
    workdir = str(tmp_path_factory.mktemp('trained_run'))
    return workdir, train_tiny_run(workdir)
  shared = tmp_path_factory.getbasetemp().parent  # This session's, above each worker's own.
  metrics_file = shared / 'trained_run_metrics.json'
  with open(shared / 'trained_run.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not metrics_file.exists():
      metrics = train_tiny_run(str(shared / 'trained_run'))
      metrics_file.write_text(json.dumps({name: float(value) for name, value in metrics.items()}))
  return str(shared / 'trained_run'), json.loads(metrics_file.read_text())


def train_tiny_run(workdir: str) -> dict[str, float]:
  """The final metrics of the tiny run, trained in `workdir`."""
  import helpers  # After the environment above.
  from vit_jax.training import trainer
  return trainer.train_and_evaluate(helpers.tiny_config(), workdir)


def pytest_xdist_auto_num_workers(config):
  """One pytest-xdist worker per core, at most 4: the suite is CPU-bound, and a worker beyond the
  cores, meant to fill the time the suite waits on its processes (signals, heartbeats, a killed
  peer), costs more in imports and tracing of its own than those waits leave idle
  (docs/testing.md)."""
  del config
  return min(4, os.cpu_count() or 1)

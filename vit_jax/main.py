"""Trains or fine-tunes a ViT: `python -m vit_jax.main [--config=FILE[:ARG]] [--workdir=DIR]`.

Without `--config`, trains the default small ViT on the embedded Fashion-MNIST
(configs/default.py). Every config field can be overridden: `--config.base_lr=0.01`.
"""
import datetime
import functools
import logging
import os
import sys
import tempfile

from absl import app
from absl import flags
import jax
from ml_collections import config_flags

import configs
from vit_jax import console
from vit_jax import hardware

DEFAULT_CONFIG = os.path.join(os.path.dirname(configs.__file__), 'default.py')

config_flags.DEFINE_config_file(
    'config', DEFAULT_CONFIG, 'Config file, optionally with an argument: configs/vit.py:b16,cifar10',
    lock_config=True)
flags.DEFINE_string('coordinator_address', os.environ.get('JAX_COORDINATOR_ADDRESS'),
                    'host:port of process 0, for multi-process runs that JAX does not detect '
                    'by itself (env JAX_COORDINATOR_ADDRESS).')
flags.DEFINE_integer('num_processes', int(os.environ.get('JAX_NUM_PROCESSES', 0)) or None,
                     'Number of processes (env JAX_NUM_PROCESSES).')
flags.DEFINE_integer('process_id', int(os.environ.get('JAX_PROCESS_ID', -1)),
                     'This process\'s index (env JAX_PROCESS_ID).')
flags.DEFINE_string('workdir', None, 'Where checkpoints, metrics and model.npz go. A workdir '
                    'holding a checkpoint resumes from it. Default: a fresh folder under '
                    './workdirs.')
flags.DEFINE_bool('log_all', False, 'Show every library\'s INFO lines in absl\'s format (as '
                  '--verbosity=1 does); by default the console shows vit_jax\'s lines and other '
                  'libraries\' warnings, and a live progress bar on a terminal.')


def fresh_workdir() -> str:
  stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
  return tempfile.mkdtemp(prefix=f'{stamp}-', dir=os.makedirs('workdirs', exist_ok=True) or
                          'workdirs')


# Variables by which clusters that jax.distributed.initialize() detects by itself announce
# more than one process (Slurm, Open MPI, multi-host TPU slices).
CLUSTER_SIZE_VARIABLES = ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE')


def initialize_distributed() -> bool:
  """Starts JAX's multi-process runtime when this is one of several processes; returns whether
  it did."""
  if flags.FLAGS.coordinator_address:
    jax.distributed.initialize(flags.FLAGS.coordinator_address, flags.FLAGS.num_processes,
                               flags.FLAGS.process_id)
  elif (any(int(os.environ.get(v, 1)) > 1 for v in CLUSTER_SIZE_VARIABLES)
        or ',' in os.environ.get('TPU_WORKER_HOSTNAMES', '')):
    jax.distributed.initialize()
  else:
    return False
  return True


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  console.setup(log_all=flags.FLAGS.log_all or flags.FLAGS.verbosity >= 1)
  from vit_jax import train  # pylint: disable=g-import-not-at-top  (it imports TensorFlow)
  if not initialize_distributed():  # One process: on a CPU host, one device per core.
    hardware.use_one_device_per_core(functools.partial(train.fits_devices, flags.FLAGS.config))
  if jax.process_count() > 1:
    if not flags.FLAGS.workdir:
      sys.exit('--workdir is required with several processes: they must share one folder.')
    if jax.process_index() > 0:  # Process 0 speaks for all.
      logging.getLogger().setLevel(logging.WARNING)
  workdir = flags.FLAGS.workdir or fresh_workdir()
  logging.info('Workdir: %s', os.path.abspath(workdir))
  try:
    metrics = train.train_and_evaluate(flags.FLAGS.config, workdir)
  except train.ConfigError as e:
    sys.exit(f'Config error: {e}')
  except train.NonFiniteError as e:
    sys.exit(f'Training stopped: {e}')
  logging.info('Done: %s', ', '.join(f'{k} {v:.4g}' for k, v in sorted(metrics.items())))


if __name__ == '__main__':
  hardware.keep_freed_host_memory()
  app.run(main)

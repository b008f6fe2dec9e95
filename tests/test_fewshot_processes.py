"""Few-shot evaluation in training under JAX's multi-process runtime: 2 processes x 2 CPU devices.

The worker (`python tests/test_fewshot_processes.py ADDRESS PROCESS_ID OUT`) evaluates the tiny
model as training does (train.evaluate_fewshot on train.make_mesh), after
jax.distributed.initialize; each process feeds its share of the images.
"""
import functools
import json
import os
import socket
import subprocess
import sys

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import helpers
from vit_jax import train
import tiny_config

pytestmark = pytest.mark.xdist_group('fewshot_processes')  # Its module fixtures are built once.

NUM_PROCESSES = 2
TIMEOUT = 600  # Seconds the worker processes may take together (on a loaded 2-core machine).


def config_and_params():
  """The tiny config with a small few-shot evaluation, and its model's initial params."""
  config = tiny_config.get_config()
  config.batch_eval = 200
  config.fewshot.update(datasets=('fashion_mnist_embedded',), shots=(1, 5), seeds=1,
                        train_split='train[:1000]', num_test=400)
  model = train.build_model(config, num_classes=10)
  init = jax.jit(functools.partial(model.init, train=False))  # One compilation, not one per op.
  params = init(jax.random.key(0), np.zeros((1, 28, 28, 3)))['params']
  return config, model, params


def evaluate(config, model, params) -> dict[str, float]:
  mesh = train.make_mesh(config)
  params = jax.device_put(params, NamedSharding(mesh, P()))  # As in training: on the devices.
  return train.evaluate_fewshot(model, params, config, mesh)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.fixture(scope='module')
def per_process(tmp_path_factory) -> list[dict[str, float]]:
  """The metrics each of the 2 processes got."""
  out = tmp_path_factory.mktemp('processes')
  address = f'127.0.0.1:{free_port()}'
  env = {**os.environ, 'XLA_FLAGS': helpers.xla_flags(2)}
  workers = [subprocess.Popen([sys.executable, __file__, address, str(i), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(NUM_PROCESSES)]
  try:
    logs = [worker.communicate(timeout=TIMEOUT)[0] for worker in workers]
  finally:
    for worker in workers:
      worker.kill()
  assert [w.returncode for w in workers] == [0] * NUM_PROCESSES, '\n\n'.join(logs)
  return [json.loads((out / f'{i}.json').read_text()) for i in range(NUM_PROCESSES)]


def test_every_process_gets_the_same_fewshot_accuracy(per_process):
  assert sorted(per_process[0]) == ['fewshot/fashion_mnist_embedded_1shot',
                                    'fewshot/fashion_mnist_embedded_5shot']
  assert per_process[1] == per_process[0]


def test_two_processes_agree_with_one_process_of_all_devices(per_process):
  single = evaluate(*config_and_params())  # This process: 8 devices.
  # The same shots and test images; the sums add in another order, which may move a held-out
  # image across a decision boundary and with it the choice of L2.
  for name, accuracy in single.items():
    assert per_process[0][name] == pytest.approx(accuracy, abs=0.02)
  assert single['fewshot/fashion_mnist_embedded_5shot'] > 0.3  # Chance is 0.1.


if __name__ == '__main__':
  coordinator, process_id, out_dir = sys.argv[1:]
  jax.distributed.initialize(coordinator, NUM_PROCESSES, int(process_id))
  metrics = evaluate(*config_and_params())
  with open(os.path.join(out_dir, f'{process_id}.json'), 'w') as f:
    json.dump(metrics, f)

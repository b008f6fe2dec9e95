"""The training step of vit_jax.main built on this machine's devices, and several such steps
timed in turns: what benchmarks/param_groups.py and benchmarks/segmentation.py compare.

The steps run in turns, A B ... then ... B A in the next round, so that a drift of the machine's
load, or of the order of compilation, touches all of them alike; the first round warms up and is
not counted.
"""
import statistics
import time

import jax
import numpy as np

from vit_jax import tasks
from vit_jax.training import setup as train_setup
from vit_jax.training import step as train_step

MIB = 2**20


def random_batch(config, num_classes: int, mesh) -> dict:
  """config.batch images in [-1, 1] at config.pp.crop pixels and random labels, per image or,
  where config.objective labels each pixel, per pixel; split over the mesh's 'data' axis."""
  rng = np.random.default_rng(0)
  size = config.pp.crop
  per_pixel = tasks.for_config(config).per_pixel_labels
  labels = (config.batch, size, size) if per_pixel else (config.batch,)
  return jax.device_put(
      {'image': rng.uniform(-1, 1, (config.batch, size, size, 3)).astype(np.float32),
       'label': rng.integers(0, num_classes, labels).astype(np.int32)},
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data')))


def build(config, num_classes: int):
  """(jitted step, train state, batch on the devices, memory_analysis of the compiled step) of
  `config`, as vit_jax.main builds them (build_model, make_optimizer, create_train_state,
  jit_train_step)."""
  model = train_setup.build_model(config, num_classes)
  optimizer = train_step.make_optimizer(config)
  mesh = train_setup.make_mesh(config)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh,
                                                   config.pp.crop)
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  batch = random_batch(config, num_classes, mesh)
  return step, state, batch, step.lower(state, batch).compile().memory_analysis()


def median_step_seconds(built: dict, rounds: int) -> dict[str, float]:
  """{name: median seconds of its step over `rounds` rounds} of the `build` results `built`
  ({name: build(...)}), run in turns after one round of warmup."""
  states = {name: state for name, (_, state, _, _) in built.items()}
  times = {name: [] for name in built}
  names = list(built)
  for round_ in range(rounds + 1):
    for name in names if round_ % 2 == 0 else names[::-1]:
      step, _, batch, _ = built[name]
      start = time.perf_counter()
      states[name], metrics = step(states[name], batch)
      jax.block_until_ready(metrics)
      if round_:
        times[name].append(time.perf_counter() - start)
  return {name: statistics.median(seconds) for name, seconds in times.items()}


def devices_line() -> str:
  """'N KIND devices' of this process."""
  devices = jax.devices()
  return f'{len(devices)} {devices[0].device_kind} devices'

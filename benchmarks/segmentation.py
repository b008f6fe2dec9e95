"""Step time of segmentation against classification, same model, resolution and batch.

Builds the training step of vit_jax.main (build_model, make_optimizer, create_train_state,
jit_train_step on this machine's devices) twice: under `config.objective='supervised'` (the
classifier's head on the class token, a label per image) and `'segmentation'` (the linear head on
every patch token, its logits upsampled bilinearly to the pixels, a label per pixel;
vit_jax/tasks/segmentation.py). The two steps run in turns, in the order A B B A each pair of
rounds, so that a drift of the machine's load, or of the order of compilation, touches both alike.

Prints per objective the median step time (s) and its ratio to the classification step's, and
XLA's temporaries of the compiled step in MiB.

  python benchmarks/segmentation.py                       # the default run's ViT, 56 px, batch 32
  python benchmarks/segmentation.py --model=ViT-S_16 --image_size=224 --batch=8
"""
import argparse
import statistics
import time

import jax
import numpy as np

from vit_jax import hardware
from vit_jax.config import defaults
from vit_jax.training import setup as train_setup
from vit_jax.training import step as train_step

MIB = 2**20
OBJECTIVES = ('supervised', 'segmentation')
DEFAULT_MODEL = 'default'  # --model: the default run's ViT-mini_7 (vit_jax.config.defaults).


def step_config(model_name: str, objective: str, batch: int, image_size: int):
  """The default run's config (for DEFAULT_MODEL) or the training defaults of `model_name`,
  with `objective`, global batch `batch` and `image_size` pixels."""
  if model_name == DEFAULT_MODEL:
    config = defaults.get_config()
  else:
    config = defaults.with_model(defaults.training_defaults(), model_name)
  config.update(objective=objective, batch=batch, label_smoothing=0.0)
  config.pp.crop = image_size
  return config


def random_batch(config, num_classes: int, per_pixel: bool, mesh) -> dict:
  """Images in [-1, 1] and labels, per image or per pixel, split over the mesh's 'data' axis."""
  rng = np.random.default_rng(0)
  size = config.pp.crop
  labels = (config.batch, size, size) if per_pixel else (config.batch,)
  return jax.device_put(
      {'image': rng.uniform(-1, 1, (config.batch, size, size, 3)).astype(np.float32),
       'label': rng.integers(0, num_classes, labels).astype(np.int32)},
      jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data')))


def build(config, num_classes: int):
  """(jitted step, train state, batch on the devices, memory_analysis of the compiled step)."""
  model = train_setup.build_model(config, num_classes)
  optimizer = train_step.make_optimizer(config)
  mesh = train_setup.make_mesh(config)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh,
                                                   config.pp.crop)
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  batch = random_batch(config, num_classes, config.objective == 'segmentation', mesh)
  return step, state, batch, step.lower(state, batch).compile().memory_analysis()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model', default=DEFAULT_MODEL,
                      help=f'A registry name, or {DEFAULT_MODEL!r}: the default run\'s ViT.')
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--image_size', type=int, default=56)
  parser.add_argument('--num_classes', type=int, default=11)
  parser.add_argument('--rounds', type=int, default=8, help='Timed steps of each objective.')
  args = parser.parse_args()
  hardware.use_one_device_per_core()
  hardware.keep_freed_host_memory()

  built = {objective: build(step_config(args.model, objective, args.batch, args.image_size),
                            args.num_classes) for objective in OBJECTIVES}
  times = {objective: [] for objective in OBJECTIVES}
  for round_ in range(args.rounds + 1):  # The first round warms up and is not counted.
    for objective in OBJECTIVES if round_ % 2 == 0 else OBJECTIVES[::-1]:
      step, state, batch, memory = built[objective]
      start = time.perf_counter()
      state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      times[objective].append(time.perf_counter() - start)
      built[objective] = (step, state, batch, memory)
  devices = jax.devices()
  print(f'{args.model}, batch {args.batch}, {args.image_size} px, {args.num_classes} classes, '
        f'float32, {len(devices)} {devices[0].device_kind} devices, median of {args.rounds} '
        'steps')
  print(f'{"objective":<14} {"step s":>8} {"x classification":>17} {"temp MiB":>9}')
  reference = statistics.median(times['supervised'][1:])
  for objective in OBJECTIVES:
    median = statistics.median(times[objective][1:])
    print(f'{objective:<14} {median:>8.4f} {median / reference:>17.3f} '
          f'{built[objective][3].temp_size_in_bytes / MIB:>9.1f}')


if __name__ == '__main__':
  main()

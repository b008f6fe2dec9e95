"""A training step's memory as vit_jax predicts it, against what the device then uses.

`vit_jax.main` decides before its first step whether the step fits a device, and `vit_jax.plan`
does the same for a TPU slice, from XLA's `memory_analysis()` of the compiled step
(`vit_jax.training.fit.memory_of`: arguments, outputs not written into donated arguments,
temporaries and code, per device). This compiles and checks the training step of a registry
model at a batch as `main` does (`fit.checked_train_step`; bfloat16 compute, AdamW: the train
case of benchmarks/gpu.py), takes that prediction, then runs the same compiled step on random
images and reads the device's own count of the most bytes it held at once
(`memory_stats()['peak_bytes_in_use']`, where the backend reports it: GPUs and TPUs; the CPU
does not).

    PYTHONPATH=. python benchmarks/step_memory.py                  # ViT-B_16, batch 256, 224 px
    PYTHONPATH=. python benchmarks/step_memory.py --model ViT-L_16 --batch 128 --out memory.jsonl

Needs jax, flax, optax and ml_collections only, as benchmarks/gpu.py does.
"""
import argparse
import dataclasses
import json

import jax

from vit_jax import hardware
from vit_jax.console import readable_bytes
from vit_jax.tools import inference_time
from vit_jax.training import fit
from vit_jax.training import setup as train_setup
from vit_jax.training import step as train_step


def measure(model_name: str, batch: int, image_size: int, steps: int) -> dict:
  """The predicted bytes of the step on this machine's first device (fit.StepMemory's fields and
  total) and, where the device reports them, its peak and limit in bytes after `steps` steps."""
  config = inference_time.train_config(model_name, batch, 'bfloat16', 'adamw')
  config.pp.crop = image_size
  mesh = train_setup.make_mesh(config, jax.devices()[:1])
  model = train_setup.build_model(config, inference_time.NUM_CLASSES, list(mesh.devices.flat))
  optimizer = train_step.make_optimizer(config)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh, image_size)
  # Compiled and checked as main does before its first step; the same program then runs.
  step = fit.checked_train_step(config, model, optimizer, mesh, shardings, state)
  predicted = fit.memory_of(step)
  batch_arrays = inference_time.random_batch(batch, image_size, mesh)
  for _ in range(steps):
    state, metrics = step(state, batch_arrays)
  jax.block_until_ready(metrics)
  device = mesh.devices.flat[0]
  stats = device.memory_stats() or {}
  return {'model': model_name, 'batch': batch, 'image_size': image_size, 'dtype': 'bfloat16',
          'optimizer': 'adamw', 'attention': model.attention, 'device': device.device_kind,
          'jax_version': jax.__version__, 'steps': steps,
          'predicted': {**dataclasses.asdict(predicted), 'total_bytes': predicted.total_bytes},
          'peak_bytes_in_use': stats.get('peak_bytes_in_use'),
          'bytes_limit': stats.get('bytes_limit')}


def summary(result: dict) -> str:
  """One line: the prediction, the device's peak and their ratio (or why there is no peak)."""
  predicted = result['predicted']['total_bytes']
  head = (f"{result['model']} b{result['batch']} {result['image_size']} px on "
          f"{result['device']}: predicted {readable_bytes(predicted)} (temporaries "
          f"{readable_bytes(result['predicted']['temp_bytes'])})")
  peak = result['peak_bytes_in_use']
  if peak is None:
    return f'{head}; the device reports no peak'
  return (f"{head}; the device's peak after {result['steps']} steps {readable_bytes(peak)} "
          f'(peak / predicted {peak / predicted:.3f}) of {readable_bytes(result["bytes_limit"])}')


def main(argv=None):
  hardware.skip_absent_tpu()
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--model', default='ViT-B_16')
  parser.add_argument('--batch', type=int, default=256)
  parser.add_argument('--image_size', type=int, default=224)
  parser.add_argument('--steps', type=int, default=3)
  parser.add_argument('--out', help='Append the result to this JSON-lines file.')
  args = parser.parse_args(argv)
  result = measure(args.model, args.batch, args.image_size, args.steps)
  print(summary(result), flush=True)
  if args.out:
    with open(args.out, 'a') as f:
      f.write(json.dumps(result) + '\n')


if __name__ == '__main__':
  main()

"""Compile time and memory of one training step, with and without scanned and remat layers.

For each model and each variant (plain, scan, remat, scan+remat) this builds the training step
of vit_jax.training.trainer (forward, backward, gradient clipping, momentum SGD update, the
train state donated as in training), lowers it for an abstract train state (jax.eval_shape:
nothing is allocated, so ViT-H fits on any machine) and compiles it for this machine's first
device. XLA's `memory_analysis()` of the compiled step gives, in GiB:
  temp:  the step's temporary buffers (activations kept for the backward pass and the like);
  args:  the train state and the batch;  out: the new state and the metrics;
  peak:  args + out - aliased (the donated state is reused) + temp, an upper bound.
`temp x` is a variant's temp relative to the plain step's.

  python benchmarks/memory.py                          # ViT-B_16, ViT-L_16, ViT-H_14
  python benchmarks/memory.py --models ViT-B_16:32     # one model at batch 32
"""
import argparse
import time

import jax
import jax.numpy as jnp

from vit_jax import hardware
from vit_jax.config import defaults
from vit_jax.models import registry
from vit_jax.training import step as train_step
from vit_jax.training import trainer

VARIANTS = {  # name: (scan_layers, rematerialise)
    'plain': (False, False),
    'scan': (True, False),
    'remat': (False, True),
    'scan+remat': (True, True),
}
GIB = 2**30


def step_config(model_name: str, batch: int):
  """The training defaults (vit_jax/config/defaults.py) of `model_name` at global batch `batch`."""
  config = defaults.with_model(defaults.training_defaults(), model_name)
  config.batch = batch
  return config


def compile_step(config, model, image_size: int):
  """(compiled train step, seconds to compile), for an abstract state and batch of `config`."""
  optimizer = train_step.make_optimizer(config)
  mesh = trainer.make_mesh(config, jax.devices()[:1])
  state = jax.eval_shape(
      lambda: train_step.create_train_state(config, model, optimizer, mesh, image_size)[0])
  batch = {'image': jax.ShapeDtypeStruct((config.batch, image_size, image_size, 3), jnp.float32),
           'label': jax.ShapeDtypeStruct((config.batch,), jnp.int32)}
  step = jax.jit(train_step.make_train_step(model, optimizer, config), donate_argnums=0)
  start = time.perf_counter()
  compiled = step.lower(state, batch).compile()
  return compiled, time.perf_counter() - start


def measure(model_name: str, batch: int, variant: str, remat_policy: str,
            image_size: int) -> dict:
  """Compile seconds and memory_analysis sizes (bytes) of one variant's training step."""
  scan_layers, remat = VARIANTS[variant]
  config = step_config(model_name, batch)
  model = registry.get_model(config.model, num_classes=1000, dtype=jnp.dtype(config.dtype),
                           scan_layers=scan_layers, remat_policy=remat_policy if remat else None)
  compiled, seconds = compile_step(config, model, image_size)
  stats = compiled.memory_analysis()
  args, out = stats.argument_size_in_bytes, stats.output_size_in_bytes
  temp, alias = stats.temp_size_in_bytes, stats.alias_size_in_bytes
  return dict(compile_s=seconds, temp=temp, args=args, out=out,
              peak=args + out - alias + temp)


def parse_models(text: str) -> list[tuple[str, int]]:
  """'ViT-B_16:32,ViT-L_16' -> [('ViT-B_16', 32), ('ViT-L_16', 32)] (batch 32 by default)."""
  runs = []
  for item in text.split(','):
    name, _, batch = item.partition(':')
    registry.get_model_config(name)  # A clear error for an unknown name.
    runs.append((name, int(batch or 32)))
  return runs


def main():
  hardware.skip_absent_tpu()  # No libtpu start-up (and its warnings) on a host without TPUs.
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--models', default='ViT-B_16:32,ViT-L_16:32,ViT-H_14:32',
                      help='Comma-separated NAME[:BATCH] (batch 32 by default).')
  parser.add_argument('--variants', default=','.join(VARIANTS),
                      help=f'Comma-separated, of {", ".join(VARIANTS)}.')
  parser.add_argument('--remat_policy', default='nothing_saveable')
  parser.add_argument('--image_size', type=int, default=224)
  args = parser.parse_args()

  variants = args.variants.split(',')
  unknown = set(variants) - set(VARIANTS)
  if unknown:
    parser.error(f'--variants: unknown {sorted(unknown)}; choose of {list(VARIANTS)}.')
  print(f'{jax.devices()[0].device_kind}, {args.image_size} px, float32, '
        f'remat_policy={args.remat_policy}')
  print(f'{"model":<10} {"batch":>5} {"variant":<11} {"compile s":>9} {"temp GiB":>9} '
        f'{"temp x":>7} {"args GiB":>9} {"out GiB":>8} {"peak GiB":>9}')
  for name, batch in parse_models(args.models):
    plain_temp = None
    for variant in variants:
      r = measure(name, batch, variant, args.remat_policy, args.image_size)
      plain_temp = r['temp'] if variant == 'plain' else plain_temp
      ratio = f'{r["temp"] / plain_temp:7.2f}' if plain_temp else f'{"-":>7}'
      print(f'{name:<10} {batch:>5} {variant:<11} {r["compile_s"]:>9.1f} '
            f'{r["temp"] / GIB:>9.2f} {ratio} {r["args"] / GIB:>9.2f} {r["out"] / GIB:>8.2f} '
            f'{r["peak"] / GIB:>9.2f}', flush=True)


if __name__ == '__main__':
  main()

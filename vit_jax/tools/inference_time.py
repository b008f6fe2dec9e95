"""How fast a ViT runs here: images/s, ms per batch, GFLOPs per image, GFLOP/s and MFU.

    python -m vit_jax.inference_time --model ViT-B_16 --batch 8 --image_size 224
    python -m vit_jax.inference_time --model ViT-S_16 --batch 16 --train --out s16_train.json
    python -m vit_jax.inference_time --model ViT-B_16 --batch 64 --dtype bfloat16   # on a GPU

Without --train it times the forward pass (`train=False`) of a batch of random images; with it,
one update step of vit_jax.training.step (forward, backward, optimiser, state donated), as training
jits it, counted as 3x the
forward FLOPs. FLOPs per image are counted from the model's shapes (vit_jax.models.forward_flops),
the same on every backend.
The step is compiled once (the compile time is reported), run once to warm up, then timed in
`--rounds` rounds of back-to-back steps that each last about `--round_seconds` (or one step,
if that is longer). MFU is the achieved FLOP/s over the device's peak for the dtype: the
published dense peak of a known accelerator (vit_jax.hardware), else (CPUs) the rate of a
`--peak_size`-square matmul timed the same way, in rounds as long as the model's, before,
between and after them, so that on a shared machine each model round is set against the peak
under the same load. The figures printed are those of the round of median MFU.

An accelerator benchmark runs on one chip. On a CPU host the command first makes JAX show one
device per core (vit_jax.hardware.use_one_device_per_core, as vit_jax.main does) and runs
the step split over as many of them as divide the batch; the peak's matmul runs on the first
(one XLA:CPU device uses every core for a large matmul).
"""
import argparse
import datetime
import json
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from vit_jax import console
from vit_jax import errors
from vit_jax import hardware
from vit_jax.config import defaults
from vit_jax.models import blank
from vit_jax.models import flops
from vit_jax.models import registry
from vit_jax.models import attention as attention_kernels
from vit_jax.training import step as train_step

Runner = Callable[[int], None]  # run(n): n back-to-back steps, returning once the last is done.
NUM_CLASSES = 1000


def random_images(batch: int, image_size: int) -> jax.Array:
  """(batch, image_size, image_size, 3) float32 values uniform in [-1, 1]."""
  return jax.random.uniform(jax.random.key(0), (batch, image_size, image_size, 3),
                            minval=-1, maxval=1)


def compile_timed(jitted, *args):
  """(the compiled `jitted` for `args`, seconds that lowering and compiling took)."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  return compiled, time.perf_counter() - start


def benchmark_devices(batch: int) -> list:
  """The devices a benchmark of `batch` images runs on: an accelerator's first chip; on a CPU
  host, the most of its devices (one per core after `use_one_device_per_core`) that split
  the batch evenly. (A CPU's peak is the matmul of the first: its threads use every core.)"""
  devices = jax.local_devices()
  if devices[0].platform != 'cpu':
    return devices[:1]
  return devices[:hardware.most_that_fit(len(devices), lambda count: batch % count == 0)]


def inference_runner(model, batch: int, image_size: int, devices) -> tuple[Runner, float]:
  """(a runner of the forward pass on `batch` images split over `devices`, its compile
  seconds); the params are replicated."""
  mesh = Mesh(devices, ('data',))
  images = jax.device_put(random_images(batch, image_size), NamedSharding(mesh, P('data')))
  params = jax.jit(lambda: blank.init_params(model, jax.random.key(0), image_size),
                   out_shardings=NamedSharding(mesh, P()))()
  forward, seconds = compile_timed(
      jax.jit(lambda p, x: model.apply({'params': p}, x, train=False)), params, images)

  def run(n: int) -> None:
    pacer = hardware.Pacer()
    for _ in range(n):
      logits = pacer.step(forward(params, images))
    logits.block_until_ready()

  return run, seconds


def random_batch(batch: int, image_size: int, mesh: Mesh) -> dict[str, jax.Array]:
  """A training batch: `random_images` and labels 0, 1, ... (cycling over NUM_CLASSES), both
  split along 'data' over `mesh`."""
  return jax.device_put({'image': random_images(batch, image_size),
                         'label': jnp.arange(batch) % NUM_CLASSES},
                        NamedSharding(mesh, P('data')))


def train_config(model_name: str, batch: int, dtype: str, optimizer: str):
  """The training defaults of vit_jax/config/defaults.py for `model_name` at `batch`."""
  config = defaults.with_model(defaults.training_defaults(), model_name)
  config.batch, config.dtype, config.optimizer = batch, dtype, optimizer
  return config


def train_runner(config, model, image_size: int, devices) -> tuple[Runner, float]:
  """(a runner of vit_jax.training.step's update step on `config.batch` images, its compile
  seconds).

  The step is jitted as the training loop jits it (`train_step.jit_train_step`): state and
  batch placed on a ('data', 'model') mesh of `devices` along 'data', the batch split over them,
  the state donated, so that each step updates it in place.
  """
  mesh = Mesh(np.asarray(devices).reshape(-1, 1), ('data', 'model'))
  optimizer = train_step.make_optimizer(config)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh, image_size)
  batch = random_batch(config.batch, image_size, mesh)
  step, seconds = compile_timed(
      train_step.jit_train_step(model, optimizer, config, mesh, shardings), state, batch)

  def run(n: int) -> None:
    nonlocal state
    pacer = hardware.Pacer()
    for _ in range(n):
      state, metrics = step(state, batch)
      pacer.step(metrics)  # Not the state: the next step takes (donates) its buffers.
    jax.block_until_ready(metrics)

  return run, seconds


def seconds_per_step(run: Runner, steps: int) -> float:
  start = time.perf_counter()
  run(steps)
  return (time.perf_counter() - start) / steps


def steps_per_round(run: Runner, round_seconds: float) -> tuple[int, float]:
  """(steps that fill about `round_seconds`, at least 1; the seconds they take), sized by one
  (warm-up) step."""
  seconds = seconds_per_step(run, 1)
  steps = max(1, round(round_seconds / seconds))
  return steps, steps * seconds


def timed_rounds(run_model: Runner, run_peak: Runner | None, rounds: int,
                 round_seconds: float) -> list[tuple[float, float | None]]:
  """(model seconds per step, peak seconds per call) of each round.

  Peak rounds, when there is a `run_peak`, last as long as the model's (which can be longer
  than `round_seconds` when one step is) and come before, between and after them; each model
  round takes the mean of the two that enclose it: under a load that drifts, the model and its
  peak are timed under the same one.
  """
  model_steps, model_seconds = steps_per_round(run_model, round_seconds)
  if run_peak is None:
    return [(seconds_per_step(run_model, model_steps), None) for _ in range(rounds)]
  peak_steps, _ = steps_per_round(run_peak, model_seconds)
  peak = [seconds_per_step(run_peak, peak_steps)]
  model = []
  for _ in range(rounds):
    model.append(seconds_per_step(run_model, model_steps))
    peak.append(seconds_per_step(run_peak, peak_steps))
  return [(m, (before + after) / 2) for m, before, after in zip(model, peak, peak[1:])]


def benchmark(model_name: str, batch: int, image_size: int, dtype: str = 'float32',
              train: bool = False, optimizer: str = 'sgd', rounds: int = 5,
              round_seconds: float = 1.0, peak_size: int = 2048, attention: str = 'auto') -> dict:
  """Times the model (and, without a published peak, the matmul); returns the figures.

  They are those of the round of median MFU; `mfu_rounds` lists every round's.
  """
  devices = benchmark_devices(batch)
  device = devices[0]
  attention = attention_kernels.resolve_attention(attention, devices)
  model = registry.get_model(model_name, num_classes=NUM_CLASSES, dtype=jnp.dtype(dtype),
                           attention=attention)
  if train:
    config = train_config(model_name, batch, dtype, optimizer)
    run_model, compile_seconds = train_runner(config, model, image_size, devices)
  else:
    run_model, compile_seconds = inference_runner(model, batch, image_size, devices)
  published = hardware.published_peak_flops(device.device_kind, dtype)
  run_peak = None if published else hardware.matmul_runner(jnp.dtype(dtype), peak_size, device)
  gflops_per_image = (3 if train else 1) * flops.gflops_per_image(model, image_size)
  figures = []
  for step_seconds, peak_seconds in timed_rounds(run_model, run_peak, rounds, round_seconds):
    peak_gflops = published / 1e9 if published else (
        hardware.matmul_flops(peak_size) / peak_seconds / 1e9)
    achieved_gflops = batch / step_seconds * gflops_per_image
    figures.append((achieved_gflops / peak_gflops, step_seconds, achieved_gflops, peak_gflops))
  mfu, step_seconds, achieved_gflops, peak_gflops = sorted(figures)[len(figures) // 2]
  return {
      'model': model_name, 'mode': 'train' if train else 'inference', 'batch': batch,
      'image_size': image_size, 'dtype': dtype, 'optimizer': optimizer if train else None,
      'attention': attention,
      'device': device.device_kind, 'platform': device.platform, 'devices': len(devices),
      'images_per_second': batch / step_seconds, 'ms_per_batch': 1e3 * step_seconds,
      'gflops_per_image': gflops_per_image, 'achieved_gflops': achieved_gflops,
      'peak_gflops': peak_gflops,
      'peak_source': 'published' if published else f'measured {peak_size}^2 matmul',
      'mfu': mfu, 'mfu_rounds': [f[0] for f in figures], 'compile_seconds': compile_seconds,
      'jax_version': jax.__version__,
      'date': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
  }


def format_result(r: dict) -> str:
  what = f'{r["model"]} {r["mode"]}' + (f' ({r["optimizer"]})' if r['optimizer'] else '')
  on = f'{r["devices"]} x {r["device"]}' if r['devices'] > 1 else r['device']
  return (f'{what}, batch {r["batch"]}, {r["image_size"]} px, {r["dtype"]} on {on}:\n'
          f'  {r["images_per_second"]:.2f} images/s, {r["ms_per_batch"]:.1f} ms per batch, '
          f'compiled in {r["compile_seconds"]:.1f} s\n'
          f'  {r["gflops_per_image"]:.2f} GFLOPs per image, {r["achieved_gflops"]:.1f} GFLOP/s '
          f'of {r["peak_gflops"]:.1f} ({r["peak_source"]}): MFU {r["mfu"]:.3f}')


def check_args(args: argparse.Namespace) -> None:
  """Exits with status 1 and a one-line message for an --out that exists, or a model, batch,
  attention kernel or image size that cannot run."""
  if args.model not in registry.MODEL_CONFIGS:
    sys.exit(f'error: --model {args.model!r} is unknown; choose one of '
             f'{", ".join(registry.MODEL_CONFIGS)}.')
  if args.out:
    try:
      errors.prepare_new_output(args.out)
    except errors.OutputError as e:
      sys.exit(f'error: {e}')
  if args.batch < 1 or args.rounds < 1:
    sys.exit(f'error: --batch {args.batch} and --rounds {args.rounds} must be at least 1.')
  if error := attention_kernels.attention_error(args.attention, jax.default_backend()):
    sys.exit(f'error: --{error}')
  if args.attention == 'splash' and not args.train:  # Inference applies the model off a mesh.
    sys.exit('error: --attention=splash runs in training steps (under their mesh) only: add '
             '--train, or choose auto or xla.')
  images = jax.ShapeDtypeStruct((args.batch, args.image_size, args.image_size, 3), jnp.float32)
  try:
    registry.get_model(args.model, num_classes=NUM_CLASSES).check_images(images)
  except ValueError as e:
    sys.exit(f'error: --image_size {args.image_size} does not fit {args.model}: {e}')


def main(argv=None):
  parser = console.command_parser(
      'inference_time', description=__doc__.split('\n')[0],
      formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split('\n', 1)[1])
  parser.add_argument('--model', default='ViT-B_16',
                      help=f'One of: {", ".join(registry.MODEL_CONFIGS)}.')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--image_size', type=int, default=224)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32',
                      help='Computation dtype (parameters stay float32).')
  parser.add_argument('--train', action='store_true',
                      help='Time a training step (forward, backward, optimiser) instead.')
  parser.add_argument('--optimizer', choices=('sgd', 'adamw'), default='sgd',
                      help='With --train: the optimiser of vit_jax.training.trainer.')
  parser.add_argument('--attention', choices=('auto',) + attention_kernels.ATTENTION_KERNELS,
                      default='auto', help="Attention kernel; 'auto': cuDNN's on NVIDIA GPUs; "
                      "'splash': TPUs, with --train.")
  parser.add_argument('--rounds', type=int, default=5,
                      help='Timed rounds; the figures are those of the round of median MFU.')
  parser.add_argument('--round_seconds', type=float, default=1.0,
                      help='About how long each timed round runs (at least one step).')
  parser.add_argument('--peak_size', type=int, default=2048,
                      help='Side of the matmul that measures the peak where none is published.')
  parser.add_argument('--out', help='Also write the figures as one JSON object to this new file.')
  args = parser.parse_args(argv)
  hardware.use_one_device_per_core(lambda count: args.batch % count == 0)
  check_args(args)
  result = benchmark(args.model, args.batch, args.image_size, args.dtype, args.train,
                     args.optimizer, args.rounds, args.round_seconds, args.peak_size,
                     args.attention)
  print(format_result(result))
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(result, f, indent=2)
    print(f'Wrote {args.out}')


if __name__ == '__main__':
  hardware.keep_freed_host_memory()
  console.run(main)

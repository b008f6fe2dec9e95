"""vit_jax next to timm on one GPU: bfloat16 inference and AdamW training steps, in one run.

    PYTHONPATH=. python benchmarks/gpu.py --out gpu.jsonl           # ViT-B_16 b256, ViT-L_16 b128
    PYTHONPATH=. python benchmarks/gpu.py --tiny --out tiny.jsonl   # the 'testing' model, on a CPU

For each case (ViT-B_16 at batch 256 and ViT-L_16 at batch 128, 224 px; `--tiny`: the
'testing' model at batch 2 and 32 px) it times vit_jax's forward pass and update step
(vit_jax.inference_time.benchmark: bfloat16 compute, float32 parameters, AdamW, attention
'auto'), then, where torch and timm import, timm's same model eager and under `torch.compile`
(bfloat16 autocast, its scaled-dot-product attention, fused AdamW on a GPU, the registry's
dropout). Every measurement is one line of the JSON-lines file `--out`; a table follows.
Needs jax, flax, optax and ml_collections only: no TensorFlow, tensorflow-datasets or clu.
"""
import argparse
import json
import time

import jax

from vit_jax import hardware
from vit_jax.models import registry
from vit_jax.tools import inference_time

# (vit_jax registry name, timm name, batch, image size).
CASES = (('ViT-B_16', 'vit_base_patch16_224', 256, 224),
         ('ViT-L_16', 'vit_large_patch16_224', 128, 224))
TINY_CASES = (('testing', 'vit_tiny_patch16_224', 2, 32),)


def timm_runner(timm_name: str, dropout: float, batch: int, image_size: int, train: bool,
                compiled: bool):
  """(run(n): n back-to-back timm steps on the first CUDA device (else the CPU), then a wait;
  seconds of the first step, compilation included)."""
  import timm  # Optional.
  import torch
  device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
  model = timm.create_model(timm_name, num_classes=inference_time.NUM_CLASSES,
                            img_size=image_size, pos_drop_rate=dropout,
                            proj_drop_rate=dropout).to(device).train(train)
  images = torch.rand(batch, 3, image_size, image_size, device=device) * 2 - 1
  labels = torch.arange(batch, device=device) % inference_time.NUM_CLASSES
  forward = torch.compile(model) if compiled else model
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == 'cuda')

  def step():
    with torch.autocast(device.type, dtype=torch.bfloat16):
      if not train:
        with torch.inference_mode():
          return forward(images)
      loss = torch.nn.functional.cross_entropy(forward(images), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

  def run(n: int) -> None:
    for _ in range(n):
      step()
    if device.type == 'cuda':
      torch.cuda.synchronize()

  start = time.perf_counter()
  run(1)
  return run, time.perf_counter() - start


def timm_versions() -> dict | None:
  """{'torch_version', 'timm_version'} where both import, else None."""
  try:
    import timm
    import torch
  except ImportError:
    return None
  return {'torch_version': torch.__version__, 'timm_version': timm.__version__}


def timm_figures(reference: dict, timm_name: str, compiled: bool, rounds: int,
                 round_seconds: float, versions: dict) -> dict:
  """timm's figures for the case of vit_jax's `reference` result, its FLOPs and peak reused."""
  dropout = registry.get_model_config(reference['model']).transformer.dropout_rate
  run, first_seconds = timm_runner(timm_name, dropout, reference['batch'],
                                   reference['image_size'], reference['mode'] == 'train', compiled)
  seconds = sorted(s for s, _ in inference_time.timed_rounds(run, None, rounds, round_seconds))
  step_seconds = seconds[len(seconds) // 2]
  images_per_second = reference['batch'] / step_seconds
  return {**{k: reference[k] for k in ('model', 'mode', 'batch', 'image_size', 'dtype',
                                       'gflops_per_image', 'peak_gflops')},
          'framework': 'timm ' + ('compile' if compiled else 'eager'), 'timm_model': timm_name,
          'images_per_second': images_per_second, 'ms_per_batch': 1e3 * step_seconds,
          'mfu': images_per_second * reference['gflops_per_image'] / reference['peak_gflops'],
          'first_step_seconds': first_seconds, **versions}


def run_cases(cases, rounds: int, round_seconds: float, peak_size: int,
              timm_versions_or_none: dict | None, out_file) -> list[dict]:
  """Every measurement of `cases` (timm's where `timm_versions_or_none` is given), each also
  written to `out_file` as one JSON line."""
  results = []

  def record(result):
    results.append(result)
    out_file.write(json.dumps(result) + '\n')
    out_file.flush()
    print(f'{result["framework"]:>13} {result["model"]} {result["mode"]}: '
          f'{result["images_per_second"]:.1f} images/s', flush=True)

  for model_name, timm_name, batch, image_size in cases:
    for train in (False, True):
      reference = inference_time.benchmark(
          model_name, batch, image_size, 'bfloat16', train, 'adamw', rounds, round_seconds,
          peak_size)
      record({**reference, 'framework': 'vit_jax'})
      for compiled in (False, True) if timm_versions_or_none else ():
        record(timm_figures(reference, timm_name, compiled, rounds, round_seconds,
                            timm_versions_or_none))
  return results


def format_table(results: list[dict]) -> str:
  """A markdown table: images/s of vit_jax and timm per case, and vit_jax over compiled timm."""
  cases = {}
  for r in results:
    cases.setdefault((r['model'], r['batch'], r['mode']), {})[r['framework']] = r
  lines = ['| case | vit_jax images/s | MFU | compile s | timm eager | timm compile | '
           'vit_jax / timm compile |', '|---|---:|---:|---:|---:|---:|---:|']
  for (model, batch, mode), by in cases.items():
    ours = by['vit_jax']
    timm_rate = lambda name: by[name]['images_per_second'] if name in by else None
    eager, compiled = timm_rate('timm eager'), timm_rate('timm compile')
    cell = lambda x, fmt: '-' if x is None else format(x, fmt)
    lines.append(
        f'| {model} b{batch} {mode} | {ours["images_per_second"]:,.1f} | {ours["mfu"]:.3f} | '
        f'{ours["compile_seconds"]:.1f} | {cell(eager, ",.1f")} | {cell(compiled, ",.1f")} | '
        f'{cell(compiled and ours["images_per_second"] / compiled, ".2f")} |')
  return '\n'.join(lines)


def main(argv=None):
  hardware.skip_absent_tpu()  # No libtpu start-up (and its warnings) on a host without TPUs.
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='gpu_benchmark.jsonl', help='JSON-lines file to write.')
  parser.add_argument('--tiny', action='store_true',
                      help="The 'testing' model at batch 2 and 32 px: a quick check on a CPU.")
  parser.add_argument('--no_timm', action='store_true', help='Time vit_jax only.')
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--round_seconds', type=float, default=1.0)
  args = parser.parse_args(argv)
  versions = None if args.no_timm else timm_versions()
  if versions is None and not args.no_timm:
    print('torch or timm does not import: timing vit_jax only.')
  with open(args.out, 'w') as f:
    results = run_cases(TINY_CASES if args.tiny else CASES, args.rounds,
                        0.05 if args.tiny else args.round_seconds, 128 if args.tiny else 2048,
                        versions, f)
  print(f'\n{jax.devices()[0].device_kind}, jax {jax.__version__}, bfloat16, AdamW:')
  print(format_table(results))
  print(f'Wrote {args.out}')


if __name__ == '__main__':
  main()

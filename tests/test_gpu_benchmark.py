"""Tests of the GPU benchmark script, benchmarks/gpu.py, run on the CPU with its tiny case."""
import importlib.util
import json
import os

SCRIPT = os.path.join(os.path.dirname(__file__), '..', 'benchmarks', 'gpu.py')


def load_script():
  spec = importlib.util.spec_from_file_location('gpu_benchmark', SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_tiny_run_writes_json_lines_and_a_table(tmp_path, capsys):
  out = tmp_path / 'tiny.jsonl'
  load_script().main(['--tiny', '--no_timm', '--rounds', '1', '--out', str(out)])
  lines = [json.loads(line) for line in out.read_text().splitlines()]
  assert [(r['framework'], r['model'], r['mode'], r['batch'], r['dtype'], r['optimizer'])
          for r in lines] == [('vit_jax', 'testing', 'inference', 2, 'bfloat16', None),
                              ('vit_jax', 'testing', 'train', 2, 'bfloat16', 'adamw')]
  assert all(r['images_per_second'] > 0 and r['attention'] == 'xla' for r in lines)
  printed = capsys.readouterr().out
  assert '| testing b2 inference |' in printed and '| testing b2 train |' in printed


def test_table_sets_vit_jax_against_compiled_timm():
  case = {'model': 'ViT-B_16', 'batch': 256, 'mode': 'train'}
  results = [{**case, 'framework': 'vit_jax', 'images_per_second': 3000.0, 'mfu': 0.5,
              'compile_seconds': 20.0},
             {**case, 'framework': 'timm eager', 'images_per_second': 2500.0},
             {**case, 'framework': 'timm compile', 'images_per_second': 2000.0}]
  assert load_script().format_table(results).splitlines()[-1] == (
      '| ViT-B_16 b256 train | 3,000.0 | 0.500 | 20.0 | 2,500.0 | 2,000.0 | 1.50 |')

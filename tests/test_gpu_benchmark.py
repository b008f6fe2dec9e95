"""Tests of the GPU benchmark scripts, benchmarks/gpu.py and benchmarks/step_memory.py, run on
the CPU with a tiny model."""
import importlib.util
import json
import os

import jax

from vit_jax.models import blank
from vit_jax.models import registry

BENCHMARKS = os.path.join(os.path.dirname(__file__), '..', 'benchmarks')


def load_script(name='gpu.py'):
  spec = importlib.util.spec_from_file_location(name.removesuffix('.py'),
                                                os.path.join(BENCHMARKS, name))
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


def test_step_memory_predicts_at_least_the_adamw_state_and_says_a_cpu_reports_no_peak(
    tmp_path, capsys):
  out = tmp_path / 'memory.jsonl'
  load_script('step_memory.py').main(['--model', 'testing', '--batch', '2', '--image_size', '32',
                                      '--steps', '1', '--out', str(out)])
  result = json.loads(out.read_text())
  model = registry.get_model('testing', num_classes=1000)
  params = sum(leaf.size for leaf in jax.tree.leaves(blank.param_shapes(model, 32)))
  # The step's arguments hold the float32 parameters and AdamW's two moments of each.
  assert result['predicted']['argument_bytes'] >= 3 * 4 * params
  assert result['peak_bytes_in_use'] is None
  assert capsys.readouterr().out.startswith('testing b2 32 px on cpu: predicted ')

"""Smoke tests of the speed benchmark, vit_jax/inference_time.py, on the tiny 'testing' model."""
import json

import jax
import pytest

from vit_jax.models import flops
from vit_jax.models import registry
from vit_jax.tools import inference_time

FIELDS = ('model', 'mode', 'batch', 'image_size', 'dtype', 'device', 'devices',
          'images_per_second', 'ms_per_batch', 'gflops_per_image', 'achieved_gflops',
          'peak_gflops', 'peak_source', 'mfu', 'mfu_rounds', 'compile_seconds', 'jax_version',
          'date')
FAST = ['--model', 'testing', '--image_size', '32', '--rounds', '3', '--round_seconds', '0.05',
        '--peak_size', '128']
GFLOPS_PER_IMAGE = 157_538e-9  # XLA:CPU's count of one forward pass of 'testing' at 32 px.


def run_cli(tmp_path, *flags) -> dict:
  out = tmp_path / 'result.json'
  inference_time.main(FAST + list(flags) + ['--out', str(out)])
  with open(out) as f:
    return json.load(f)


def check_fields(result: dict) -> None:
  """Every field is there, with figures a run on a CPU can give."""
  assert set(FIELDS) <= set(result)
  assert result['peak_source'] == 'measured 128^2 matmul'  # No published peak for a CPU.
  assert len(result['mfu_rounds']) == 3  # --rounds 3.
  assert all(result[key] > 0 for key in ('images_per_second', 'ms_per_batch', 'achieved_gflops',
                                         'peak_gflops', 'mfu', 'compile_seconds'))


def test_inference_writes_every_figure(tmp_path, capsys):
  result = run_cli(tmp_path, '--batch', '4')
  check_fields(result)
  assert (result['model'], result['mode'], result['batch'], result['image_size'],
          result['dtype'], result['devices']) == ('testing', 'inference', 4, 32, 'float32', 4)
  assert result['gflops_per_image'] == pytest.approx(GFLOPS_PER_IMAGE, rel=0.01)
  assert '4 x cpu' in capsys.readouterr().out


def test_on_a_cpu_host_the_batch_is_split_over_the_devices_that_divide_it():
  # conftest.py makes 4 CPU devices.
  assert [len(inference_time.benchmark_devices(batch)) for batch in (1, 3, 6, 7, 16, 27)] == [
      1, 3, 3, 1, 4, 3]


def test_train_step_counts_three_forward_passes(tmp_path):
  result = run_cli(tmp_path, '--batch', '8', '--train', '--optimizer', 'adamw')
  check_fields(result)
  assert (result['mode'], result['optimizer']) == ('train', 'adamw')
  forward = flops.gflops_per_image(registry.get_model('testing', num_classes=1000), 32)
  assert result['gflops_per_image'] == pytest.approx(3 * forward)


@pytest.mark.parametrize('flags, message', [
    (['--model', 'ViT-Z_7'], 'is unknown'),
    (['--image_size', '30'], 'not divisible by the patch size 16x16'),
    (['--batch', '0'], 'must be at least 1'),
    (['--attention', 'splash', '--train'], "'splash' is a TPU kernel, and these are CPU devices"),
])
def test_bad_arguments_name_the_flag(flags, message, capsys):
  with pytest.raises(SystemExit) as exit_status:
    inference_time.main(FAST + flags)
  assert str(exit_status.value.code).startswith('error: ')  # Printed; exit status 1.
  assert message in str(exit_status.value.code)


def test_an_existing_out_is_kept_and_named_before_anything_runs(tmp_path):
  (tmp_path / 'b16.json').write_text('{"images_per_second": 3137}')
  with pytest.raises(SystemExit) as exit_status:
    inference_time.main(FAST + ['--out', str(tmp_path / 'b16.json')])
  assert exit_status.value.code == (f'error: {tmp_path}/b16.json exists: give another --out, or '
                                    'move it away first (nothing is overwritten).')
  assert (tmp_path / 'b16.json').read_text() == '{"images_per_second": 3137}'


def test_runs_where_the_backend_counts_no_flops(tmp_path, monkeypatch):
  # XLA:GPU's lowering gives no cost analysis (jax 0.11, CUDA 13): the count must not need one.
  monkeypatch.setattr(jax.stages.Lowered, 'cost_analysis', lambda self: None)
  monkeypatch.setattr(jax.stages.Compiled, 'cost_analysis', lambda self: None)
  result = run_cli(tmp_path, '--batch', '2')
  check_fields(result)
  assert result['gflops_per_image'] == pytest.approx(GFLOPS_PER_IMAGE, rel=0.01)

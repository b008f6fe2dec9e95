"""Tests of vit_jax.plan (the train step compiled for Cloud TPU slices that are not here), of
vit_jax.tpu_topologies (the slices) and of vit_jax.training.fit (the check that a step fits its
devices' memory, in plan and in main)."""
import ast
import json
import os
import re
import signal
import subprocess
import sys

import jax
from jax.experimental.compilation_cache import compilation_cache
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from vit_jax import console
from vit_jax import tpu_topologies
from vit_jax.config import defaults
from vit_jax.models import registry
from vit_jax.models import attention as attention_kernels
from vit_jax.tools import plan as plan_command
from vit_jax.training import tpu_plan
from vit_jax.training import fit
from vit_jax.training import setup as train_setup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CONFIG = os.path.join(ROOT, 'tests', 'tiny_config.py')


@pytest.fixture(scope='module', autouse=True)
def tpu_compiler():
  """libtpu set up as vit_jax.plan sets it up (its environment, before it loads); the other
  tests of this process get their environment and compilation cache back."""
  cache = jax.config.jax_enable_compilation_cache
  names = ('ALLOW_MULTIPLE_LIBTPU_LOAD', 'TPU_SKIP_MDS_QUERY', 'TPU_ACCELERATOR_TYPE',
           'TPU_WORKER_HOSTNAMES')
  before = {name: os.environ.pop(name, None) for name in names}
  tpu_topologies.use_tpu_compiler_only(tpu_topologies.parse_topology('v5e-4'))
  # JAX decides once per process whether it uses the cache; where this process's earlier tests
  # used it, it would go on looking TPU programs up there (and fail to read them back).
  compilation_cache.reset_cache()
  yield
  for name, value in before.items():
    os.environ.pop(name, None)
    if value is not None:
      os.environ[name] = value
  jax.config.update('jax_enable_compilation_cache', cache)
  compilation_cache.reset_cache()


def user_env() -> dict:
  """The environment of a user's shell: no JAX_PLATFORMS, and JAX's own device count."""
  env = {name: value for name, value in os.environ.items() if name != 'JAX_PLATFORMS'}
  env['XLA_FLAGS'] = helpers.xla_flags(None)
  return env


def test_the_plan_command_compiles_a_tiny_step_for_a_v5e_4(tmp_path):
  out = tmp_path / 'plan.json'
  # As a user runs it, noting whether TensorFlow was imported.
  run = subprocess.run([sys.executable, *helpers.noting_tensorflow('vit_jax.plan'),
                        f'--config={TINY_CONFIG}',
                        '--topology=v5e-4', '--multi_label', f'--out={out}'], env=user_env(),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr
  assert 'tensorflow imported: False' in run.stdout
  assert 'TPU_ACCELERATOR_TYPE' not in run.stderr and 'Traceback' not in run.stderr
  # Its one line while it compiles, which takes minutes for large models.
  assert re.fullmatch(r"\d\d:\d\d:\d\d Compiling the training and evaluation steps of \S+ for "
                      r"v5e-4 with libtpu's compiler, on this CPU \(minutes for large models\)\.",
                      run.stderr.strip()), run.stderr
  result = json.loads(out.read_text())
  assert result['fits'] and result['topology']['chips'] == 4 and result['mesh']['data'] == 4
  assert result['config']['multi_label'] and result['eval']['fits']
  # The config's attention='auto' is XLA's on TPUs: no kernel of its own in the step.
  assert result['config']['attention'] == 'xla' and result['tpu_custom_calls'] == {}
  chip = result['per_chip']
  assert chip['hbm_bytes'] == 16 * 10**9  # The v5e's 16 GB (Cloud TPU documentation).
  assert 0 < chip['argument_bytes'] < chip['total_bytes'] < chip['hbm_bytes']
  for key in ('temp_bytes', 'output_bytes', 'flops_per_step_per_chip',
              'roofline_step_seconds', 'roofline_images_per_second_per_chip', 'compile_seconds'):
    value = chip.get(key, result.get(key))
    assert value > 0, key
  assert result['versions']['libtpu'] == '0.0.42.1'
  # One short table: per chip, labels aligned and values right-aligned.
  table = run.stdout.split('per chip:\n')[1].splitlines()
  rows = [line for line in table if line.startswith('  ')]
  assert 10 <= len(rows) <= 20
  labels = [line.split('  ')[1] for line in rows]
  for label in ('params + optimiser state', 'temporaries', 'outputs', 'total', 'HBM', 'fits',
                'FLOPs per step', 'roofline step', 'roofline images/s', 'compile'):
    assert label in labels, label
  assert len({len(line) for line in rows}) == 1
  # The plan is kept: the same command again stops before it compiles anything.
  written = out.read_text()
  again = subprocess.run([sys.executable, '-m', 'vit_jax.plan', f'--config={TINY_CONFIG}',
                          '--topology=v5e-4', f'--out={out}'], env=user_env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
  assert again.returncode == 1 and out.read_text() == written
  assert again.stderr.strip().splitlines()[-1] == (
      f'Plan error: {out} exists: give another --out, or move it away first (nothing is '
      'overwritten).')
  assert rows[labels.index('HBM')].endswith(' 14.90 GiB')  # 16 GB.
  assert rows[labels.index('fits')].endswith(' yes')


# A Ctrl-C is one line, as in every command; SIGTERM ends it quietly, as the system's default
# does, not with the stack dump that libtpu's handler of it would print.
@pytest.mark.parametrize('signum, last_line', [(signal.SIGINT, 'Stopped (Ctrl-C).\n'),
                                               (signal.SIGTERM, '')], ids=['ctrl_c', 'sigterm'])
def test_a_stop_in_the_plan_commands_compile_ends_it_by_that_signal(tmp_path, signum,
                                                                     last_line):
  out = tmp_path / 'plan.json'
  # The process takes Ctrl-C as a user's does: pytest-xdist's workers ignore SIGINT, and a child
  # would inherit that.
  before = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    plan = subprocess.Popen([sys.executable, '-m', 'vit_jax.plan', f'--config={TINY_CONFIG}',
                             '--topology=v5e-4', f'--out={out}'], env=user_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  finally:
    signal.signal(signal.SIGINT, before)
  assert 'Compiling the training and evaluation steps' in plan.stderr.readline()
  plan.send_signal(signum)
  stdout, stderr = plan.communicate(timeout=60)
  assert (plan.returncode, stdout, stderr) == (-signum, '', last_line)
  assert not out.exists()


@pytest.mark.parametrize('name, chips, hosts, grid', [
    ('v4-8', 4, 1, (2, 2, 1)),  # v4 and v5p names count TensorCores, two a chip.
    ('v4-4096', 2048, 512, (8, 16, 16)),
    ('v5litepod-16', 16, 4, (4, 4)),
    ('v5e-8', 8, 1, (2, 4)),
    ('v5p-16', 8, 2, (2, 2, 2)),
    ('v6e-256', 256, 64, (16, 16)),
])
def test_topology_names_map_to_chips_and_hosts_as_cloud_tpu_documents(name, chips, hosts, grid):
  topology = tpu_topologies.parse_topology(name)
  assert (topology.chips, topology.hosts, topology.grid) == (chips, hosts, grid)


@pytest.mark.parametrize('name', ['v5e-3', 'v4-4', 'v7-8', 'tpu'])
def test_an_unknown_topology_is_one_line_naming_the_sizes(name):
  with pytest.raises(tpu_topologies.TopologyError, match='topology'):
    tpu_topologies.parse_topology(name)


def tpu_config(**overrides):
  """The tiny config with a batch of 8: at least one image a chip of these slices, in a step
  that libtpu compiles quicker than one of the tiny config's 64."""
  return helpers.tiny_config(batch=8, **overrides)


def tpu_mesh(config, name, slices=1):
  """The mesh of `config` over the compile-only devices of the slice `name`."""
  return train_setup.make_mesh(config, tpu_topologies.compile_only_devices(
      tpu_topologies.parse_topology(name, slices)))


@pytest.mark.parametrize('strategy, model_axis', [
    ('data', 1), ('fsdp', 1), ('tensor', 2), ('fsdp+tensor', 2)])
def test_a_train_step_compiles_for_a_v5e_4_under_each_sharding(strategy, model_axis):
  config = tpu_config(sharding=strategy)
  config.mesh.model = model_axis
  mesh = tpu_mesh(config, 'v5e-4')
  compiled = fit.lower_train_step(config, mesh, 10).compile()
  assert {d.platform for d in mesh.devices.flat} == {'tpu'}
  assert dict(mesh.shape) == {'data': 4 // model_axis, 'model': model_axis}
  assert 0 < fit.memory_of(compiled).total_bytes < tpu_topologies.GENERATIONS['v5e'].hbm_bytes


def test_a_multi_label_plan_compiles_the_step_for_multi_hot_labels():
  config, topology = helpers.tiny_config(), tpu_topologies.parse_topology('v5e-4')
  mesh = tpu_plan.topology_mesh(config, topology)
  single, multi = (tpu_plan.train_step_plan(config, mesh, topology, 1000, multi_label)[0]
                   for multi_label in (False, True))
  # The arguments grow by float32 (16, 1000) labels on each chip, less the int32 (16,) ones.
  label_bytes = config.batch // 4 * 1000 * 4
  grown = multi['per_chip']['argument_bytes'] - single['per_chip']['argument_bytes']
  assert multi['config']['multi_label'] and 0.9 * label_bytes <= grown <= 1.1 * label_bytes


def test_the_flops_of_an_accumulated_step_count_every_micro_batch():
  # Accumulation splits the same 64 images into micro-batches: the same arithmetic, which XLA's
  # cost analysis, counting the loop of micro-batches once, would give as a quarter.
  topology = tpu_topologies.parse_topology('v5e-4')
  flops = {}
  for accum_steps in (1, 4):
    config = helpers.tiny_config(accum_steps=accum_steps)
    result, _ = tpu_plan.train_step_plan(config, tpu_plan.topology_mesh(config, topology),
                                         topology, num_classes=10)
    flops[accum_steps] = result['flops_per_step_per_chip']
  assert flops[4] == pytest.approx(flops[1], rel=0.1)  # With the optimiser's update 4 times.
  assert plan_command.ACCUMULATION_NOTE.format(4) in plan_command.flops_notes(result)


def test_splash_attention_runs_in_the_forward_and_backward_pass_of_a_planned_step():
  config = tpu_config(attention='splash', dtype='bfloat16')
  result = tpu_plan.plan(config, tpu_topologies.parse_topology('v5e-4'), 10)
  assert result['fits'] and result['config']['attention'] == 'splash'
  # One block: the forward kernel, and the backward's kernels for dq and for dk, dv.
  assert result['tpu_custom_calls'] == {'splash_mha_fwd_residuals': 1,
                                        'splash_mha_dq_no_residuals': 1,
                                        'splash_mha_dkv_no_residuals': 1}


def test_splash_attention_runs_per_device_under_fsdp_tensor_in_scanned_rematerialised_blocks():
  config = tpu_config(attention='splash', dtype='bfloat16', sharding='fsdp+tensor',
                      scan_layers=True, remat_policy='nothing_saveable')
  config.mesh.model = 2
  hlo = fit.lower_train_step(config, tpu_mesh(config, 'v5e-4'), 10).compile().as_text()
  calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  names = sorted(line.split(' = ')[0].strip().lstrip('%').rsplit('.', 1)[0] for line in calls)
  # The forward kernel twice: in the forward pass, and recomputed in the backward pass.
  assert names == ['splash_mha_dkv_no_residuals', 'splash_mha_dq_no_residuals',
                   'splash_mha_fwd_residuals', 'splash_mha_fwd_residuals']
  # Each device's kernel takes its share: 8 / 2 images, 2 / 2 heads, the 17 tokens padded to
  # 128, heads of 32 / 2 = 16.
  assert all('bf16[4,1,128,16]' in line for line in calls)


def test_splash_attention_masks_the_padded_tokens_as_softmax_attention_would():
  # 50 tokens, padded to 128 inside: 78 padded keys that must take no weight. The kernel runs
  # in Pallas's interpreter, on this CPU.
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(2, 3, 50, 16)), jnp.float32) for _ in range(3))

  def softmax_attention(q, k, v):
    return jnp.einsum('bnqt,bntk->bnqk', jax.nn.softmax(jnp.einsum('bnqk,bntk->bnqt', q, k)), v)

  splash = lambda q, k, v: attention_kernels.splash_attention(q, k, v, interpret=True)
  np.testing.assert_allclose(splash(q, k, v), softmax_attention(q, k, v), atol=1e-5)
  weighted = lambda attention: lambda *qkv: jnp.sum(attention(*qkv) * jnp.arange(16.0))
  for got, expected in zip(jax.grad(weighted(splash), argnums=(0, 1, 2))(q, k, v),
                           jax.grad(weighted(softmax_attention), argnums=(0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(got, expected, atol=1e-4)


def test_main_refuses_splash_attention_on_a_cpu_with_one_line(tmp_path):
  run = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', f'--config={TINY_CONFIG}', f'--workdir={tmp_path}',
       '--config.attention=splash'],
      env=user_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 1 and 'Traceback' not in run.stderr
  assert run.stderr.strip().splitlines()[-1] == (
      "Config error: config.attention='splash' is a TPU kernel, and these are CPU devices: "
      "choose 'auto' or 'xla'.")


def test_a_2_host_slice_keeps_the_tensor_axis_within_a_host():
  config = tpu_config(sharding='fsdp+tensor')
  config.mesh.model = 4
  mesh = tpu_mesh(config, 'v4-16')  # 8 chips on 2 hosts of 4.
  assert {d.process_index for d in mesh.devices.flat} == {0, 1}
  for row in mesh.devices:  # The chips of one 'model' group: all on one host.
    assert len({d.process_index for d in row}) == 1
  fit.lower_train_step(config, mesh, 10).compile()


def test_a_2_slice_mesh_splits_only_data_across_the_slices():
  config = tpu_config(sharding='fsdp')
  mesh = tpu_mesh(config, 'v5e-4', slices=2)
  slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  assert slices[:, 0].tolist() == [0] * 4 + [1] * 4  # 'data': a slice after the other.
  fit.lower_train_step(config, mesh, 10).compile()


def test_fsdp_on_4_chips_keeps_a_quarter_of_params_and_optimiser_state_per_chip():
  config = defaults.with_model(defaults.training_defaults(), 'ViT-Ti_16')
  config.update(dict(batch=8, batch_eval=8, sharding='fsdp', optimizer='adamw', ema_decay=0.0))
  config.pp.crop = 32
  mesh = tpu_mesh(config, 'v5e-4')
  model = train_setup.build_model(config, 10)
  # float32 params, and AdamW's two float32 moments of each.
  total = registry.count_params(model, config.pp.crop) * 4 * 3
  assert tpu_plan.state_bytes(config, mesh, 10) == pytest.approx(total / 4, rel=0.1)


# (batch per device, {accum_steps: bytes its step needs}, limit) -> accum_steps auto picks:
# the fewest micro-batches (a divisor of the batch per device) whose step fits.
AUTO_CASES = [
    (16, {1: 90, 2: 50, 4: 30, 8: 20, 16: 15}, 100, 1),
    (16, {1: 90, 2: 50, 4: 30, 8: 20, 16: 15}, 40, 4),
    (16, {1: 90, 2: 50, 4: 30, 8: 20, 16: 15}, 15, 16),
    (12, {1: 90, 2: 50, 3: 40, 4: 30, 6: 25, 12: 20}, 45, 3),
    (12, {1: 90, 2: 50, 3: 40, 4: 30, 6: 25, 12: 20}, 24, 12),
]


@pytest.mark.parametrize('per_device, needs, limit, expected', AUTO_CASES)
def test_accum_steps_auto_picks_the_fewest_micro_batches_that_fit(per_device, needs, limit,
                                                                  expected):
  config = helpers.tiny_config(batch=per_device * 4, accum_steps='auto')
  memory = lambda c: fit.StepMemory(temp_bytes=needs[c.accum_steps])
  assert fit.resolve_accum_steps(config, 4, memory, limit, 'test').accum_steps == expected


def test_accum_steps_auto_reports_when_nothing_fits():
  config = helpers.tiny_config(batch=8, accum_steps='auto')
  with pytest.raises(fit.FitError, match='needs 100.0 MiB per device, more than the 1.0 MiB'):
    fit.resolve_accum_steps(config, 4, lambda c: fit.StepMemory(temp_bytes=100 * 2**20),
                            2**20, 'test')


def test_a_step_over_a_small_device_limit_names_what_would_fit():
  # Already fsdp and rematerialised, so that only a larger accumulation is left to try: 17
  # images a device, a prime, leave one to compile (17 micro-batches of one image).
  config = helpers.tiny_config(batch=4 * 17, sharding='fsdp', remat_policy='nothing_saveable')
  mesh = train_setup.make_mesh(config, jax.devices()[:4])
  memory = lambda c: fit.step_memory(c, mesh, 10)
  need = memory(config).total_bytes
  limit = int(need * 0.7)  # A device limit made small: only accumulation makes it fit.
  with pytest.raises(fit.FitError) as error:
    fit.check(config, 4, memory, limit, 'a small device')
  message = str(error.value)
  assert '\n' not in message
  assert f'more than the {console.readable_bytes(limit)} of a small device' in message
  assert '--config.accum_steps=' in message
  accum = int(message.split('--config.accum_steps=')[1].split()[0])
  assert accum > 1 and memory(fit.with_field(config, 'accum_steps', accum)).total_bytes <= limit


def test_main_stops_a_batch_beyond_the_hosts_memory_with_one_line(tmp_path):
  # The batch's images alone (2 x 524,287 of 28x28x3 float32) take 9.2 GiB; its activations far
  # more than this host has. As a user runs it: one device per core that divides the batch (1 or
  # 2: 524,287 = 2**19 - 1 is prime), no harness flags (fsdp and rematerialised already, so that
  # only a larger accumulation is left to try). The prime leaves few accumulations to compile
  # (with 2 devices one: 524,287 micro-batches of one image).
  run = subprocess.run(
      [sys.executable, '-m', 'vit_jax.main', f'--config={TINY_CONFIG}',
       f'--workdir={tmp_path}', f'--config.batch={2 * (2**19 - 1)}', '--config.sharding=fsdp',
       '--config.remat_policy=nothing_saveable'],
      env=user_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert run.returncode == 1
  last = run.stderr.strip().splitlines()[-1]
  assert last.startswith('Config error: The training step needs ') and 'Traceback' not in run.stderr
  assert "of the host's available memory" in last and '--config.accum_steps=' in last
  assert not (tmp_path / 'checkpoints').exists() or not os.listdir(tmp_path / 'checkpoints')


def notebook_config():
  """The training config of notebooks/vit_jax.ipynb, as its cells define it (its settings cell
  and its `notebook_config` function, run without the training that follows it)."""
  with open(os.path.join(ROOT, 'notebooks', 'vit_jax.ipynb')) as f:
    cells = [''.join(cell['source']) for cell in json.load(f)['cells']
             if cell['cell_type'] == 'code']
  namespace = {'defaults': defaults, 'registry': registry, 'QUICK': False}
  exec(next(cell for cell in cells if 'IMAGE_SIZES = ' in cell), namespace)
  function = next(node for cell in cells if 'def notebook_config' in cell
                  for node in ast.parse(cell).body
                  if isinstance(node, ast.FunctionDef) and node.name == 'notebook_config')
  exec(compile(ast.Module([function], []), 'notebook', 'exec'), namespace)
  return namespace['notebook_config']()


def test_the_notebooks_training_step_compiles_for_colabs_single_v5e_chip():
  # The training step only: the plan's evaluation step is tested above, on the tiny config.
  config, topology = notebook_config(), tpu_topologies.parse_topology('v5e-1')
  result, _ = tpu_plan.train_step_plan(config, tpu_plan.topology_mesh(config, topology), topology,
                                       10)
  assert result['fits'] and result['topology']['chips'] == 1 and result['mesh']['data'] == 1
  assert result['config']['batch'] == 128 and 0 < result['per_chip']['total_bytes']

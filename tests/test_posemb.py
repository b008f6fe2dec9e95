"""Tests of the position-embedding kinds (vit_jax/models/positions.py, `posemb`): the model, the
checkpoint resizing and checks, and one training step of each, on tiny models."""
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import pytest

from helpers import random_params
from vit_jax import sharding
from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import runs
from vit_jax.config import checks
from vit_jax.config import defaults
from vit_jax.models import positions
from vit_jax.models import registry
from vit_jax.models import attention
from vit_jax.tools import export
from vit_jax.tools import visualize
from vit_jax.training import step as train_step
from vit_jax.training import trainer

pytestmark = pytest.mark.xdist_group('posemb')  # Its module fixtures are built once.

KINDS = positions.POSEMB_KINDS
PATCH = 16  # The 'testing' model: patches 16, hidden 16, MLP 32, 2 heads (K = 8).


def tiny(posemb, **overrides):
  """The 'testing' model with `posemb`, two blocks and three classes."""
  return registry.get_model('testing', num_classes=3, posemb=posemb, num_layers=2, **overrides)


def init(model, image_size):
  """Random params of `model` for square images of `image_size` px, every one nonzero (made
  from the shapes: nothing is compiled)."""
  return random_params(model, image_size, scale=0.3)


@functools.partial(jax.jit, static_argnames='model')
def logits(model, params, x):
  """The model's logits in evaluation mode, jitted once per model and shapes."""
  return model.apply({'params': params}, x, train=False)


def images(size, batch=2):
  return jax.random.uniform(jax.random.key(1), (batch, size, size, 3), minval=-1, maxval=1)


def flat(params):
  return {'/'.join(path): value for path, value in
          jax.tree_util.tree_flatten_with_path(params)[0] for path in [sharding.path_names(path)]}


def test_sincos_values_are_the_formula_at_known_positions():
  width, grid = 8, (3, 4)  # Two frequencies: 1 and 1/100.
  table = positions.sincos_2d(grid, width)
  assert table.shape == (12, 8)
  np.testing.assert_allclose(table[0], [0, 0, 1, 1, 0, 0, 1, 1], atol=1e-7)  # Row 0, column 0.
  for r, c in ((0, 3), (2, 1), (2, 3)):
    expected = [f(p / 100**i) for f, p in ((math.sin, r), (math.cos, r), (math.sin, c),
                                          (math.cos, c)) for i in range(2)]
    np.testing.assert_allclose(table[r * 4 + c], expected, rtol=1e-6, atol=1e-7)
  # In the model: added to the patches, the class token (first) left as it is; no parameters.
  module = positions.AddGridPositions('sincos_2d')
  tokens = jnp.ones((1, 13, width))
  variables = module.init(jax.random.key(0), tokens, grid)
  assert not variables
  out = module.apply(variables, tokens, grid)
  np.testing.assert_allclose(out[0], np.concatenate([np.ones((1, 8)), 1 + table]), atol=1e-6)


def test_learned_2d_patches_share_the_half_of_their_row_and_of_their_column():
  grid, width = (3, 4), 8
  module = positions.AddGridPositions('learned_2d')
  tokens = jnp.zeros((1, 13, width))
  params = module.init(jax.random.key(0), tokens, grid)['params']
  assert {k: v.shape for k, v in params.items()} == {'row_embedding': (3, 4),
                                                      'column_embedding': (4, 4)}
  added = np.asarray(module.apply({'params': params}, tokens, grid))[0]
  np.testing.assert_array_equal(added[0], 0)  # The class token gets no position.
  patches = added[1:].reshape(3, 4, width)
  for r in range(3):
    for c in range(4):
      np.testing.assert_array_equal(patches[r, c, :4], params['row_embedding'][r])
      np.testing.assert_array_equal(patches[r, c, 4:], params['column_embedding'][c])
  assert not np.allclose(patches[0, 0, :4], patches[1, 0, :4])


def numpy_relative_logits(q, table, extra):
  """The paper's definition, one pair at a time: query patch i, key patch j -> q_i . R[i - j]."""
  b, n, t, _ = q.shape
  p = t - extra
  logits = np.zeros((b, n, t, t))
  for i in range(p):
    for j in range(p):
      logits[:, :, extra + i, extra + j] = np.einsum('bnk,nk->bn', q[:, :, extra + i],
                                                     table[p - 1 + i - j])
  return logits


@pytest.mark.parametrize('extra', [0, 1])
def test_relative_logits_are_the_papers_definition(extra):
  rng = np.random.default_rng(0)
  q = rng.normal(size=(2, 3, 5 + extra, 4)).astype(np.float32)
  table = rng.normal(size=(9, 3, 4)).astype(np.float32)
  np.testing.assert_allclose(positions.relative_logits(q, table),
                             numpy_relative_logits(q, table, extra), rtol=1e-5, atol=1e-5)


def test_relative_bias_depends_only_on_the_offset():
  rng = np.random.default_rng(1)
  table = rng.normal(size=(11, 2, 4)).astype(np.float32)  # Planted, for 6 patches.
  q = rng.normal(size=(1, 2, 6, 4)).astype(np.float32)
  shifted = np.roll(q, 1, axis=2)  # Query patch i moves to i + 1.
  bias, shifted_bias = positions.relative_logits(q, table), positions.relative_logits(
      shifted, table)
  np.testing.assert_allclose(shifted_bias[:, :, 1:, 1:], bias[:, :, :-1, :-1], rtol=1e-6)
  same_query = np.broadcast_to(q[:, :, :1], q.shape)  # Then each diagonal is constant.
  bias = np.asarray(positions.relative_logits(same_query, table))
  for offset in range(-5, 6):
    assert np.ptp(np.diagonal(bias, -offset, axis1=2, axis2=3), axis=-1).max() < 1e-6


def test_relative_with_a_zero_table_is_the_model_without_positions():
  relative, none = tiny('relative'), tiny('none')
  params = init(relative, 64)
  without = jax.tree.map(lambda x: x, params)
  for i in range(2):
    params['Transformer'][f'encoderblock_{i}']['MultiHeadDotProductAttention_0'][
        'relative_embedding'][:] = 0
    del without['Transformer'][f'encoderblock_{i}']['MultiHeadDotProductAttention_0'][
        'relative_embedding']
  x = images(64)
  np.testing.assert_allclose(logits(relative, params, x), logits(none, without, x), rtol=1e-6)


EXPECTED_PARAMS = {  # Position parameters of the 'testing' model (D 16, 2 heads) at 4x4 patches.
    'learned_1d': {'Transformer/posembed_input/pos_embedding': (1, 17, 16)},
    'none': {},
    'learned_2d': {'Transformer/posembed_input/row_embedding': (4, 8),
                   'Transformer/posembed_input/column_embedding': (4, 8)},
    'relative': {f'Transformer/encoderblock_{i}/MultiHeadDotProductAttention_0/'
                 'relative_embedding': (31, 2, 8) for i in range(2)},
    'sincos_2d': {},
}


@pytest.mark.parametrize('posemb', KINDS)
def test_each_kind_has_its_parameters_and_logical_axes(posemb):
  model = tiny(posemb)
  shapes = {k: v.shape for k, v in flat(registry.param_shapes(model, 64)).items()}
  without_positions = flat(registry.param_shapes(tiny('none'), 64))
  added = {k: s for k, s in shapes.items() if k not in without_positions}
  assert added == EXPECTED_PARAMS[posemb]
  axes = sharding.param_axes(sharding.declared_params(model, 64))
  sharding.check_rules(axes, sharding.full_rules())
  if posemb == 'relative':
    assert axes[('Transformer', 'encoderblock_0', 'MultiHeadDotProductAttention_0',
                 'relative_embedding')] == ('offset', 'heads', 'head_dim')


@pytest.mark.parametrize('posemb', KINDS)
def test_scanned_blocks_compute_what_unscanned_ones_do(posemb):
  model = tiny(posemb, classifier='gap')
  params = init(model, 48)
  scanned = model.clone(scan_layers=True, remat_policy='nothing_saveable')
  x = images(48)
  np.testing.assert_allclose(logits(scanned, npz.scan_blocks(params), x),
                             logits(model, params, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('posemb', ['learned_2d', 'relative', 'sincos_2d'])
def test_hybrids_and_non_square_images_place_the_grid(posemb):
  # The ResNet root (stride 4) under 16x16 patches: 64x128 pixels are 1x2 patches.
  model = tiny(posemb, resnet_layers=())
  images = jax.ShapeDtypeStruct((2, 64, 128, 3), jnp.float32)  # Shapes only: nothing runs.
  params = jax.eval_shape(lambda x: model.init(jax.random.key(0), x, train=False), images)[
      'params']
  assert jax.eval_shape(functools.partial(logits, model), params, images).shape == (2, 3)
  shapes = {k: v.shape for k, v in flat(params).items()}
  if posemb == 'learned_2d':
    assert shapes['Transformer/posembed_input/row_embedding'] == (1, 8)
    assert shapes['Transformer/posembed_input/column_embedding'] == (2, 8)
  if posemb == 'relative':
    assert shapes['Transformer/encoderblock_1/MultiHeadDotProductAttention_0/'
                  'relative_embedding'] == (3, 2, 8)


def test_relative_attention_takes_xla_where_cudnn_would_run():
  # bfloat16 heads of 8 fit cuDNN; on this CPU its kernel cannot run, so an output at all
  # shows that the bias took XLA's path.
  model = tiny('relative', attention='cudnn', dtype=jnp.bfloat16)
  assert attention.cudnn_fits(model.dtype, model.hidden_size // model.num_heads)
  assert np.isfinite(np.asarray(logits(model, init(model, 32), images(32)))).all()


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """{kind: (path of its 64 px checkpoint with spec, its params)} for every kind."""
  folder = tmp_path_factory.mktemp('posemb')
  files = {}
  for posemb in KINDS:
    model = tiny(posemb)
    params = jax.tree.map(np.asarray, init(model, 64))
    path = str(folder / f'{posemb}.npz')
    npz.save(params, path, spec=registry.model_spec(model, 'testing'))
    files[posemb] = path, params
  return files


@pytest.mark.parametrize('posemb', KINDS)
def test_resize_keeps_shapes_and_the_grid_corners(saved, posemb):
  path, params = saved[posemb]
  model = tiny(posemb)
  target = init(model, 112)  # 4x4 -> 7x7 patches.
  loaded = finetune.load_pretrained(path, target, model, keep_head=True)
  assert jax.tree.map(np.shape, loaded) == jax.tree.map(np.shape, target)
  old, new = flat(params), flat(loaded)
  for name, value in new.items():
    if name.endswith(('row_embedding', 'column_embedding')):
      np.testing.assert_allclose(value[[0, -1]], old[name][[0, -1]], rtol=1e-6)
    elif name.endswith('relative_embedding'):  # Offsets -15, 0, 15 -> -48, 0, 48.
      np.testing.assert_allclose(value[[0, 48, 96]], old[name][[0, 15, 30]], rtol=1e-6)
    elif name.endswith('pos_embedding'):  # Class token, and the 4 corners of the grid.
      np.testing.assert_allclose(value[0, [0, 1, 7, 43, 49]], old[name][0, [0, 1, 4, 13, 16]],
                                 rtol=1e-6)
    else:
      np.testing.assert_array_equal(value, old[name])
  if posemb in ('none', 'sincos_2d'):
    jax.tree.map(np.testing.assert_array_equal, loaded, params)
  scanned = finetune.load_pretrained(path, npz.scan_blocks(target),
                                       model.clone(scan_layers=True), keep_head=True)
  jax.tree.map(np.testing.assert_array_equal, npz.unscan_blocks(scanned), loaded)


def test_a_2d_resize_is_the_2d_resize_of_the_composed_embeddings(saved):
  """Interpolating a row-only (column-only) function in 2-D is interpolating it along rows."""
  path, params = saved['learned_2d']
  model = tiny('learned_2d')
  loaded = finetune.load_pretrained(path, init(model, 112), model)
  composed = positions.patch_embeddings(params, 'learned_2d', (4, 4))
  resized = finetune.resize_posemb(composed, (7, 7), has_class_token=False)
  np.testing.assert_allclose(positions.patch_embeddings(loaded, 'learned_2d', (7, 7)), resized,
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('found,wanted', [('learned_2d', 'relative'), ('learned_1d', 'none'),
                                          ('sincos_2d', 'none'), ('none', 'learned_1d')])
def test_a_checkpoint_of_another_kind_is_a_one_line_error(saved, found, wanted):
  model = tiny(wanted)
  with pytest.raises(npz.CheckpointError) as error:
    finetune.load_pretrained(saved[found][0], init(model, 64), model)
  message = str(error.value)
  assert '\n' not in message
  assert f"posemb={found!r} but the model has posemb={wanted!r}" in message


def test_without_a_spec_the_kind_is_told_by_the_parameters(saved, tmp_path):
  for posemb in ('relative', 'none'):
    path = str(tmp_path / f'{posemb}.npz')
    npz.save(saved[posemb][1], path)  # No spec, as the published files.
    params, spec = npz.load_with_spec(path)
    assert spec is None
    assert finetune.file_posemb(params, spec) == (None if posemb == 'none' else posemb)
  model = tiny('learned_1d')
  with pytest.raises(npz.CheckpointError,
                     match=r"none\.npz has no position parameters \(posemb in \('none', "
                           r"'sincos_2d'\)\) but the model has posemb='learned_1d'"):
    finetune.load_pretrained(str(tmp_path / 'none.npz'), init(model, 64), model)
  sincos = tiny('sincos_2d')  # Parameter-free: nothing tells them apart without a spec.
  finetune.load_pretrained(str(tmp_path / 'none.npz'), init(sincos, 64), sincos)


@pytest.mark.parametrize('posemb', ['learned_2d', 'relative', 'sincos_2d'])
def test_saved_models_load_back_with_their_kind(saved, posemb):
  path, params = saved[posemb]
  model, loaded = runs.load_model(path)
  assert model.posemb == posemb
  jax.tree.map(np.testing.assert_array_equal, loaded, params)
  if posemb != 'sincos_2d':  # The grid its parameters were made for.
    assert runs.native_image_size(loaded, model) == 64


def test_position_similarity_figures_skip_kinds_without_embeddings(saved, capsys):
  for posemb, drawn in (('learned_2d', True), ('sincos_2d', True), ('relative', False)):
    path, params = saved[posemb]
    model, _ = runs.load_model(path)
    figures = visualize.model_figures(model, params, 64, np.zeros((1, 64, 64, 3)), posemb,
                                      ['position_similarity'])
    assert ('position_similarity' in figures) == drawn
  assert ("Skipped position_similarity: relative has posemb='relative', no embedding per "
          'position') in capsys.readouterr().err


def test_timm_and_hugging_face_exports_refuse_other_kinds():
  for format_name in ('timm', 'hf'):
    with pytest.raises(export.ExportError, match=r"posemb='relative' has other position "
                                                 'information: use --format saved_model'):
      export.check_exportable(tiny('relative'), format_name)


def test_config_posemb_builds_the_model_and_unknown_kinds_are_errors():
  config = defaults.get_config()
  config.posemb = 'relative'
  assert trainer.build_model(config, num_classes=10).posemb == 'relative'
  config.posemb = 'rope'
  with pytest.raises(checks.ConfigError, match=r"config.posemb='rope' is not one of \("):
    checks.validate_config(config, num_devices=1)
  with pytest.raises(ValueError, match=r"posemb='learned_2d' splits the hidden size into 2 "
                                       r'equal parts, but hidden_size=15'):
    registry.get_model('testing', num_classes=3, posemb='learned_2d', hidden_size=15,
                     num_heads=3).init(jax.random.key(0), jnp.zeros((1, 16, 16, 3)), train=False)


@pytest.mark.parametrize('posemb', KINDS)
def test_each_kind_trains_a_step_sharded_scanned_and_rematerialised(posemb):
  config = defaults.with_model(defaults.training_defaults(), 'testing')
  config.update(dict(batch=8, optimizer='adamw', base_lr=0.01, warmup_steps=0, total_steps=2,
                     sharding='fsdp+tensor', scan_layers=True, remat_policy='nothing_saveable'))
  model = tiny(posemb, scan_layers=True, remat_policy='nothing_saveable')
  mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ('data', 'model'))
  optimizer = train_step.make_optimizer(config)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh, 32)
  before = flat(jax.device_get(state.params))
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  batch = {'image': images(32, batch=8), 'label': jnp.arange(8) % 3}
  for _ in range(2):  # The first step moves only the zero-initialised head.
    state, metrics = step(state, batch)
    assert bool(metrics['finite'])
  after = flat(jax.device_get(state.params))
  for name in EXPECTED_PARAMS[posemb]:  # The position parameters learn.
    name = name.replace('encoderblock_0', 'encoderblock').replace('encoderblock_1',
                                                                  'encoderblock')
    assert not np.allclose(after[name], before[name])

"""Tests of the published .npz layout and the fine-tuning setup, vit_jax/checkpoints/."""
import os
import resource

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from helpers import TINY_VIT as TINY
from helpers import images_of
from helpers import random_params
from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import runs
from vit_jax.data import image_ops
from vit_jax.data import embedded
from vit_jax.models import registry
from vit_jax.models import vit

POSEMB = finetune.POSEMB_PATH
SMALL_VIT = dict(hidden_size=16, mlp_dim=32, num_heads=2, num_layers=2)


def flat(params):
  return traverse_util.flatten_dict(params)


def assert_trees_equal(actual, expected):
  assert flat(actual).keys() == flat(expected).keys()
  for path, value in flat(expected).items():
    np.testing.assert_array_equal(flat(actual)[path], value, err_msg='/'.join(path))


def logits_of(model, params, images):
  return np.asarray(jax.jit(model.apply, static_argnames='train')({'params': params}, images,
                                                                  train=False))


def small_config(**fields):
  """The registry's tiny 'testing' model (patch 16, hidden 16, 1 layer) with `fields` changed."""
  config = registry.get_model_config('testing')
  config.update(fields)
  return config


def write_pretrained(path, image_size=224, **fields):
  """Saves random parameters of the 'testing' model at `image_size`; returns them."""
  model = registry.get_model(small_config(**fields), num_classes=7)
  params = random_params(model, (image_size, image_size))
  npz.save(params, path)
  return params


def model_of(config):
  """The model that fine-tunes from a checkpoint into `config`'s architecture (3 classes)."""
  return registry.get_model(config, num_classes=3)


def init_params(config, image_hw, num_classes=3):
  """Stands for the target model's freshly initialised parameters."""
  return random_params(registry.get_model(config, num_classes=num_classes), image_hw, seed=1)


def test_save_then_load_is_exact_and_writes_pre_linen_names(tmp_path):
  params = random_params(vit.VisionTransformer(num_classes=5, representation_size=7,
                                                     **TINY), (16, 16))
  npz.save(params, tmp_path / 'model.npz')
  keys = set(np.load(tmp_path / 'model.npz').files)
  assert 'Transformer/encoderblock_1/MultiHeadDotProductAttention_1/query/kernel' in keys
  assert {'Transformer/encoderblock_0/LayerNorm_2/scale',
          'Transformer/encoderblock_0/MlpBlock_3/Dense_1/bias', 'pre_logits/kernel'} <= keys
  assert not any('MultiHeadDotProductAttention_0' in key for key in keys)
  assert_trees_equal(npz.load(tmp_path / 'model.npz'), params)


def test_a_save_that_fails_for_lack_of_space_leaves_no_temporary_file(tmp_path):
  params = random_params(registry.get_model(small_config(), num_classes=7), (224, 224))
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # Python ignores SIGXFSZ: EFBIG.
  try:
    with pytest.raises(OSError, match='File too large'):
      npz.save(params, tmp_path / 'model.npz')
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
  assert not os.listdir(tmp_path)


def test_linen_names_option_writes_the_model_numbering(tmp_path):
  params = random_params(vit.VisionTransformer(num_classes=5, **TINY), (16, 16))
  npz.save(params, tmp_path / 'model.npz', linen_names=True)
  keys = set(np.load(tmp_path / 'model.npz').files)
  assert 'Transformer/encoderblock_1/MultiHeadDotProductAttention_0/out/kernel' in keys
  assert 'Transformer/encoderblock_1/LayerNorm_1/bias' in keys
  assert_trees_equal(npz.load(tmp_path / 'model.npz'), params)


def test_old_hybrid_file_with_pre_linen_names_and_4d_group_norm_loads_into_place(tmp_path):
  model = vit.VisionTransformer(
      num_classes=5, **{**TINY, 'patch_size': (2, 2)}, resnet_layers=(1,), resnet_width_factor=0.5)
  params = random_params(model, (32, 32))
  old_names = {'MultiHeadDotProductAttention_0': 'MultiHeadDotProductAttention_1',
               'LayerNorm_1': 'LayerNorm_2', 'MlpBlock_0': 'MlpBlock_3'}
  arrays = {}
  for path, value in flat(params).items():
    if path[0] == 'Transformer' and path[1].startswith('encoderblock_'):
      path = (*path[:2], old_names.get(path[2], path[2]), *path[3:])
    if len(path) > 1 and path[-2].startswith('gn'):
      value = value.reshape(1, 1, 1, -1)
    arrays['/'.join(path)] = value
  assert arrays['block1/unit1/gn_proj/scale'].shape == (1, 1, 1, 128)
  np.savez(tmp_path / 'old.npz', **arrays)

  loaded = npz.load(tmp_path / 'old.npz')
  assert_trees_equal(loaded, params)
  images = images_of(32)
  np.testing.assert_array_equal(logits_of(model, loaded, images), logits_of(model, params, images))


def test_load_reads_paths_with_a_scheme_through_gfile(tmp_path):
  params = write_pretrained(tmp_path / 'model.npz')
  assert_trees_equal(npz.load(f'file://{tmp_path}/model.npz'), params)


def test_finetune_setup_from_224_to_384_px(tmp_path):
  pretrained = write_pretrained(tmp_path / 'model.npz', representation_size=16)
  config = small_config()
  init = init_params(config, (384, 384))
  params = finetune.load_pretrained(tmp_path / 'model.npz', init, model_of(config))

  assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, init)
  assert 'pre_logits' not in params  # The target has no representation layer.
  assert_trees_equal(params['head'], init['head'])  # Fresh, for 3 classes.
  assert_trees_equal(params['Transformer']['encoderblock_0'],
                     pretrained['Transformer']['encoderblock_0'])
  old, new = flat(pretrained)[POSEMB], flat(params)[POSEMB]
  assert (old.shape, new.shape) == ((1, 197, 16), (1, 577, 16))
  np.testing.assert_array_equal(new[:, 0], old[:, 0])  # The class-token row.
  old_grid, new_grid = old[0, 1:].reshape(14, 14, 16), new[0, 1:].reshape(24, 24, 16)
  for corner in [(0, 0), (0, -1), (-1, 0), (-1, -1)]:
    np.testing.assert_allclose(new_grid[corner], old_grid[corner], rtol=1e-6)


def test_keep_head_keeps_the_files_head_when_the_classes_are_the_same(tmp_path):
  pretrained = write_pretrained(tmp_path / 'model.npz')  # 7 classes.
  config = small_config()
  params = finetune.load_pretrained(tmp_path / 'model.npz',
                                      init_params(config, (384, 384), num_classes=7),
                                      model_of(config), keep_head=True)
  assert_trees_equal(params['head'], pretrained['head'])
  with pytest.raises(ValueError, match=r'head/kernel is \(16, 7\) in the file but \(16, 3\) '
                                       r'in the model'):
    finetune.load_pretrained(tmp_path / 'model.npz', init_params(config, (224, 224)),
                               model_of(config), keep_head=True)


def test_representation_layer_is_kept_when_the_target_has_one(tmp_path):
  pretrained = write_pretrained(tmp_path / 'model.npz', representation_size=16)
  config = small_config(representation_size=16)
  params = finetune.load_pretrained(tmp_path / 'model.npz', init_params(config, (224, 224)),
                                      model_of(config))
  assert_trees_equal(params['pre_logits'], pretrained['pre_logits'])
  assert_trees_equal(params['Transformer'], pretrained['Transformer'])  # Same grid: no resize.


def test_gap_model_resizes_its_grid_without_a_class_row(tmp_path):
  pretrained = write_pretrained(tmp_path / 'model.npz', classifier='gap')
  config = small_config(classifier='gap')
  params = finetune.load_pretrained(tmp_path / 'model.npz', init_params(config, (384, 384)),
                                      model_of(config))
  old, new = flat(pretrained)[POSEMB], flat(params)[POSEMB]
  assert (old.shape, new.shape) == ((1, 196, 16), (1, 576, 16))
  np.testing.assert_allclose(new[0, [0, 23, -24, -1]], old[0, [0, 13, -14, -1]], rtol=1e-6)


def test_non_square_target_grid_is_given_explicitly(tmp_path):
  write_pretrained(tmp_path / 'model.npz')
  config = small_config()
  init = init_params(config, (224, 320))
  params = finetune.load_pretrained(tmp_path / 'model.npz', init, model_of(config), grid=(14, 20))
  assert flat(params)[POSEMB].shape == (1, 14 * 20 + 1, 16)
  with pytest.raises(ValueError, match=r"model's position embeddings: 280 grid positions are "
                                       r'not a square grid; give the grid'):
    finetune.load_pretrained(tmp_path / 'model.npz', init, model_of(config))
  with pytest.raises(ValueError, match=r'grid=\(14, 21\) gives 295 .* the model has 281'):
    finetune.load_pretrained(tmp_path / 'model.npz', init, model_of(config), grid=(14, 21))


def test_bilinear_resize_interpolates_in_2d_with_corners_aligned():
  # Embeddings linear in the grid position are reproduced exactly on the new grid, whose
  # corners coincide with the old ones: row r of 3 rows is at r/2 of the height, of 5 rows at r/4.
  rows, cols = np.meshgrid(np.arange(3) / 2, np.arange(4) / 3, indexing='ij')
  grid = np.stack([rows, cols, rows - 2 * cols], axis=-1).reshape(1, 12, 3)
  cls = np.full((1, 1, 3), 7.0)
  resized = finetune.resize_posemb(np.concatenate([cls, grid], axis=1), (5, 7),
                                     has_class_token=True, source_grid_hw=(3, 4))
  rows, cols = np.meshgrid(np.arange(5) / 4, np.arange(7) / 6, indexing='ij')
  expected = np.stack([rows, cols, rows - 2 * cols], axis=-1).reshape(1, 35, 3)
  np.testing.assert_array_equal(resized[:, :1], cls)
  np.testing.assert_allclose(resized[:, 1:], expected, atol=1e-6)


def test_bicubic_differs_from_bilinear_on_curved_embeddings():
  posemb = np.random.default_rng(0).normal(size=(1, 17, 5)).astype(np.float32)
  resize = lambda method: finetune.resize_posemb(posemb, (6, 6), has_class_token=True,
                                                   method=method)
  bilinear, bicubic = resize('bilinear'), resize('bicubic')
  assert bilinear.dtype == np.float32 and bicubic.shape == (1, 37, 5)
  assert not np.allclose(bilinear, bicubic, atol=1e-3)
  np.testing.assert_allclose(bicubic[0, [1, 6, 31, 36]], posemb[0, [1, 4, 13, 16]], rtol=1e-5)
  with pytest.raises(ValueError, match=r"posemb_method='area'; choose one of \['bilinear', "
                                       r"'bicubic'\]"):
    resize('area')


def test_missing_file_names_the_path(tmp_path):
  with pytest.raises(FileNotFoundError, match=f'No such checkpoint file: {tmp_path}/nope.npz'):
    npz.load(tmp_path / 'nope.npz')


def test_file_that_is_not_an_archive_names_the_path(tmp_path):
  (tmp_path / 'model.npz').write_text('not a checkpoint')
  with pytest.raises(ValueError, match=f'{tmp_path}/model.npz is not an .npz checkpoint '
                                       r'archive \(not a zip file\)'):
    npz.load(tmp_path / 'model.npz')
  write_pretrained(tmp_path / 'cut.npz')
  data = (tmp_path / 'cut.npz').read_bytes()
  (tmp_path / 'cut.npz').write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match=f'{tmp_path}/cut.npz is a damaged .npz checkpoint archive'):
    npz.load(tmp_path / 'cut.npz')


def test_missing_and_unexpected_parameters_are_named_with_their_shapes(tmp_path):
  params = write_pretrained(tmp_path / 'model.npz')
  del params['Transformer']['encoderblock_0']['LayerNorm_1']
  params['extra'] = {'kernel': np.ones((2, 3), np.float32)}
  npz.save(params, tmp_path / 'edited.npz')
  config = small_config()
  with pytest.raises(npz.CheckpointError) as error:
    finetune.load_pretrained(tmp_path / 'edited.npz', init_params(config, (224, 224)),
                               model_of(config))
  message = str(error.value)
  assert message.startswith(f'{tmp_path}/edited.npz does not fit the model: ')
  assert 'missing Transformer/encoderblock_0/LayerNorm_1/bias (16,)' in message
  assert 'missing Transformer/encoderblock_0/LayerNorm_1/scale (16,)' in message
  assert 'unexpected extra/kernel (2, 3)' in message
  assert '\n' not in message


def test_differing_shapes_are_named_with_both_shapes(tmp_path):
  write_pretrained(tmp_path / 'model.npz')
  config = small_config()
  config.transformer.mlp_dim = 24
  with pytest.raises(ValueError, match=r'Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel '
                                       r'is \(16, 32\) in the file but \(16, 24\) in the model'):
    finetune.load_pretrained(tmp_path / 'model.npz', init_params(config, (224, 224)),
                               model_of(config))
  params = npz.load(tmp_path / 'model.npz')
  params['Transformer']['posembed_input']['pos_embedding'] = np.zeros((1, 197, 8), np.float32)
  npz.save(params, tmp_path / 'edited.npz')
  config = small_config()
  with pytest.raises(ValueError, match=r'does not fit the model: Transformer/posembed_input/'
                                       r'pos_embedding is \(1, 197, 8\) in the file but '
                                       r'\(1, 577, 16\) in the model\. Check that'):
    finetune.load_pretrained(tmp_path / 'edited.npz', init_params(config, (384, 384)),
                               model_of(config))


def test_representation_layer_missing_from_the_file_is_an_error(tmp_path):
  write_pretrained(tmp_path / 'model.npz')
  config = small_config(representation_size=16)
  with pytest.raises(ValueError, match=r'missing pre_logits/bias \(16,\); missing '
                                       r'pre_logits/kernel \(16, 16\)'):
    finetune.load_pretrained(tmp_path / 'model.npz', init_params(config, (224, 224)),
                               model_of(config))


def test_class_token_checkpoint_into_a_gap_model_is_an_error(tmp_path):
  write_pretrained(tmp_path / 'model.npz')
  config = small_config(classifier='gap')
  with pytest.raises(ValueError, match=r'unexpected cls \(1, 1, 16\)'):
    finetune.load_pretrained(tmp_path / 'model.npz', init_params(config, (224, 224)),
                               model_of(config))


def saved_with_spec(path, name='tiny-gap', **fields):
  """Random params of a tiny model, saved at `path` with its spec; returns (model, params)."""
  model = vit.VisionTransformer(num_classes=5, **{**TINY, **fields})
  params = random_params(model, (16, 16))
  npz.save(params, path, spec=registry.model_spec(model, name))
  return model, params


def test_saved_spec_rebuilds_the_model_that_computes_the_same_logits(tmp_path):
  model, params = saved_with_spec(tmp_path / 'model.npz', classifier='gap',
                                  representation_size=7, approximate_gelu=False)
  loaded_model, loaded = runs.load_model(tmp_path)  # A folder: its model.npz.
  assert (loaded_model.classifier, loaded_model.representation_size,
          loaded_model.approximate_gelu, loaded_model.patch_size) == ('gap', 7, False, (4, 4))
  images = images_of(16)
  np.testing.assert_array_equal(logits_of(loaded_model, loaded, images),
                                logits_of(model, params, images))
  assert runs.load_model(tmp_path / 'model.npz', dtype=jnp.bfloat16)[0].dtype == jnp.bfloat16


def test_spec_is_one_float32_entry_that_parameter_readers_pass_by(tmp_path):
  model, params = saved_with_spec(tmp_path / 'model.npz')
  npz.save(params, tmp_path / 'plain.npz')
  with np.load(tmp_path / 'model.npz') as archive, np.load(tmp_path / 'plain.npz') as plain:
    assert set(archive.files) - set(plain.files) == {npz.SPEC_KEY}
    assert archive[npz.SPEC_KEY].dtype == np.float32
  assert_trees_equal(npz.load(tmp_path / 'model.npz'), params)
  # A reader that keeps every entry, as the official vit_jax's does: flax ignores the extra leaf.
  npz.save(params, tmp_path / 'linen.npz', linen_names=True,
                  spec=registry.model_spec(model))
  with np.load(tmp_path / 'linen.npz') as archive:
    everything = traverse_util.unflatten_dict({tuple(k.split('/')): archive[k]
                                               for k in archive.files})
  images = images_of(16)
  np.testing.assert_array_equal(logits_of(model, everything, images),
                                logits_of(model, params, images))


def test_file_without_spec_loads_through_a_registry_name_and_its_overrides(tmp_path):
  write_pretrained(tmp_path / 'published.npz', representation_size=16)
  with pytest.raises(npz.CheckpointError, match=r'published.npz holds no model spec .*: '
                                                       r'name its model with --model NAME'):
    runs.load_model(tmp_path / 'published.npz')
  finetune.save_model_overrides({'approximate_gelu': False}, tmp_path / 'published.npz')
  model, _ = runs.load_model(tmp_path / 'published.npz', 'testing')
  assert (model.num_classes, model.representation_size, model.approximate_gelu) == (7, 16, False)


def test_model_name_other_than_the_saved_one_is_an_error(tmp_path):
  saved_with_spec(tmp_path / 'model.npz', name='tiny-gap')
  assert runs.load_model(tmp_path, 'tiny-gap')[0].hidden_size == 12
  with pytest.raises(npz.CheckpointError, match=r'model.npz holds a tiny-gap model \(its '
                                                       r'saved spec\), not ViT-B_16'):
    runs.load_model(tmp_path, 'ViT-B_16')


def test_model_resolution_comes_from_the_position_embeddings():
  model = registry.get_model('ViT-B_16', num_classes=1000)
  assert runs.native_image_size(registry.param_shapes(model, 384), model) == 384
  hybrid = registry.get_model('R50+ViT-B_16', num_classes=1000)
  assert runs.native_image_size(registry.param_shapes(hybrid, 224), hybrid) == 224


def test_classes_and_representation_of_a_file_without_spec_follow_its_params(tmp_path):
  params = write_pretrained(tmp_path / 'model.npz', representation_size=16)
  model = runs.model_for_params('testing', params, {'approximate_gelu': False})
  assert (model.approximate_gelu, model.num_classes, model.representation_size) == (False, 7, 16)
  with pytest.raises(ValueError, match='has no head/ parameters'):
    runs.model_for_params('testing', {k: v for k, v in params.items() if k != 'head'}, {})


def test_model_overrides_are_recorded_next_to_the_checkpoint(tmp_path):
  path = tmp_path / 'model.npz'
  assert finetune.load_model_overrides(path) == {}
  finetune.save_model_overrides({'approximate_gelu': False}, path, note='from timm')
  assert os.path.isfile(tmp_path / 'model.overrides.json')
  assert finetune.load_model_overrides(path) == {'approximate_gelu': False}
  for damaged in ('{"approximate', '["approximate_gelu"]', '{"model_overrides": [false]}'):
    (tmp_path / 'model.overrides.json').write_text(damaged)
    with pytest.raises(ValueError, match=r'model.overrides.json is not a model-overrides record'):
      finetune.load_model_overrides(path)


def test_scan_then_unscan_is_exact():
  params = random_params(vit.VisionTransformer(num_classes=5, **{**TINY, 'num_layers': 3}),
                         (16, 16))
  scanned = npz.scan_blocks(params)
  assert npz.is_scanned(scanned) and not npz.is_scanned(params)
  assert not any(name.startswith('encoderblock_') for name in scanned['Transformer'])
  kernel = scanned['Transformer']['encoderblock']['MlpBlock_0']['Dense_0']['kernel']
  assert kernel.shape == (3, 12, 20)  # (L, D, M)
  np.testing.assert_array_equal(
      kernel[2], params['Transformer']['encoderblock_2']['MlpBlock_0']['Dense_0']['kernel'])
  assert_trees_equal(npz.unscan_blocks(scanned), params)
  assert_trees_equal(npz.scan_blocks(scanned), scanned)  # Already scanned: unchanged.


def test_blocks_that_differ_cannot_be_stacked():
  params = random_params(vit.VisionTransformer(num_classes=5, **TINY), (16, 16))
  params['Transformer']['encoderblock_1']['MlpBlock_0']['Dense_0']['kernel'] = np.zeros((12, 8))
  with pytest.raises(npz.CheckpointError,
                     match=r'Transformer/encoderblock_\{i\}/MlpBlock_0/Dense_0/kernel has shapes '
                           r'\[\(12, 8\), \(12, 20\)\] in different blocks'):
    npz.scan_blocks(params)
  del params['Transformer']['encoderblock_1']['LayerNorm_1']
  with pytest.raises(npz.CheckpointError,
                     match=r'Transformer/encoderblock_\{i\}/LayerNorm_1/bias is in blocks \[0\] '
                           r'only, not in all 2'):
    npz.scan_blocks(params)


def test_save_writes_scanned_params_in_the_published_layout(tmp_path):
  params = random_params(vit.VisionTransformer(num_classes=5, **TINY), (16, 16))
  npz.save(npz.scan_blocks(params), tmp_path / 'model.npz')
  keys = set(np.load(tmp_path / 'model.npz').files)
  assert 'Transformer/encoderblock_1/MultiHeadDotProductAttention_1/query/kernel' in keys
  assert not any(key.startswith('Transformer/encoderblock/') for key in keys)
  assert_trees_equal(npz.load(tmp_path / 'model.npz'), params)


def two_layer_config():
  config = small_config()
  config.transformer.num_layers = 2
  return config


def test_published_file_loads_into_a_scanned_model(tmp_path):
  config = two_layer_config()
  pretrained = random_params(registry.get_model(config, num_classes=7), (224, 224))
  npz.save(pretrained, tmp_path / 'model.npz')
  scanned_model = registry.get_model(config, num_classes=3, scan_layers=True)
  init = random_params(scanned_model, (224, 224), seed=1)

  params = finetune.load_pretrained(tmp_path / 'model.npz', init, model_of(config))
  assert jax.tree.map(np.shape, params) == jax.tree.map(np.shape, init)
  assert_trees_equal(npz.unscan_blocks(params)['Transformer']['encoderblock_1'],
                     pretrained['Transformer']['encoderblock_1'])
  per_block = finetune.load_pretrained(tmp_path / 'model.npz', npz.unscan_blocks(init),
                                         model_of(config))
  images = images_of(224, batch=1)
  np.testing.assert_allclose(logits_of(scanned_model, params, images),
                             logits_of(registry.get_model(config, num_classes=3), per_block,
                                       images),
                             rtol=1e-5, atol=1e-5)


def test_scanned_model_mismatches_are_named_in_the_published_layout(tmp_path):
  config = two_layer_config()
  npz.save(random_params(registry.get_model(config, num_classes=7), (224, 224)),
                  tmp_path / 'model.npz')
  finetune.check_matches(
      npz.load(tmp_path / 'model.npz'),
      registry.param_shapes(registry.get_model(config, num_classes=7, scan_layers=True)),
      source='ok')
  config.transformer.mlp_dim = 24
  init = random_params(registry.get_model(config, num_classes=3, scan_layers=True), (224, 224))
  with pytest.raises(ValueError, match=r'Transformer/encoderblock_1/MlpBlock_0/Dense_0/kernel '
                                       r'is \(16, 32\) in the file but \(16, 24\) in the model'):
    finetune.load_pretrained(tmp_path / 'model.npz', init, model_of(config))
  config = two_layer_config()
  config.transformer.num_layers = 3
  with pytest.raises(ValueError, match=r'model.npz does not fit the model: missing '
                                       r'Transformer/encoderblock_2/LayerNorm_0/bias \(16,\)'):
    finetune.check_matches(
        npz.load(tmp_path / 'model.npz'),
        registry.param_shapes(registry.get_model(config, num_classes=7, scan_layers=True)),
        source=str(tmp_path / 'model.npz'))


def test_patch_kernel_resize_gives_an_upsampled_patch_the_token_of_the_original():
  kernel = np.random.default_rng(0).normal(size=(7, 7, 3, 5)).astype(np.float32)
  patches = images_of(size=7, batch=4)
  upsampled = np.asarray(jax.image.resize(patches, (4, 14, 14, 3), 'bilinear'))
  resized = finetune.resize_patch_kernel(kernel, (14, 14))
  assert resized.shape == (14, 14, 3, 5)
  np.testing.assert_allclose(np.einsum('bhwc,hwcd->bd', upsampled, resized),
                             np.einsum('bhwc,hwcd->bd', patches, kernel), rtol=1e-4, atol=1e-4)


def test_grown_patches_keep_the_predictions_on_upsampled_images(tmp_path):
  """Fashion-MNIST images at 28 px, and upsampled to 56 px as the input pipeline resizes: a
  model whose 7 px patches grow to 14 px (kernel resized) gives nearly the same logits, where
  one that keeps its 7 px patches (position embeddings interpolated) does not. Bilinear
  upsampling blends neighbouring patches at their borders, so the first is not exact."""
  with np.load(embedded.PATH) as data:
    gray = data['test_images'][:64]
  images = np.repeat(gray[..., None], 3, -1).astype(np.float32) / 127.5 - 1
  upsampled = np.stack([image_ops.resize(image, 56).numpy() for image in images])
  model = vit.VisionTransformer(num_classes=10, patch_size=(7, 7), **SMALL_VIT)
  # Random weights; the differences between images, not between classes, are compared.
  params = random_params(model, 28, scale=0.3)
  npz.save(params, tmp_path / 'model.npz')
  before = logits_of(model, params, images)

  def logits_at_56(patch):
    grown = model.clone(patch_size=(patch, patch))
    init = random_params(grown, 56, seed=1)
    loaded = finetune.load_pretrained(tmp_path / 'model.npz', init, grown, keep_head=True)
    return logits_of(grown, loaded, upsampled)

  def relative_error(logits):
    return np.linalg.norm(logits - before) / np.linalg.norm(before - before.mean(0))

  grown, kept = logits_at_56(14), logits_at_56(7)
  assert relative_error(grown) < 0.1 < relative_error(kept)  # Measured: 0.06 and 0.56.

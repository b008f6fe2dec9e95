"""Tests of the exporter, vit_jax/export.py, and the shared state-dict table, torch_layout.py.

Without torch: the timm and Hugging Face exports are read back with vit_jax.convert and compared
bit for bit, and their names and shapes against tables of the libraries' own state dicts; the
SavedModel is loaded with TensorFlow and run on the real photos of tests/data.
"""
import functools
import json
import os

import jax
import ml_collections
import numpy as np
from PIL import Image
import pytest
import safetensors
import safetensors.numpy
import tensorflow as tf

from helpers import PHOTOS
from helpers import random_params
from vit_jax.checkpoints import convert
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import torch_layout
from vit_jax.data import image_ops
from vit_jax.models import registry
from vit_jax.tools import export

pytestmark = pytest.mark.xdist_group('export')  # Its module fixtures are built once.

SIZE = 64  # The 'testing' model (patch 16, hidden 16, MLP 32, 2 heads, 1 layer): 4x4 patches.
CLASSES = 5


def assert_same_tree(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  jax.tree.map(np.testing.assert_array_equal, actual, expected)


def save_workdir(path, model_config, params):
  """A training workdir as vit_jax.main leaves it: model.npz and config.json (model, crop)."""
  os.makedirs(path)
  npz.save(params, os.path.join(path, 'model.npz'))
  with open(os.path.join(path, 'config.json'), 'w') as f:
    json.dump({'model': model_config.to_dict(), 'pp': {'crop': SIZE}}, f)
  return str(path)


@pytest.fixture(name='token', scope='module')
def fixture_token(tmp_path_factory):
  """(npz path, params) of the registry's 'testing' model, class token, 5 classes, at 64 px."""
  params = random_params(registry.get_model('testing', num_classes=CLASSES), SIZE)
  path = tmp_path_factory.mktemp('token') / 'vit.npz'
  npz.save(params, path)
  return str(path), params


@pytest.fixture(name='gap', scope='module')
def fixture_gap(tmp_path_factory):
  """(workdir, params) of the 'testing' model with classifier='gap' (no class token)."""
  config = registry.get_model_config('testing')
  config.classifier = 'gap'
  params = random_params(registry.get_model(config, num_classes=CLASSES), SIZE, seed=1)
  return save_workdir(tmp_path_factory.mktemp('gap') / 'workdir', config, params), params


def export_and_convert_back(tmp_path, checkpoint_args, format_name, *convert_args):
  """Exports with the command line, converts back with vit_jax.convert; the params read back."""
  out = str(tmp_path / f'export_{format_name}')
  assert export.main([*checkpoint_args, '--format', format_name, '--out', out]) == 0
  weights = os.path.join(out, 'model.safetensors') if format_name == 'hf' else out
  assert convert.main([weights, str(tmp_path / 'back.npz'), *convert_args]) == 0
  # The models use flax's tanh-approximate GELU (the default): recorded and read back.
  assert npz.read_spec(tmp_path / 'back.npz')['model']['approximate_gelu'] is True
  return npz.load(tmp_path / 'back.npz')


@pytest.mark.parametrize('format_name', ['timm', 'hf'])
def test_class_token_model_exports_and_converts_back_bit_for_bit(token, format_name, tmp_path):
  path, params = token
  back = export_and_convert_back(tmp_path, ['--checkpoint', path, '--model', 'testing'],
                                 format_name, '--model', 'testing')
  assert_same_tree(back, params)


def test_gap_workdir_exports_to_timm_and_converts_back_bit_for_bit(gap, tmp_path):
  workdir, params = gap
  back = export_and_convert_back(tmp_path, ['--checkpoint', workdir], 'timm', '--num_heads', '2')
  assert 'cls' not in back
  assert_same_tree(back, params)


def test_registry_hybrid_exports_as_its_timm_model_and_converts_back_bit_for_bit(tmp_path):
  params = random_params(registry.get_model('R+ViT-Ti_16', num_classes=CLASSES), SIZE)
  npz.save(params, tmp_path / 'hybrid.npz')
  model_args = ['--model', 'R+ViT-Ti_16']
  back = export_and_convert_back(tmp_path, ['--checkpoint', str(tmp_path / 'hybrid.npz'),
                                            *model_args], 'timm', *model_args)
  assert_same_tree(back, params)
  with safetensors.safe_open(tmp_path / 'export_timm', 'numpy') as f:
    assert f.metadata()['timm_model'] == 'vit_tiny_r_s16_p8_224'
    assert 'patch_embed.backbone.conv.weight' in f.keys()  # timm's stem-only backbone.


def test_hybrid_state_dict_converts_back_bit_for_bit():
  # A small hybrid: ResNet stages of 1 and 2 units at width 32 (stride 8), 1x1 patches.
  model = registry.get_model('testing', num_classes=CLASSES, resnet_layers=(1, 2),
                           resnet_width_factor=0.5, patch_size=(1, 1))
  params = random_params(model, SIZE)
  sd = torch_layout.to_state_dict(params, torch_layout.TIMM)
  assert sd['patch_embed.backbone.stages.1.blocks.0.downsample.conv.weight'].shape == (
      256, 128, 1, 1)  # Stage 2: 4 * 64 outputs from stage 1's 4 * 32.
  assert 'patch_embed.backbone.stages.1.blocks.1.downsample.conv.weight' not in sd
  back, _ = convert.convert_state_dict(jax.tree.map(np.asarray, sd), num_heads=2)
  assert_same_tree(back, params)


# Facts: the state dicts of timm's VisionTransformer and of transformers' ViTForImageClassification
# (per block, then outside the blocks), for hidden size D, MLP size M, T tokens, C classes.
TIMM_BLOCK = {'norm1.weight': 'D', 'norm1.bias': 'D', 'attn.qkv.weight': '3D D',
              'attn.qkv.bias': '3D', 'attn.proj.weight': 'D D', 'attn.proj.bias': 'D',
              'norm2.weight': 'D', 'norm2.bias': 'D', 'mlp.fc1.weight': 'M D', 'mlp.fc1.bias': 'M',
              'mlp.fc2.weight': 'D M', 'mlp.fc2.bias': 'D'}
TIMM_REST = {'cls_token': '1 1 D', 'pos_embed': '1 T D', 'patch_embed.proj.weight': 'D 3 P P',
             'patch_embed.proj.bias': 'D', 'norm.weight': 'D', 'norm.bias': 'D',
             'head.weight': 'C D', 'head.bias': 'C'}
HF_BLOCK = {'layernorm_before.weight': 'D', 'layernorm_before.bias': 'D',
            'attention.attention.query.weight': 'D D', 'attention.attention.query.bias': 'D',
            'attention.attention.key.weight': 'D D', 'attention.attention.key.bias': 'D',
            'attention.attention.value.weight': 'D D', 'attention.attention.value.bias': 'D',
            'attention.output.dense.weight': 'D D', 'attention.output.dense.bias': 'D',
            'layernorm_after.weight': 'D', 'layernorm_after.bias': 'D',
            'intermediate.dense.weight': 'M D', 'intermediate.dense.bias': 'M',
            'output.dense.weight': 'D M', 'output.dense.bias': 'D'}
HF_REST = {'vit.embeddings.cls_token': '1 1 D', 'vit.embeddings.position_embeddings': '1 T D',
           'vit.embeddings.patch_embeddings.projection.weight': 'D 3 P P',
           'vit.embeddings.patch_embeddings.projection.bias': 'D', 'vit.layernorm.weight': 'D',
           'vit.layernorm.bias': 'D', 'classifier.weight': 'C D', 'classifier.bias': 'C'}


def expected_shapes(block, rest, block_prefix, layers, **sizes):
  """{key: shape} from the tables, the symbols replaced by `sizes` (D=768...); '3D' is 3 * D."""
  def dim(s):
    return int(s) if s.isdigit() else int(s[:-1] or 1) * sizes[s[-1]]

  def shape(spec):
    return tuple(dim(s) for s in spec.split())
  table = {key: shape(spec) for key, spec in rest.items()}
  for i in range(layers):
    table.update({f'{block_prefix}{i}.{key}': shape(spec) for key, spec in block.items()})
  return table


def exported_shapes(model_name, layout):
  """{key: shape} of the export of registry model `model_name` (1000 classes, 224 px)."""
  shapes = registry.param_shapes(registry.get_model(model_name, num_classes=1000), 224)
  exported = jax.eval_shape(functools.partial(torch_layout.to_state_dict, layout=layout), shapes)
  return {key: tuple(value.shape) for key, value in exported.items()}


@pytest.mark.parametrize('model_name,d,m', [('ViT-Ti_16', 192, 768), ('ViT-B_16', 768, 3072)])
def test_exported_names_and_shapes_are_timm_and_hugging_faces(model_name, d, m):
  sizes = dict(D=d, M=m, T=197, P=16, C=1000)
  assert exported_shapes(model_name, torch_layout.TIMM) == expected_shapes(
      TIMM_BLOCK, TIMM_REST, 'blocks.', 12, **sizes)
  assert exported_shapes(model_name, torch_layout.HUGGING_FACE) == expected_shapes(
      HF_BLOCK, HF_REST, 'vit.encoder.layer.', 12, **sizes)


def test_gap_model_exports_timms_state_dict_without_class_token():
  rest = {k: v for k, v in TIMM_REST.items() if k != 'cls_token'}
  assert exported_shapes('ViT-B_16-gap', torch_layout.TIMM) == expected_shapes(
      TIMM_BLOCK, rest, 'blocks.', 12, D=768, M=3072, T=196, P=16, C=1000)


def test_r50_hybrid_exports_timms_resnet_backbone_names():
  shapes = exported_shapes('R50+ViT-B_16', torch_layout.TIMM)
  backbone = 'patch_embed.backbone.'
  assert shapes[backbone + 'stem.conv.weight'] == (64, 3, 7, 7)
  assert shapes[backbone + 'stem.norm.weight'] == (64,)
  assert shapes[backbone + 'stages.0.blocks.0.downsample.conv.weight'] == (256, 64, 1, 1)
  assert shapes[backbone + 'stages.1.blocks.0.conv2.weight'] == (128, 128, 3, 3)
  assert shapes[backbone + 'stages.2.blocks.8.norm3.bias'] == (1024,)
  assert shapes['patch_embed.proj.weight'] == (768, 1024, 1, 1)
  assert shapes['pos_embed'] == (1, 197, 768)  # 14x14 positions at stride 16, and the class.
  units = [k for k in shapes if k.startswith(backbone + 'stages.') and k.endswith('conv1.weight')]
  assert len(units) == 3 + 4 + 9


def test_hugging_face_directory_has_config_and_preprocessing(token, tmp_path):
  path, _ = token
  (tmp_path / 'labels.txt').write_text('ant\nbee\ncat\ndog\neel\n')
  out = tmp_path / 'hf'
  assert export.main(['--checkpoint', path, '--model', 'testing', '--format', 'hf',
                      '--out', str(out), '--labels', str(tmp_path / 'labels.txt')]) == 0
  config = json.loads((out / 'config.json').read_text())
  assert {k: config[k] for k in ('hidden_size', 'num_hidden_layers', 'num_attention_heads',
                                 'intermediate_size', 'image_size', 'patch_size')} == {
      'hidden_size': 16, 'num_hidden_layers': 1, 'num_attention_heads': 2,
      'intermediate_size': 32, 'image_size': 64, 'patch_size': 16}
  assert config['hidden_act'] == 'gelu_new'  # Transformers' tanh approximation, as flax's.
  assert config['layer_norm_eps'] == 1e-6
  assert config['id2label'] == {'0': 'ant', '1': 'bee', '2': 'cat', '3': 'dog', '4': 'eel'}
  assert config['label2id']['eel'] == 4
  preprocessor = json.loads((out / 'preprocessor_config.json').read_text())
  assert preprocessor['size'] == {'height': 64, 'width': 64}
  # (x / 255 - 0.5) / 0.5 = x / 127.5 - 1, our scaling.
  assert preprocessor['image_mean'] == preprocessor['image_std'] == [0.5, 0.5, 0.5]
  with safetensors.safe_open(out / 'model.safetensors', 'numpy') as f:
    assert f.metadata() == {'format': 'pt'}  # Transformers refuses files without it.


def test_exact_gelu_is_named_for_both_libraries():
  model = registry.get_model('testing', num_classes=CLASSES, approximate_gelu=False)
  assert export.hugging_face_config(model, SIZE, ['a'] * CLASSES)['hidden_act'] == 'gelu'
  assert export.timm_model_args(model, SIZE)[1]['act_layer'] == 'gelu'


def test_timm_file_records_the_model_arguments(gap, tmp_path, capsys):
  workdir, _ = gap
  out = tmp_path / 'gap.safetensors'
  assert export.main(['--checkpoint', workdir, '--format', 'timm', '--out', str(out)]) == 0
  assert 'timm.models.vision_transformer.VisionTransformer(' in capsys.readouterr().out
  with safetensors.safe_open(out, 'numpy') as f:
    metadata = f.metadata()
  assert metadata['timm_model'] == 'VisionTransformer'
  assert json.loads(metadata['timm_model_args']) == {
      'patch_size': 16, 'embed_dim': 16, 'depth': 1, 'num_heads': 2, 'mlp_ratio': 2.0,
      'img_size': 64, 'num_classes': 5, 'act_layer': 'gelu_tanh', 'class_token': False,
      'global_pool': 'avg', 'fc_norm': False}


@pytest.mark.parametrize('format_name,overrides,message', [
    ('hf', {'classifier': 'gap'}, "ViTForImageClassification classifies the class token, and "
                                  "classifier='gap' has none: use --format timm or saved_model"),
    ('hf', {'representation_size': 8}, 'ViTForImageClassification has no pre-logits layer'),
    ('hf', {'resnet_layers': ()}, 'ViTForImageClassification has no ResNet stem'),
    ('timm', {'representation_size': 8}, "timm's VisionTransformer has no pre-logits"),
    ('timm', {'classifier': 'unpooled'}, "classifier='unpooled' gives per-token logits"),
    ('timm', {'resnet_layers': (1, 2)}, 'timm has no hybrid of ResNet units (1, 2)'),
])
def test_formats_refuse_models_they_cannot_represent(format_name, overrides, message):
  model = registry.get_model('testing', num_classes=CLASSES, **overrides)
  with pytest.raises(export.ExportError, match=message.replace('(', r'\(').replace(')', r'\)')):
    export.check_exportable(model, format_name)


def test_refusal_and_existing_output_are_one_line_errors_that_write_nothing(gap, tmp_path, capsys):
  workdir, _ = gap
  out = tmp_path / 'hf'
  assert export.main(['--checkpoint', workdir, '--format', 'hf', '--out', str(out)]) == 1
  error = capsys.readouterr().err
  assert error.startswith("error: Hugging Face's ViTForImageClassification classifies")
  assert error.count('\n') == 1 and not out.exists() and os.listdir(tmp_path) == []
  (tmp_path / 'mine.safetensors').write_text('precious')
  assert export.main(['--checkpoint', workdir, '--format', 'timm',
                      '--out', str(tmp_path / 'mine.safetensors')]) == 1
  assert 'mine.safetensors exists: give another --out' in capsys.readouterr().err
  assert (tmp_path / 'mine.safetensors').read_text() == 'precious'
  assert export.main(['--checkpoint', workdir, '--format', 'timm', '--labels', 'imagenet2012',
                      '--out', str(tmp_path / 'new.safetensors')]) == 1
  assert '--format timm has no place for class names: drop --labels' in capsys.readouterr().err


def test_default_output_is_beside_the_checkpoint(tmp_path):
  assert export.default_out('runs/vit.npz', 'timm') == 'runs/vit_timm.safetensors'
  assert export.default_out(str(tmp_path), 'hf') == f'{tmp_path}/model_hf'
  assert export.default_out('vit.npz', 'tflite') == 'vit.tflite'


# The SavedModel.


@pytest.fixture(name='saved_model', scope='module')
def fixture_saved_model(token, tmp_path_factory):
  """The token model exported as a SavedModel and loaded back with tf.saved_model.load."""
  path, _ = token
  out = str(tmp_path_factory.mktemp('saved') / 'saved_model')
  assert export.main(['--checkpoint', path, '--model', 'testing', '--format', 'saved_model',
                      '--out', out]) == 0
  return tf.saved_model.load(out)


def photos(size=None):
  """The JPEG photos of tests/data as uint8 (B, H, W, 3), resized (PIL, bilinear) to `size`."""
  images = []
  for path in PHOTOS[:3]:
    with Image.open(path) as image:
      image = image.convert('RGB')
      images.append(np.asarray(image.resize((size, size), Image.Resampling.BILINEAR)
                               if size else image))
  return np.stack(images)


def apply_logits(params, images):
  """model.apply's logits of (B, 64, 64, 3) images in [-1, 1]."""
  model = registry.get_model('testing', num_classes=CLASSES)
  return np.asarray(model.apply({'params': params}, images, train=False))


def test_saved_model_gives_the_logits_of_model_apply_on_real_photos(token, saved_model):
  _, params = token
  images = photos(SIZE)
  expected = apply_logits(params, images.astype(np.float32) / 127.5 - 1)
  as_uint8 = saved_model.signatures['serving_default'](images=tf.constant(images))['logits']
  np.testing.assert_allclose(as_uint8.numpy(), expected, rtol=1e-4, atol=1e-6)
  as_float = saved_model.signatures['serving_float'](
      images=tf.constant(images[:1].astype(np.float32)))['logits']  # Another batch size.
  np.testing.assert_allclose(as_float.numpy(), expected[:1], rtol=1e-4, atol=1e-6)


def test_saved_model_resizes_like_the_eval_pipeline(token, saved_model):
  _, params = token
  images = photos()  # 512x512.
  assert images.shape[1:] == (512, 512, 3)
  pp = ml_collections.ConfigDict({'crop': SIZE})
  expected = apply_logits(params, np.stack(
      [image_ops.preprocess_eval(tf.constant(x), pp).numpy() for x in images]))
  logits = saved_model.signatures['serving_default'](images=tf.constant(images))['logits']
  np.testing.assert_allclose(logits.numpy(), expected, rtol=1e-4, atol=1e-6)


# TensorFlow's interpreter serves here only to check the file; its deprecation in favour of the
# ai_edge_litert package, which reads the same files, is no concern of vit_jax's.
@pytest.mark.filterwarnings('ignore:.*tf.lite.Interpreter is deprecated:UserWarning')
def test_tflite_gives_the_logits_of_model_apply_on_a_real_photo(token, tmp_path):
  path, params = token
  out = str(tmp_path / 'vit.tflite')
  assert export.main(['--checkpoint', path, '--model', 'testing', '--format', 'tflite',
                      '--out', out]) == 0
  interpreter = tf.lite.Interpreter(model_path=out)
  image = photos(SIZE)[:1]
  logits = interpreter.get_signature_runner()(images=image)['logits']
  expected = apply_logits(params, image.astype(np.float32) / 127.5 - 1)
  np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-6)

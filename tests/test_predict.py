"""Tests of the command-line classifier, vit_jax/tools/predict.py, on the real photos in
tests/data."""
import csv
import os
import re
import shutil
import types

import jax
import numpy as np
import pytest

from helpers import PHOTOS
from helpers import random_params
from helpers import tiny_config
from helpers import wide_image
from vit_jax.checkpoints import npz
from vit_jax.data import image_files
from vit_jax.models import registry
from vit_jax.models import vit
from vit_jax.tools import predict
from vit_jax.training import trainer

LABELS = ['ant', 'bee', 'cat', 'dog', 'eel']


@pytest.fixture(name='files')
def fixture_files(tmp_path):
  """A checkpoint of the tiny 'testing' model (patch 16) at 32 px, 5 labels, a corrupt image."""
  params = random_params(registry.get_model('testing', num_classes=5), 32)
  npz.save(params, tmp_path / 'model.npz')
  (tmp_path / 'labels.txt').write_text('\n'.join(LABELS) + '\n')
  (tmp_path / 'corrupt.jpg').write_bytes(open(PHOTOS[0], 'rb').read()[:300])
  return params, str(tmp_path)


def parse_output(text):
  """{image path: [(probability in %, label, index), ...]} from predict's standard output."""
  results, current = {}, None
  for line in text.splitlines():
    if line.startswith('  '):
      percent, label, index = re.fullmatch(r'\s+([\d.]+)%  (.+) \((\d+)\)', line).groups()
      results[current].append((float(percent), label, int(index)))
    else:
      current = line.rsplit(' (', 1)[0]
      results[current] = []
  return results


def test_prints_top_5_of_each_real_photo_and_reports_bad_files_by_name(files, capsys):
  params, tmp = files
  missing, corrupt = f'{tmp}/missing.jpg', f'{tmp}/corrupt.jpg'
  status = predict.main(['--model', 'testing', '--checkpoint', f'{tmp}/model.npz',
                         '--labels', f'{tmp}/labels.txt', PHOTOS[0], missing, corrupt, *PHOTOS[1:]])
  out, err = capsys.readouterr()
  assert status == 1
  assert f'error: {missing}: no such file' in err
  assert f'error: {corrupt}: cannot decode the image' in err
  assert f'{PHOTOS[0]} (32x32 px):' in out
  results = parse_output(out)
  assert list(results) == PHOTOS

  model = registry.get_model('testing', num_classes=5)
  images = np.stack([image_files.load_image(p, 32) for p in PHOTOS])
  expected = jax.jit(lambda x: jax.nn.softmax(model.apply({'params': params}, x, train=False)))(
      images)
  for path, probabilities in zip(PHOTOS, np.asarray(expected) * 100):
    top = results[path]
    assert [i for _, _, i in top] == list(np.argsort(-probabilities)[:5])
    assert [label for _, label, _ in top] == [LABELS[i] for _, _, i in top]
    np.testing.assert_allclose([p for p, _, _ in top], np.sort(probabilities)[::-1], atol=0.01)


def test_other_image_size_resizes_the_position_embeddings(files, capsys):
  _, tmp = files
  assert predict.main(['--model', 'testing', '--checkpoint', f'{tmp}/model.npz',
                       '--image_size', '48', PHOTOS[0]]) == 0
  out = capsys.readouterr().out
  assert out.startswith(f'{PHOTOS[0]} (48x48 px):\n')
  top = parse_output(out)[PHOTOS[0]]
  assert len(top) == 5 and all(label == f'class {i}' for _, label, i in top)  # No --labels.
  assert predict.main(['--model', 'testing', '--checkpoint', f'{tmp}/model.npz',
                       '--image_size', '30', PHOTOS[0]]) == 1
  assert capsys.readouterr().err == (
      'error: Image size 30x30 is not divisible by the patch size 16x16. Resize the images to a '
      'multiple of it, e.g. 16x16.\n')


def test_workdir_of_a_run_is_classified_by_its_saved_model(tmp_path, capsys):
  # As training saves it: a model of no registry name (7x7 patches of 28 px images), its spec.
  model = vit.VisionTransformer(num_classes=3, patch_size=(7, 7), hidden_size=16,
                                       mlp_dim=32, num_heads=2, num_layers=1)
  params = random_params(model, 28)
  npz.save(params, tmp_path / 'model.npz', spec=registry.model_spec(model, 'ViT-mini_7'))
  assert predict.main(['--checkpoint', str(tmp_path), PHOTOS[0]]) == 0
  out = capsys.readouterr().out
  assert out.startswith(f'{PHOTOS[0]} (28x28 px):\n')
  image = image_files.load_image(PHOTOS[0], 28)[None]
  expected = 100 * np.asarray(jax.nn.softmax(model.apply({'params': params}, image, train=False)))
  top = parse_output(out)[PHOTOS[0]]
  assert [i for _, _, i in top] == list(np.argsort(-expected[0])[:3])


def test_checkpoint_errors_are_one_line_and_exit_with_1(files, capsys):
  _, tmp = files
  run = lambda *args: predict.main(['--checkpoint', *args, PHOTOS[0]])
  assert run(f'{tmp}/nope.npz', '--model', 'testing') == 1
  assert capsys.readouterr().err == f'error: No such checkpoint file: {tmp}/nope.npz\n'
  assert run(f'{tmp}/model.npz', '--model', 'ViT-Ti_16') == 1
  assert re.fullmatch(rf'error: {tmp}/model.npz does not fit the model: Transformer/encoder_norm/'
                      r'bias is \(16,\) in the file but \(192,\) in the model; .*\n',
                      capsys.readouterr().err)
  assert run(f'{tmp}/model.npz', '--model', 'testing', '--labels', 'imagenet2012') == 1
  assert 'name 1000 classes but the checkpoint has 5' in capsys.readouterr().err


def test_a_run_that_evaluated_with_a_resize_records_it_and_predict_frames_images_so(tmp_path,
                                                                                   capsys):
  config = tiny_config(model_name='tiny')
  config.pp.resize = 40  # Evaluation: the short side to 40 px, then the centre 28 x 28.
  model = registry.get_model(config.model, num_classes=5)
  params = random_params(model, 28)
  trainer.write_model(types.SimpleNamespace(params=params, ema=None, step=0), model, config,
                      str(tmp_path), LABELS)
  assert npz.read_spec(tmp_path / 'model.npz')['resize'] == 40
  image = wide_image(tmp_path / 'wide.png')  # 40 x 80 px, green in its middle 40 columns.
  assert predict.main(['--checkpoint', str(tmp_path), image]) == 0
  green = np.broadcast_to(np.float32([-1, 1, -1]), (1, 28, 28, 3))
  expected = 100 * np.asarray(jax.nn.softmax(model.apply({'params': params}, green,
                                                        train=False)))[0]
  printed = parse_output(capsys.readouterr().out)[image]
  np.testing.assert_allclose([p for p, _, _ in printed], np.sort(expected)[::-1], atol=0.01)
  # At 56 px the framing scales with the size: the short side to 80 px, then the centre, green.
  assert predict.main(['--checkpoint', str(tmp_path), '--image_size', '56', image]) == 0
  wide = predict.at_size(model, 28, 56)
  expected = 100 * np.asarray(jax.nn.softmax(wide.apply(
      {'params': params}, np.broadcast_to(np.float32([-1, 1, -1]), (1, 56, 56, 3)),
      train=False)))[0]
  printed = parse_output(capsys.readouterr().out)[image]
  np.testing.assert_allclose([p for p, _, _ in printed], np.sort(expected)[::-1], atol=0.01)


def test_a_folder_stands_for_its_images_and_out_writes_them_to_a_new_csv_file(files, tmp_path,
                                                                              capsys):
  _, tmp = files
  folder = tmp_path / 'photos'
  (folder / 'more').mkdir(parents=True)
  expected = [str(folder / os.path.basename(p)) for p in PHOTOS[:2]] + [
      str(folder / 'more' / os.path.basename(p)) for p in PHOTOS[2:]]  # Two one folder down.
  for photo, copy in zip(PHOTOS, expected):
    shutil.copy(photo, copy)
  shutil.copy(PHOTOS[0], folder / '._hidden.jpg')
  (folder / 'notes.txt').write_text('not an image')
  command = ['--model', 'testing', '--checkpoint', f'{tmp}/model.npz', '--labels',
             f'{tmp}/labels.txt']
  assert predict.main([*command, str(folder)]) == 0
  printed = parse_output(capsys.readouterr().out)
  assert list(printed) == sorted(expected)
  assert predict.main([*command, *expected]) == 0  # As when each file is named.
  assert parse_output(capsys.readouterr().out) == printed

  out = tmp_path / 'results' / 'predictions.csv'  # Its folder is made.
  assert predict.main([*command, '--top', '2', '--out', str(out), str(folder)]) == 0
  assert capsys.readouterr().out == f'Wrote the top 2 classes of 4 images to {out}.\n'
  with open(out, newline='') as f:
    header, *rows = csv.reader(f)
  assert header == ['file', 'class_1', 'probability_1', 'class_2', 'probability_2']
  assert [row[0] for row in rows] == sorted(expected)
  for file, *top in rows:
    assert top[0::2] == [label for _, label, _ in printed[file][:2]]
    np.testing.assert_allclose([100 * float(p) for p in top[1::2]],
                               [p for p, _, _ in printed[file][:2]], atol=0.01)

  # Nothing is overwritten; a folder without images is one line.
  assert predict.main([*command, '--out', str(out), str(folder)]) == 1
  assert capsys.readouterr().err == (
      f'error: {out} exists: give another --out, or move it away first (nothing is '
      'overwritten).\n')
  (tmp_path / 'empty').mkdir()
  assert predict.main([*command, str(tmp_path / 'empty')]) == 1
  assert capsys.readouterr().err.startswith(f'error: The folder {tmp_path}/empty holds no .jpg')


def test_images_that_would_write_the_same_mask_are_named_before_the_model_loads(tmp_path, capsys):
  for folder in ('a', 'b'):
    (tmp_path / folder).mkdir()
    shutil.copy(PHOTOS[0], tmp_path / folder / 'photo.jpg')
  # No checkpoint at all: the masks are checked first.
  assert predict.main(['--checkpoint', str(tmp_path / 'none'), '--masks', str(tmp_path / 'masks'),
                       str(tmp_path / 'a' / 'photo.jpg'), str(tmp_path / 'b' / 'photo.jpg')]) == 1
  assert capsys.readouterr().err == (
      f'error: {tmp_path}/a/photo.jpg and {tmp_path}/b/photo.jpg would both write their mask to '
      f'{tmp_path}/masks/photo.png: predict them with --masks folders of their own.\n')
  assert not (tmp_path / 'masks').exists()

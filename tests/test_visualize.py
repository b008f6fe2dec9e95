"""Tests of the figure-writing command line, vit_jax/visualize.py."""
import json
import os

import ml_collections
import numpy as np
from PIL import Image
import pytest

from helpers import random_params
from helpers import tiny_config
from vit_jax.checkpoints import npz
from vit_jax.models import registry
from vit_jax.tools import visualize

MODEL_FIGURES = ['attention_rollout', 'attention_layers', 'attention_heads', 'position_similarity',
                 'mean_attention_distance', 'embedding_filters']
# A registry-style config, as training saves it in config.json: a hybrid (ResNet root, stride 4,
# under 2x2 patches: 8 px per patch) that pools by the token mean.
TINY_HYBRID_GAP = {
    'name': 'tiny-hybrid-gap', 'patches': {'size': [2, 2]}, 'hidden_size': 12,
    'transformer': {'mlp_dim': 24, 'num_heads': 3, 'num_layers': 2, 'dropout_rate': 0.0,
                    'attention_dropout_rate': 0.0},
    'classifier': 'gap', 'representation_size': None,
    'resnet': {'num_layers': [], 'width_factor': 0.5},
}


def save_random_checkpoint(model, image_size, path):
  """Random parameters of the model at `image_size`, saved in the published .npz layout."""
  npz.save(random_params(model, image_size, scale=0.3), path)


def write_images(folder):
  """Two non-square images, a PNG and a JPEG, of a bright square on a gradient."""
  paths = []
  for i, ext in enumerate(['png', 'jpg']):
    pixels = np.zeros((40, 56, 3), np.uint8)
    pixels[..., 0] = np.linspace(0, 255, 56)
    pixels[8 + 10 * i:24 + 10 * i, 10:30] = 255
    paths.append(str(folder / f'image{i}.{ext}'))
    Image.fromarray(pixels).save(paths[-1])
  return paths


def assert_is_figure_png(path):
  """A PNG of a readable size that is not blank."""
  with Image.open(path) as image:
    assert image.format == 'PNG'
    width, height = image.size
    grey = np.asarray(image.convert('L'))
  assert 300 <= width <= 4000 and 250 <= height <= 4000, (path, image.size)
  assert (grey < 250).mean() > 0.03, f'{path} is almost blank'


def written_paths(capsys, argv):
  """Runs the command line; returns the paths it printed, checking it exits with status 0."""
  assert visualize.main(argv) == 0
  printed = capsys.readouterr()
  return printed.out.split(), printed.err


def test_npz_checkpoint_writes_every_model_figure(tmp_path, capsys):
  npz = str(tmp_path / 'testing.npz')
  save_random_checkpoint(registry.get_model('testing', num_classes=3), 64, npz)
  output = tmp_path / 'figures'
  paths, errors = written_paths(capsys, ['--checkpoint', npz, '--model', 'testing', '--output',
                                         str(output), '--images'] + write_images(tmp_path))
  assert paths == [str(output / f'{name}.png') for name in MODEL_FIGURES]
  assert 'Skipped training_curves: it needs a training workdir' in errors
  for path in paths:
    assert_is_figure_png(path)


@pytest.mark.parametrize('image_size', [28, 56])
def test_titles_fit_maps_cover_images_and_grey_filters_are_grey(image_size):
  model = registry.get_model(tiny_config().model, num_classes=10)
  params = random_params(model, image_size)
  name = '20261130-211425-c4l97bb5'  # A timestamped workdir's name.
  figures = visualize.model_figures(model, params, image_size,
                                    visualize.embedded_images(3, image_size), name,
                                    visualize.FIGURES, grey_input=True)
  steps = np.arange(1, 11)
  figures['training_curves'] = visualize.plot_training_curves(
      {'train_loss': (steps, 1 / steps)}, f'{name}: training')
  assert sorted(figures) == sorted(visualize.FIGURES)
  for figure_name, fig in figures.items():
    fig.canvas.draw()
    drawn = fig.get_tightbbox(fig.canvas.get_renderer())  # In inches.
    width, height = fig.get_size_inches()
    assert (drawn.x0 >= -0.01 and drawn.y0 >= -0.01 and drawn.x1 <= width + 0.01 and
            drawn.y1 <= height + 0.01), (figure_name, drawn, (width, height))
    assert fig.get_suptitle().replace('\n', ' ').startswith(f'{name}: '), figure_name
  for figure_name in ('attention_rollout', 'attention_layers', 'attention_heads'):
    for ax in figures[figure_name].axes:
      if len(ax.images) == 2:  # An image and the map over it: the same pixels.
        assert ax.images[1].get_extent() == ax.images[0].get_extent(), figure_name
  assert all(ax.images[0].get_array().ndim == 2  # Grey, not RGB.
             for ax in figures['embedding_filters'].axes if ax.images)


def test_older_workdir_builds_its_model_from_config_and_draws_training_curves(tmp_path, capsys):
  """A run of a version that saved no model spec: config.json names the model."""
  from clu import metric_writers  # It imports TensorFlow.
  workdir = tmp_path / 'workdir'
  workdir.mkdir()
  model = registry.get_model(ml_collections.ConfigDict(TINY_HYBRID_GAP), num_classes=10)
  save_random_checkpoint(model, 32, str(workdir / 'model.npz'))
  (workdir / 'config.json').write_text(json.dumps({'model': TINY_HYBRID_GAP, 'pp': {'crop': 32}}))
  writer = metric_writers.create_default_writer(str(workdir))
  for step in range(1, 21):
    writer.write_scalars(step, {'train_loss': 2 / step, 'learning_rate': 1e-3 * min(1, step / 5)})
    if step % 5 == 0:
      writer.write_scalars(step, {'test_loss': 2.5 / step, 'test_accuracy': 0.04 * step})
  writer.close()

  # Without --images: the embedded Fashion-MNIST test images.
  paths, errors = written_paths(capsys, ['--checkpoint', str(workdir), '--output',
                                         str(tmp_path / 'figures'), '--num_images', '3'])
  names = [os.path.basename(p)[:-len('.png')] for p in paths]
  # The hybrid's embedding sees ResNet channels, not pixels: no RGB filters to draw.
  assert names == [n for n in MODEL_FIGURES if n != 'embedding_filters'] + ['training_curves']
  assert 'Skipped embedding_filters' in errors
  for path in paths:
    assert_is_figure_png(path)


def test_training_curves_alone_need_no_model(tmp_path, capsys):
  from clu import metric_writers  # It imports TensorFlow.
  writer = metric_writers.create_default_writer(str(tmp_path))
  writer.write_scalars(1, {'train_loss': 1.0})
  writer.close()
  paths, _ = written_paths(capsys, ['--checkpoint', str(tmp_path), '--output',
                                    str(tmp_path / 'figures'), '--figures', 'training_curves'])
  assert paths == [str(tmp_path / 'figures' / 'training_curves.png')]
  assert_is_figure_png(paths[0])


def error_of(capsys, argv):
  """Runs the command line; returns its error message, checking it exits with status 1."""
  assert visualize.main(argv) == 1
  printed = capsys.readouterr()
  assert printed.out == ''
  return printed.err


def test_missing_checkpoint_is_named(tmp_path, capsys):
  missing = str(tmp_path / 'missing_dir')
  for output in (['--output', str(tmp_path)], []):  # Without --output: not "give --output".
    assert error_of(capsys, ['--checkpoint', missing, *output]) == (
        f'error: --checkpoint {missing} does not exist: give a training workdir or an .npz '
        'checkpoint.\n')


def test_npz_without_spec_or_model_name_is_a_clear_error(tmp_path, capsys):
  npz = str(tmp_path / 'x.npz')
  save_random_checkpoint(registry.get_model('testing', num_classes=3), 32, npz)
  assert error_of(capsys, ['--checkpoint', npz, '--output', str(tmp_path)]).startswith(
      f'error: {npz} holds no model spec (a published file, or one written before vit_jax saved '
      'specs): name its model with --model NAME (one of ViT-Ti_16')


def test_checkpoint_of_another_model_names_the_mismatched_parameters(tmp_path, capsys):
  npz = str(tmp_path / 'testing.npz')
  save_random_checkpoint(registry.get_model('testing', num_classes=3), 32, npz)
  error = error_of(capsys, ['--checkpoint', npz, '--model', 'ViT-Ti_16', '--output', str(tmp_path)])
  assert f'{npz} does not fit the model' in error
  assert 'Transformer/encoder_norm/bias is (16,) in the file but (192,) in the model' in error


def test_missing_image_file_is_a_clear_error(tmp_path, capsys):
  npz = str(tmp_path / 'testing.npz')
  save_random_checkpoint(registry.get_model('testing', num_classes=3), 32, npz)
  missing = str(tmp_path / 'nope.jpg')
  error = error_of(capsys, ['--checkpoint', npz, '--model', 'testing', '--output', str(tmp_path),
                            '--images', missing])
  assert error == f'error: {missing}: no such file\n'


def test_workdir_without_model_npz_is_a_clear_error(tmp_path, capsys):
  error = error_of(capsys, ['--checkpoint', str(tmp_path), '--output', str(tmp_path / 'figures')])
  assert error == f'error: No such checkpoint file: {tmp_path / "model.npz"}\n'


def test_figures_of_the_same_checkpoint_are_redrawn_and_no_other_file_is_overwritten(tmp_path,
                                                                                    capsys):
  model = registry.get_model('testing', num_classes=3)
  first, second = str(tmp_path / 'first.npz'), str(tmp_path / 'second.npz')
  save_random_checkpoint(model, 32, first)
  save_random_checkpoint(model, 32, second)
  output = tmp_path / 'figures'
  command = ['--model', 'testing', '--output', str(output), '--figures', 'position_similarity',
             'embedding_filters']
  assert visualize.main(['--checkpoint', first, *command]) == 0
  drawn = (output / 'position_similarity.png').read_bytes()
  # The same command again draws its figures again, in their place.
  (output / 'embedding_filters.png').unlink()
  assert visualize.main(['--checkpoint', first, *command]) == 0
  assert (output / 'embedding_filters.png').exists()
  capsys.readouterr()
  # Another checkpoint's figures, and a file of the user's, stay as they are.
  assert visualize.main(['--checkpoint', second, *command]) == 1
  assert capsys.readouterr().err == (
      f'error: {output}/position_similarity.png exists and is a figure of ../first.npz: move '
      'it, or give another --output (visualize overwrites only its figures of the same '
      'checkpoint).\n')
  assert (output / 'position_similarity.png').read_bytes() == drawn
  (output / 'embedding_filters.png').write_bytes(b'my own notes')
  assert visualize.main(['--checkpoint', first, *command]) == 1
  assert capsys.readouterr().err.startswith(
      f'error: {output}/embedding_filters.png exists and holds no record of visualize drawing it')
  assert (output / 'embedding_filters.png').read_bytes() == b'my own notes'
  # An --output that cannot be made is one line before anything is drawn.
  under_a_file = output / 'embedding_filters.png' / 'figures'
  assert visualize.main(['--checkpoint', first, '--model', 'testing', '--output',
                         str(under_a_file)]) == 1
  assert capsys.readouterr().err == (
      f'error: --output {under_a_file} cannot be made ({output}/embedding_filters.png is a file, '
      'not a folder): give another --output.\n')

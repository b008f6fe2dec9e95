"""Tests of vit_jax/data/image_files.py: a user's images and class-name files, on the real photos
in tests/data."""
import numpy as np
from PIL import Image
import pytest

from helpers import PHOTOS
from vit_jax.data import image_files


def test_load_image_resizes_and_scales_to_minus_one_one():
  image = image_files.load_image(PHOTOS[0], 64)
  assert image.shape == (64, 64, 3) and image.dtype == np.float32
  assert -1 <= image.min() < -0.5 and 0.5 < image.max() <= 1
  assert image_files.load_image(PHOTOS[3], 64).shape == (64, 64, 3)  # A 32x32 PNG, upsampled.


def test_imagenet2012_labels_are_tfds_names_in_label_order():
  names = image_files.load_labels('imagenet2012', 1000)
  assert len(names) == 1000
  assert (names[0], names[243], names[438]) == ('n01440764', 'n02108422', 'n02815834')


def test_labels_come_from_a_file_else_the_saved_names_else_class_indices(tmp_path):
  (tmp_path / 'labels.txt').write_text('ant\nbee\n\ncat\n')  # A blank line names no class.
  assert image_files.load_labels(str(tmp_path / 'labels.txt'), 3) == ['ant', 'bee', 'cat']
  assert image_files.load_labels(None, 2, ['ant', 'bee']) == ['ant', 'bee']
  assert image_files.load_labels(None, 2, ['ant']) == ['class 0', 'class 1']  # Not this model's.
  with pytest.raises(ValueError, match='name 3 classes but the checkpoint has 4'):
    image_files.load_labels(str(tmp_path / 'labels.txt'), 4)


@pytest.mark.parametrize('mode', ['I;16', 'RGBA', 'P', 'LA', 'L'])
def test_a_png_of_any_mode_reads_as_training_decodes_it(tmp_path, mode):
  """As the input pipeline's TensorFlow decoder reads it, to the value: a model predicts on what
  it was trained on. A 16-bit PNG's values keep their high byte (PIL alone would clip them)."""
  import tensorflow as tf  # The training pipeline's decoder.
  rng = np.random.default_rng(0)
  if mode == 'I;16':
    image = Image.fromarray(rng.integers(0, 2**16, (12, 20), dtype=np.uint16))
  else:
    image = Image.fromarray(rng.integers(0, 256, (12, 20, 3), dtype=np.uint8)).convert(mode)
  image.save(tmp_path / 'image.png')
  decoded = tf.io.decode_image(tf.io.read_file(str(tmp_path / 'image.png')), channels=3,
                               expand_animations=False).numpy()
  loaded = image_files.load_image(str(tmp_path / 'image.png'), (12, 20))
  np.testing.assert_array_equal(np.rint((loaded + 1) * 127.5), decoded)

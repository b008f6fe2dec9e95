"""Tests of vit_jax/data/image_files.py: a user's images and class-name files, on the real photos
in tests/data."""
import numpy as np
from PIL import Image
import pytest

from helpers import PHOTOS
from helpers import wide_image
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


def test_with_a_resize_a_wide_image_keeps_its_centre_and_without_it_is_squashed(tmp_path):
  path = wide_image(tmp_path / 'wide.png')
  framed = image_files.load_image(path, 28, resize=40)  # Short side 40: the image as it is.
  np.testing.assert_array_equal(framed, np.broadcast_to([-1.0, 1.0, -1.0], (28, 28, 3)))
  squashed = image_files.load_image(path, 28)
  assert squashed[:, 0, 0].min() == 1 and squashed[:, 14, 1].min() == 1  # Red edges, green centre.


def test_with_a_resize_an_image_is_framed_as_evaluation_frames_it():
  """As the input pipeline's evaluation frames it (config.pp.resize with TensorFlow's ops); on
  this photo, upscaled, the two bilinear resizes agree."""
  import tensorflow as tf
  from vit_jax.data import image_ops
  from vit_jax.data import folders
  photo = next(path for path in PHOTOS if Image.open(path).size == (32, 32))
  decoded = tf.cast(folders.decode_image_file(tf.constant(photo))[0], tf.float32)
  evaluated = image_ops.central_crop(image_ops.resize_short_side(decoded, 80), (64, 64)).numpy()
  evaluated = evaluated / 127.5 - 1
  assert np.abs(image_files.load_image(photo, 64, resize=80) - evaluated).mean() < 0.01
  assert np.abs(image_files.load_image(photo, 64) - evaluated).mean() > 0.1


def test_folder_images_take_the_test_split_one_class_after_another_and_no_masks(tmp_path):
  for path in ('split/train/cat/0.png', 'split/test/cat/0.png', 'split/test/cat/1.png',
               'split/test/dog/0.jpg', 'split/test/dog/notes.txt', 'flat/cat/0.png',
               'flat/dog/0.png', 'flat/dog/._1.png', 'flat/.ipynb_checkpoints/a.png',
               'masked/test/images/0.png', 'masked/test/masks/0.png'):
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_bytes(b'')  # Listed, not decoded.
  assert image_files.folder_images(str(tmp_path / 'split'), 5) == [
      str(tmp_path / 'split/test/cat/0.png'), str(tmp_path / 'split/test/dog/0.jpg'),
      str(tmp_path / 'split/test/cat/1.png')]
  assert image_files.folder_images(str(tmp_path / 'split'), 1) == [
      str(tmp_path / 'split/test/cat/0.png')]
  assert image_files.folder_images(str(tmp_path / 'flat'), 5) == [  # No hidden file or folder.
      str(tmp_path / 'flat/cat/0.png'), str(tmp_path / 'flat/dog/0.png')]
  assert image_files.folder_images(str(tmp_path / 'masked'), 5) == [
      str(tmp_path / 'masked/test/images/0.png')]

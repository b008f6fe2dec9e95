"""Tests of image folders labelled per pixel, `DIR/{train,test}/images/` with PNG masks in
`DIR/{train,test}/masks/`: batches hold each image with its mask, resized to the nearest pixel;
class names; one-line errors for a missing mask, a mask of another size and a class id out of
range; the label-kind check; and a short segmentation run on such a folder."""
import os

import numpy as np
from PIL import Image
import pytest

import helpers
from vit_jax.data import image_files
from vit_jax.data import pipeline
from vit_jax.data import shards
from vit_jax.errors import ConfigError
from vit_jax.training import dataset_checks
from vit_jax.training import trainer

IGNORE = 255
# Each image is 2 x 2 quadrants, each of one class (or IGNORE): its mask is that per pixel, and
# its pixels are the class's colour. Sides (height, width) differ from image to image.
TRAIN = {'a': ([[0, 1], [2, 3]], (32, 48)), 'b': ([[3, 2], [1, 0]], (24, 24)),
         'c': ([[1, 1], [0, IGNORE]], (40, 16))}
TEST = {'d': ([[2, 0], [0, 1]], (24, 40)), 'e': ([[IGNORE, 3], [3, 2]], (16, 32))}
COLOURS = {0: (200, 30, 30), 1: (30, 200, 30), 2: (30, 30, 200), 3: (200, 200, 30),
           IGNORE: (0, 0, 0)}


def quadrants(classes, size):
  """int (height, width): `classes` (2, 2) each repeated over a quadrant of `size`."""
  height, width = size
  return np.kron(np.array(classes), np.ones((height // 2, width // 2), int))


def write_split(root, split, examples, image_ext='.png'):
  for folder in ('images', 'masks'):
    os.makedirs(root / split / folder)
  for name, (classes, size) in examples.items():
    mask = quadrants(classes, size)
    pixels = np.array([COLOURS[c] for c in mask.ravel()], np.uint8).reshape(*size, 3)
    Image.fromarray(pixels).save(root / split / 'images' / f'{name}{image_ext}')
    Image.fromarray(mask.astype(np.uint8)).save(root / split / 'masks' / f'{name}.png')


@pytest.fixture
def folder(tmp_path):
  """A mask folder of TRAIN and TEST (JPEG-free: PNG images keep their colours exact)."""
  write_split(tmp_path, 'train', TRAIN)
  write_split(tmp_path, 'test', TEST)
  return tmp_path


def config_of(folder, **overrides):
  """The tiny segmentation config on `folder`, at 14 px (2 x 2 patches of 7), no random crop."""
  config = helpers.tiny_config(**{**dict(objective='segmentation', dataset=str(folder),
                                        test_split='test', batch=8, batch_eval=8), **overrides})
  config.pp.crop = 14
  return config


def classes_of_colours(image, tolerance=1):
  """int (h, w): the class whose colour each pixel of `image` (float32 in [-1, 1]) is, within
  `tolerance` levels."""
  pixels = np.round((image + 1) * 127.5)
  found = np.full(image.shape[:2], -1)
  for class_id, colour in COLOURS.items():
    found[(np.abs(pixels - colour) <= tolerance).all(-1)] = class_id
  return found


def test_test_batches_hold_each_mask_resized_to_the_nearest_pixel(folder):
  assert_test_batches_hold_their_masks(folder)


def test_palette_masks_give_their_indices_as_class_ids(folder):
  # Pascal VOC's masks: palette PNGs, the index the class id, in colours that are not the ids.
  palette = [level for i in range(256) for level in COLOURS.get(i, (i, i, i))]
  for split, examples in (('train', TRAIN), ('test', TEST)):
    for name, (classes, (height, width)) in examples.items():
      ids = quadrants(classes, (height, width)).astype(np.uint8)
      mask = Image.frombytes('P', (width, height), ids.tobytes())
      mask.putpalette(palette)
      mask.save(folder / split / 'masks' / f'{name}.png')
  assert Image.open(folder / 'test' / 'masks' / 'd.png').mode == 'P'
  info = dataset_checks.check_data(config_of(folder), '')
  assert info.label_names == ['class 0', 'class 1', 'class 2', 'class 3']
  assert_test_batches_hold_their_masks(folder)


def test_a_colour_mask_is_a_one_line_error_naming_it(folder):
  Image.fromarray(np.zeros((24, 40, 3), np.uint8)).save(folder / 'test' / 'masks' / 'd.png')
  with pytest.raises(ConfigError, match=r'The mask .*d\.png is a PNG image of mode RGB; a mask is '
                     r'an 8-bit PNG of class ids, greyscale .* or palette '
                     r'\(mode P: the indices are the ids\)\.$'):
    dataset_checks.check_data(config_of(folder), 'Config error: ')


def assert_test_batches_hold_their_masks(folder, tolerance=1):
  """The test batches of `folder` hold TEST's images, each with its mask at 14 px, their colours
  within `tolerance` levels."""
  batches = list(pipeline.eval_batches(config_of(folder)))
  real = np.concatenate([b['mask'] for b in batches]) == 1
  labels = np.concatenate([b['label'] for b in batches])[real]
  images = np.concatenate([b['image'] for b in batches])[real]
  assert labels.shape == (2, 14, 14) and labels.dtype == np.int32
  expected = {quadrants(classes, (14, 14)).tobytes() for classes, _ in TEST.values()}
  assert {label.tobytes() for label in labels.astype(int)} == expected
  assert_images_show_their_labels(images, labels, tolerance)


def assert_images_show_their_labels(images, labels, tolerance=1):
  """Each pixel of a pure quadrant colour shows its label's colour; resizing mixes colours only
  where two quadrants meet, so most pixels are pure."""
  for image, label in zip(images, labels):
    colours = classes_of_colours(image, tolerance)
    exact = colours >= 0
    assert exact.mean() > 0.5
    np.testing.assert_array_equal(colours[exact], label[exact])


def test_training_batches_crop_and_flip_each_image_with_its_mask(folder):
  config = config_of(folder)
  config.pp.inception_crop = True
  config.pp.area_min = 0.5
  batch = next(pipeline.train_batches(config))
  assert batch['label'].shape == (8, 14, 14)
  assert_images_show_their_labels(batch['image'], batch['label'])


def test_classes_are_numbered_up_to_the_largest_id_without_classes_txt(folder):
  info = dataset_checks.check_data(config_of(folder), '')
  assert info.label_names == ['class 0', 'class 1', 'class 2', 'class 3']
  assert info.per_pixel_labels and (info.num_train, info.num_test) == (3, 2)


def test_classes_txt_names_the_classes_line_by_line(folder):
  (folder / 'classes.txt').write_text('road\ncar\ntree\nsky\nperson\n')
  info = dataset_checks.check_data(config_of(folder), '')
  assert info.label_names == ['road', 'car', 'tree', 'sky', 'person']


def test_an_image_without_its_mask_is_a_one_line_error_before_training(folder):
  os.remove(folder / 'test' / 'masks' / 'e.png')
  with pytest.raises(ConfigError) as error:
    dataset_checks.check_data(config_of(folder), 'Config error: ')
  message = str(error.value)
  assert f'{folder / "test" / "images" / "e.png"} has no mask' in message
  assert str(folder / 'test' / 'masks' / 'e.png') in message and '\n' not in message


def test_a_mask_of_another_size_than_its_image_is_a_one_line_error(folder):
  Image.fromarray(np.zeros((10, 10), np.uint8)).save(folder / 'test' / 'masks' / 'd.png')
  with pytest.raises(ConfigError, match=r'The mask .*d\.png is 10x10 px, its image .*d\.png '
                     r'40x24 \(as shown\): give them one size\.$'):
    dataset_checks.check_data(config_of(folder), 'Config error: ')


def test_a_photo_taken_sideways_pairs_with_a_mask_of_the_photo_as_shown(folder):
  """A phone's JPEG: its pixels stored turned a quarter counter-clockwise, its EXIF orientation 6
  (show them turned clockwise); the mask labels the photo as shown."""
  shown = np.asarray(Image.open(folder / 'test' / 'images' / 'd.png'))  # 24 x 40, as labelled.
  os.remove(folder / 'test' / 'images' / 'd.png')
  exif = Image.Exif()
  exif[image_files.EXIF_ORIENTATION] = 6
  Image.fromarray(np.rot90(shown)).save(folder / 'test' / 'images' / 'd.jpg', quality=100,
                                        subsampling=0, exif=exif.tobytes())
  assert Image.open(folder / 'test' / 'images' / 'd.jpg').size == (24, 40)  # Stored 40 x 24.
  dataset_checks.check_data(config_of(folder), 'Config error: ')  # The sizes match as shown.
  assert_test_batches_hold_their_masks(folder, tolerance=16)  # JPEG's colours are near.


def test_a_class_id_beyond_classes_txt_is_an_error_naming_the_mask(folder):
  (folder / 'classes.txt').write_text('road\ncar\ntree\n')  # Masks d and e hold id 3.
  with pytest.raises(shards.DataError, match=r'^The mask .*test/masks/[de]\.png has a class id of '
                     r'3 or more \(not 255, unlabelled\): it has 3 classes$'):
    list(pipeline.eval_batches(config_of(folder)))


def test_classifying_a_mask_folder_is_the_label_kind_error(folder):
  config = helpers.tiny_config(dataset=str(folder), test_split='test')
  info = dataset_checks.check_data(config, '')
  with pytest.raises(ConfigError, match='has labels per pixel, and config.objective=.supervised. '
                     'needs them per image'):
    dataset_checks.check_label_kind(config, info)


def test_a_segmentation_run_on_a_mask_folder_reports_pixel_accuracy_and_miou(folder, tmp_path):
  config = config_of(folder, total_steps=4, warmup_steps=1, eval_every=4, checkpoint_every=4,
                     progress_every=2)
  metrics = trainer.train_and_evaluate(config, str(tmp_path / 'run'))
  assert 0 <= metrics['test_pixel_accuracy'] <= 1 and 0 <= metrics['test_miou'] <= 1

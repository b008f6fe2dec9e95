"""Tests of RandAugment: each operation against a planted answer or PIL, determinism per (seed,
step) through the training pipeline, and config errors."""
import numpy as np
from PIL import Image, ImageEnhance, ImageOps
import pytest
import tensorflow as tf

from vit_jax.config import checks
from vit_jax.config import defaults
from vit_jax.data import pipeline as ip
from vit_jax.data import randaugment as ra

RNG = np.random.RandomState(0)
RGB = RNG.randint(0, 256, (12, 16, 3)).astype(np.uint8)  # Not square: catches swapped axes.
GREY = RNG.randint(0, 256, (12, 16, 1)).astype(np.uint8)
MAGNITUDE_OPS = sorted(set(ra.OPS) - {'auto_contrast', 'equalize'})


def run(op, image, *args) -> np.ndarray:
  return op(tf.constant(image), *args).numpy()


def test_solarize_inverts_values_at_or_above_the_threshold():
  image = np.array([0, 100, 127, 128, 200, 255], np.uint8).reshape(1, 6, 1)
  np.testing.assert_array_equal(run(ra.solarize, image, 128).ravel(), [0, 100, 127, 127, 55, 0])
  np.testing.assert_array_equal(run(ra.solarize, image, 256), image)


def test_posterize_keeps_the_high_bits():
  image = np.array([0b10110111, 255, 15, 16], np.uint8).reshape(1, 4, 1)
  np.testing.assert_array_equal(run(ra.posterize, image, 4).ravel(), [0b10110000, 240, 0, 16])
  np.testing.assert_array_equal(run(ra.posterize, image, 8), image)


def test_solarize_add_lifts_only_dark_values_and_clips():
  image = np.array([0, 127, 128, 200, 100], np.uint8).reshape(1, 5, 1)
  np.testing.assert_array_equal(run(ra.solarize_add, image, 110).ravel(), [110, 237, 128, 200, 210])


def test_rotate_by_right_angles_moves_pixels_like_numpy():
  square = RNG.randint(0, 256, (5, 5, 3)).astype(np.uint8)
  np.testing.assert_array_equal(run(ra.rotate, square, 90.0), np.rot90(square))
  np.testing.assert_array_equal(run(ra.rotate, square, -90.0), np.rot90(square, -1))
  np.testing.assert_array_equal(run(ra.rotate, square, 180.0), np.rot90(square, 2))


def test_translate_moves_content_and_fills_the_gap():
  moved = run(ra.translate_x, RGB, 3.0)
  np.testing.assert_array_equal(moved[:, 3:], RGB[:, :-3])
  assert (moved[:, :3] == ra.FILL).all()
  moved = run(ra.translate_y, RGB, -2.0)
  np.testing.assert_array_equal(moved[:-2], RGB[2:])
  assert (moved[-2:] == ra.FILL).all()


def test_shear_x_shifts_each_row_by_its_index_times_the_shear():
  sheared = run(ra.shear_x, RGB, 1.0)  # Row y takes input columns x + y.
  for y in range(4):
    np.testing.assert_array_equal(sheared[y, :16 - y], RGB[y, y:])
  sheared = run(ra.shear_y, RGB, 1.0)  # Column x takes input rows y + x.
  np.testing.assert_array_equal(sheared[:10, 2], RGB[2:, 2])


def test_enhance_factors_have_their_known_end_points():
  np.testing.assert_array_equal(run(ra.brightness, RGB, 0.0), np.zeros_like(RGB))
  np.testing.assert_array_equal(run(ra.brightness, np.full((2, 2, 3), 200, np.uint8), 0.5), 100)
  grey_rgb = np.repeat(GREY, 3, axis=-1)  # No saturation: colour changes nothing.
  np.testing.assert_array_equal(run(ra.color, grey_rgb, 1.9), grey_rgb)
  flat = run(ra.contrast, grey_rgb, 0.0)
  np.testing.assert_allclose(flat, np.round(GREY.mean()), atol=1)


@pytest.mark.parametrize('name, pil', [
    ('auto_contrast', ImageOps.autocontrast), ('equalize', ImageOps.equalize),
    ('posterize', lambda image: ImageOps.posterize(image, 3)),
    ('solarize', lambda image: ImageOps.solarize(image, 100)),
])
def test_pixel_operations_match_pil(name, pil):
  ours = {'auto_contrast': ra.auto_contrast, 'equalize': ra.equalize,
          'posterize': lambda image: ra.posterize(image, 3),
          'solarize': lambda image: ra.solarize(image, 100)}[name]
  for image in (RGB, GREY):
    expected = np.asarray(pil(Image.fromarray(image.squeeze(-1) if image.shape[-1] == 1
                                              else image)))
    np.testing.assert_array_equal(run(ours, image).reshape(expected.shape), expected)


@pytest.mark.parametrize('name, enhancer', [
    ('color', ImageEnhance.Color), ('contrast', ImageEnhance.Contrast),
    ('brightness', ImageEnhance.Brightness), ('sharpness', ImageEnhance.Sharpness)])
def test_enhance_operations_match_pil_to_a_grey_level(name, enhancer):
  for factor in (0.3, 1.6):
    expected = np.asarray(enhancer(Image.fromarray(RGB)).enhance(factor)).astype(int)
    ours = run(getattr(ra, name), RGB, factor).astype(int)
    assert np.abs(ours - expected).max() <= 1, (name, factor)


@pytest.mark.parametrize('image', [RGB, GREY], ids=['rgb', 'grey'])
def test_every_operation_keeps_shape_and_dtype_and_magnitude_0_is_identity(image):
  for name, op in ra.OPS.items():
    out = op(tf.constant(image), 1.0, -1.0)
    assert (out.shape, out.dtype) == (image.shape, tf.uint8), name
  for name in MAGNITUDE_OPS:
    np.testing.assert_array_equal(run(ra.OPS[name], image, 0.0, 1.0), image, err_msg=name)


def test_randaugment_is_a_function_of_its_key():
  keys = [tf.constant([seed, 0], tf.int64) for seed in range(20)]
  outputs = [run(ra.randaugment, RGB, key, 2, 10) for key in keys]
  np.testing.assert_array_equal(run(ra.randaugment, RGB, keys[0], 2, 10), outputs[0])
  assert len({o.tobytes() for o in outputs}) > 8  # Different keys, different augmentations.
  np.testing.assert_array_equal(run(ra.randaugment, RGB, keys[0], 0, 10), RGB)


def pipeline_config(randaug):
  config = defaults.get_config()
  config.update(dict(train_split='train[:40]', batch=8, prefetch=1))
  config.pp.inception_crop, config.pp.flip, config.pp.randaug = False, False, randaug
  return config


def test_pipeline_randaugment_is_fixed_by_seed_and_step_and_resumes_exactly():
  plain = next(ip.train_batches(pipeline_config((0, 10))))['image']  # No layers: no change.
  batches = [b['image'] for b, _ in zip(ip.train_batches(pipeline_config((2, 10))), range(3))]
  resumed = next(ip.train_batches(pipeline_config((2, 10)), start_step=2))['image']
  np.testing.assert_array_equal(resumed, batches[2])  # The same (seed, step), the same images.
  assert not np.array_equal(batches[0], plain)  # It augments,
  assert batches[0].min() >= -1 and batches[0].max() <= 1  # within the value range.


@pytest.mark.parametrize('randaug', [(2,), (-1, 10), (2, 31), (2.5, 10)])
def test_bad_randaug_is_a_one_line_config_error(randaug):
  config = defaults.get_config()
  config.pp.randaug = randaug
  error = checks.values_error(config)
  assert error.startswith('config.pp.randaug=') and '\n' not in error and '(2, 10)' in error

"""Per-image preprocessing in TensorFlow: pixels to [-1, 1], resizes and crops (the Inception
crop of training, the central crop of evaluation), flips and RandAugment, each keyed by the
image's own random key so that a resumed run sees the same augmentations.
"""
import functools
import math
from typing import Optional

import tensorflow as tf

from vit_jax.data import orientation
from vit_jax.data import randaugment
from vit_jax.models import blank


INCEPTION_AREA_MIN = 0.05  # The paper's default; config.pp.area_min overrides it.
INCEPTION_ASPECT_RANGE = (3 / 4, 4 / 3)
_RANDAUG = 1  # Folded into an example's augmentation key for RandAugment's.
# The factors r by which libjpeg can scale a JPEG's sides down as it decodes it (in the DCT
# domain), decoding 1/r^2 of its pixels.
JPEG_SCALE_DOWNS = (1, 2, 4, 8)


def decode_image(encoded: tf.Tensor, shorter_side: Optional[int] = None) -> tf.Tensor:
  """Encoded JPEG/PNG/BMP/GIF/WebP bytes -> uint8 (height, width, 3), as stored (a JPEG's EXIF
  orientation: `orientation`, which preprocessing applies after it has shrunk the image).

  With `shorter_side` (`shorter_side_needed`), a JPEG is decoded scaled down by the largest r of
  JPEG_SCALE_DOWNS that keeps its shorter side at least that long: a 12-megapixel photo for a
  model of 64 px decodes at an eighth of each side, in a fraction of the time, and its
  preprocessing still reads at least the pixels it keeps.
  """
  def whole():
    return tf.io.decode_image(encoded, channels=3, expand_animations=False)

  if shorter_side is None:
    return whole()

  def scaled_down():
    shorter = tf.reduce_min(tf.image.extract_jpeg_shape(encoded)[:2])
    index = tf.reduce_sum(tf.cast(shorter // JPEG_SCALE_DOWNS[1:] >= shorter_side, tf.int32))
    return tf.switch_case(index, [functools.partial(tf.io.decode_jpeg, encoded, channels=3,
                                                    ratio=r) for r in JPEG_SCALE_DOWNS])

  return tf.cond(tf.io.is_jpeg(encoded), scaled_down, whole)


def shorter_side_needed(pp, train: bool) -> int:
  """The shorter side, in pixels, an image needs so that its preprocessing (for training, or
  for evaluation) takes at least `pp.crop`'s pixels from it: what a decoder may scale it to."""
  crop = max(blank.image_hw(pp.crop))
  if not train:
    return max(crop, pp.get('resize') or 0)
  if not pp.get('inception_crop', True):
    return crop
  # A crop of a fraction a of the area of an image of shorter side s, at an aspect ratio within
  # INCEPTION_ASPECT_RANGE, has sides of at least sqrt(a * 3/4) * s.
  area_min = pp.get('area_min', INCEPTION_AREA_MIN)
  return math.ceil(crop / math.sqrt(area_min * INCEPTION_ASPECT_RANGE[0]))


def to_unit_range(image: tf.Tensor) -> tf.Tensor:
  """Pixel values in [0, 255] -> float32 in [-1, 1]."""
  return tf.cast(image, tf.float32) / 127.5 - 1


def resize(image: tf.Tensor, size, method: str = 'bilinear') -> tf.Tensor:
  """(..., height, width, C) -> float32 (..., h, w, C), bilinear, `size` a side in pixels (h =
  w) or (h, w); or by `method` 'nearest', which keeps the dtype (for labels per pixel).

  Bilinear downscaling is antialiased, as PIL's resize (which `predict` uses) is: a large photo
  is seen in training and evaluation as `predict` sees it, not by every n-th pixel.
  """
  return _resized(image, blank.image_hw(size), method)


def _resized(image: tf.Tensor, size, method: str) -> tf.Tensor:
  """tf.image.resize to `size` (h, w), antialiased where it shrinks a side bilinearly (TF's
  antialiased kernel is several times slower, so it stays off for upscaling)."""
  if method != 'bilinear':
    return tf.image.resize(image, size, method=method)
  shrinks = tf.reduce_any(tf.shape(image)[-3:-1] > tf.convert_to_tensor(size))
  return tf.cond(shrinks, lambda: tf.image.resize(image, size, antialias=True),
                 lambda: tf.image.resize(image, size))


def resize_short_side(image: tf.Tensor, size: int, method: str = 'bilinear') -> tf.Tensor:
  """(height, width, C) -> float32 (h', w', C) with min(h', w') = size, keeping the aspect;
  `method` as `resize` takes it."""
  shape = tf.cast(tf.shape(image)[:2], tf.float32)
  new_shape = tf.maximum(tf.cast(tf.round(shape * size / tf.reduce_min(shape)), tf.int32), size)
  return _resized(image, new_shape, method)


def central_crop(image: tf.Tensor, sides) -> tf.Tensor:
  """(height, width, C), each at least the sides `sides` (h, w) -> (h, w, C) from the centre."""
  return tf.image.resize_with_crop_or_pad(image, *sides)


def _sides_as_stored(size, turn: Optional[tf.Tensor]) -> tuple:
  """(h, w) of `size` (a side, or (h, w)) in the frame of an image whose EXIF orientation is
  `turn` (int32 (); None: none): h and w swap where it is shown transposed (5 to 8), so that the
  image sized so in its stored frame shows at `size`."""
  height, width = blank.image_hw(size)
  if turn is None:
    return height, width
  transposed = turn >= 5
  return tf.where(transposed, width, height), tf.where(transposed, height, width)


def _shown(image: tf.Tensor, size, turn: Optional[tf.Tensor]) -> tf.Tensor:
  """`image`, sized by `_sides_as_stored(size, turn)`, turned as its EXIF orientation `turn` shows
  it (orientation.upright): (h, w, C), the sides of `size`. Turning it once it is this small
  costs a fraction of turning the photo as decoded."""
  if turn is not None:
    image = orientation.upright(image, turn)
  return tf.ensure_shape(image, [*blank.image_hw(size), image.shape[-1]])


def inception_crop(image: tf.Tensor, key: tf.Tensor,
                   area_min: float = INCEPTION_AREA_MIN) -> tf.Tensor:
  """A random crop of `area_min`-100% of the area, aspect ratio in [3/4, 4/3] (Szegedy et al.).

  Args:
    image: (height, width, channels).
    key: int64 (2,) stateless random key.
    area_min: the smallest fraction of the image's area a crop may cover.
  Returns:
    (crop_height, crop_width, channels), same dtype, the channels static where the image's are
    (RandAugment's ops need them).
  """
  begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
      tf.shape(image), bounding_boxes=tf.zeros([0, 0, 4]), seed=key, min_object_covered=0,
      area_range=(area_min, 1.0), aspect_ratio_range=INCEPTION_ASPECT_RANGE,
      use_image_if_no_bounding_boxes=True)
  crop = tf.slice(image, begin, size)
  crop.set_shape([None, None, image.shape[-1]])
  return crop


def preprocess_train(image: tf.Tensor, key: tf.Tensor, pp,
                     turn: Optional[tf.Tensor] = None) -> tf.Tensor:
  """uint8 (height, width, 3) -> float32 (h, w, 3) in [-1, 1], (h, w) the sides of `pp.crop`
  (`blank.image_hw`), augmented by `key`:
  crop, flip, then RandAugment (`pp.randaug`) on the pixels rounded to uint8.

  An image stored turned (its EXIF orientation `turn`, int32 ()) is cropped and resized in its
  stored frame and then turned: the crop's area and aspect ratio (uniform in log scale over a
  range symmetric about 1) are drawn as they would be in the upright frame."""
  crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
  if pp.get('inception_crop', True):
    image = inception_crop(image, crop_key, pp.get('area_min', INCEPTION_AREA_MIN))
  image = _shown(_resized(image, _sides_as_stored(pp.crop, turn), 'bilinear'), pp.crop, turn)
  if pp.get('flip', True):
    image = tf.image.stateless_random_flip_left_right(image, flip_key)
  if pp.get('randaug'):
    randaug_key = tf.random.experimental.stateless_fold_in(key, _RANDAUG)
    image = randaugment.randaugment(randaugment.to_uint8(image), randaug_key, *pp.randaug)
  return to_unit_range(image)


def preprocess_train_per_pixel(image: tf.Tensor, labels: tf.Tensor, key: tf.Tensor,
                               pp) -> tuple[tf.Tensor, tf.Tensor]:
  """uint8 (height, width, 3) and its labels (height, width) -> float32 (h, w, 3) in [-1, 1] and
  int32 (h, w), (h, w) the sides of `pp.crop`, augmented alike by `key`: the same crop (`pp.
  inception_crop`) and flip (`pp.flip`), the image resized bilinearly and the labels to the
  nearest pixel. No RandAugment: its rotations and shears would move pixels away from their
  labels (config checks refuse it for segmentation)."""
  crop_key, flip_key = tf.unstack(tf.random.experimental.stateless_split(key, 2))
  if pp.get('inception_crop', True):
    both = tf.concat([tf.cast(image, tf.int32), tf.cast(labels, tf.int32)[..., None]], axis=-1)
    both = inception_crop(both, crop_key, pp.get('area_min', INCEPTION_AREA_MIN))
    image, labels = both[..., :3], both[..., 3]
  image = resize(image, pp.crop)
  labels = resize(tf.cast(labels, tf.int32)[..., None], pp.crop, 'nearest')[..., 0]
  if pp.get('flip', True):
    flip = tf.random.stateless_uniform([], flip_key) < 0.5
    image, labels = (tf.where(flip, tf.reverse(x, [1]), x) for x in (image, labels))
  return to_unit_range(image), labels


def eval_size(image: tf.Tensor, pp, method: str = 'bilinear',
              turn: Optional[tf.Tensor] = None) -> tf.Tensor:
  """(height, width, C) -> (h, w, C), (h, w) the sides of `pp.crop`: resized to that, or with
  `pp.resize` its short side resized to pp.resize and the centre cropped; `method` as `resize`
  takes it. An image stored turned (its EXIF orientation `turn`) is sized in its stored frame,
  then turned: as its upright image would be sized."""
  sides = _sides_as_stored(pp.crop, turn)
  if pp.get('resize'):
    image = central_crop(resize_short_side(image, pp.resize, method), sides)
  else:
    image = _resized(image, sides, method)
  return _shown(image, pp.crop, turn)


def preprocess_eval(image: tf.Tensor, pp, turn: Optional[tf.Tensor] = None) -> tf.Tensor:
  """uint8 (height, width, 3) -> float32 (h, w, 3) in [-1, 1], (h, w) the sides of `pp.crop`;
  `turn` as `eval_size` takes it."""
  return to_unit_range(eval_size(image, pp, turn=turn))


def preprocess_eval_per_pixel(image: tf.Tensor, labels: tf.Tensor,
                              pp) -> tuple[tf.Tensor, tf.Tensor]:
  """uint8 (height, width, 3) and its labels (height, width) -> float32 (h, w, 3) in [-1, 1] and
  int32 (h, w), (h, w) the sides of `pp.crop`, sized alike (`eval_size`), the labels to the
  nearest pixel."""
  labels = eval_size(tf.cast(labels, tf.int32)[..., None], pp, 'nearest')[..., 0]
  return preprocess_eval(image, pp), labels


def check_pp(pp):
  if pp.get('resize') and pp.resize < max(blank.image_hw(pp.crop)):
    raise ValueError(f'config.pp.resize={pp.resize} is smaller than config.pp.crop={pp.crop}: '
                     'the central crop must fit; set pp.resize >= pp.crop, or None to resize '
                     'straight to pp.crop.')


def random_key(seed: int, stream: int, purpose: int, n: tf.Tensor) -> tf.Tensor:
  """The stateless random key (int64 (2,)) for epoch or position `n` of a stream.

  `stream` is 0 for the one stream of a random-access source, the process index for tfds.
  """
  key = tf.constant([seed, stream], tf.int64)
  key = tf.random.experimental.stateless_fold_in(key, purpose)
  return tf.random.experimental.stateless_fold_in(key, n)

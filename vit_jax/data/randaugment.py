"""RandAugment (Cubuk et al., 2020) on uint8 images, with stateless TensorFlow ops for tf.data.

`randaugment(image, key, num_layers, magnitude)` applies `num_layers` operations in turn, each
picked uniformly from OPS and applied with probability 1/2 (the mean probability of the TPU
reference implementation, which draws it from [0.2, 0.8]). Every random choice comes from the
stateless key, so an image's augmentation is a function of (seed, position in the stream) and a
resumed run sees exactly what an uninterrupted one does.

Magnitude is on the usual scale where 10 is each operation's largest setting (rotate 30 degrees,
shear 0.3, translate 45% of the side, enhance factors 1 +- 0.9, posterize to 4 bits, solarize
every pixel); larger values extrapolate (AugReg uses up to 20). Geometric and enhance operations
go either way, with a random sign. Here every operation with a magnitude is the identity at
magnitude 0 (as in timm's "increasing" variants), so `magnitude` alone sets the strength; the TPU
reference's solarize and posterize instead weaken as the magnitude grows, and its enhance factors
are 0.1 + 0.18 * magnitude.

Every operation maps uint8 (height, width, channels) to the same shape and dtype; channels is 1
(grey) or 3 (RGB).
"""
import math

import tensorflow as tf

MAX_LEVEL = 10.0
MAX_DEGREES = 30.0
MAX_SHEAR = 0.3
MAX_TRANSLATE = 0.45  # Fraction of the image side.
MAX_ENHANCE = 0.9  # Enhance factors range over 1 -+ this.
MAX_POSTERIZE_BITS_REMOVED = 4
SOLARIZE_ADD_MAX = 110
SOLARIZE_ADD_THRESHOLD = 128
FILL = 128  # Value of pixels that geometric operations bring in from outside the image.
_GREY_WEIGHTS = (0.2989, 0.5870, 0.1140)  # ITU-R 601-2 luma, as PIL and tf.image use.


def to_uint8(image: tf.Tensor) -> tf.Tensor:
  """float32 in any range -> uint8, rounded and clipped to [0, 255]."""
  return tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)


def _grey(image: tf.Tensor) -> tf.Tensor:
  """uint8 (h, w, c) -> float32 (h, w, 1) luma; a 1-channel image is its own luma."""
  image = tf.cast(image, tf.float32)
  if image.shape[-1] == 1:
    return image
  return tf.reduce_sum(image * tf.constant(_GREY_WEIGHTS), axis=-1, keepdims=True)


def _blend(degenerate: tf.Tensor, image: tf.Tensor, factor) -> tf.Tensor:
  """PIL's ImageEnhance: degenerate + factor * (image - degenerate), as uint8.

  Factor 1 gives `image`, 0 gives `degenerate`, and above 1 extrapolates away from it."""
  image = tf.cast(image, tf.float32)
  return to_uint8(degenerate + factor * (image - degenerate))


# The operations, each with its own argument in natural units.


def identity(image: tf.Tensor) -> tf.Tensor:
  return image


def auto_contrast(image: tf.Tensor) -> tf.Tensor:
  """Stretches each channel linearly so its darkest pixel is 0 and its brightest 255, rounding
  down as PIL does (a constant channel stays as it is)."""
  image = tf.cast(image, tf.float64)  # PIL's arithmetic, whose rounding down it matches.
  low = tf.reduce_min(image, axis=[0, 1], keepdims=True)
  high = tf.reduce_max(image, axis=[0, 1], keepdims=True)
  scale = tf.where(high > low, 255 / tf.maximum(high - low, 1), 1.0)
  offset = tf.where(high > low, -low * scale, 0.0)
  return to_uint8(tf.cast(tf.floor(image * scale + offset), tf.float32))


def _equalize_channel(channel: tf.Tensor) -> tf.Tensor:
  """int32 (h, w) -> int32 (h, w): PIL's histogram equalisation of one channel."""
  histogram = tf.math.bincount(channel, minlength=256, maxlength=256)
  last = tf.gather(histogram, tf.reduce_max(tf.where(histogram > 0)))  # Count of the top value.
  step = (tf.reduce_sum(histogram) - last) // 255
  lut = tf.concat([[0], (tf.cumsum(histogram) + step // 2)[:-1] // tf.maximum(step, 1)], 0)
  equalised = tf.gather(tf.clip_by_value(lut, 0, 255), channel)
  return tf.where(step > 0, equalised, channel)


def equalize(image: tf.Tensor) -> tf.Tensor:
  """Histogram equalisation of each channel (as PIL's ImageOps.equalize)."""
  channels = tf.unstack(tf.cast(image, tf.int32), num=image.shape[-1], axis=-1)
  return tf.cast(tf.stack([_equalize_channel(c) for c in channels], -1), tf.uint8)


def solarize(image: tf.Tensor, threshold) -> tf.Tensor:
  """Inverts (255 - v) every pixel value v >= `threshold`; 256 leaves the image as it is."""
  inverted = 255 - tf.cast(image, tf.int32)
  return tf.cast(tf.where(tf.cast(image, tf.int32) >= tf.cast(threshold, tf.int32), inverted,
                          tf.cast(image, tf.int32)), tf.uint8)


def solarize_add(image: tf.Tensor, addition) -> tf.Tensor:
  """Adds `addition` to every value below 128, clipping at 255."""
  values = tf.cast(image, tf.float32)
  return to_uint8(tf.where(values < SOLARIZE_ADD_THRESHOLD, values + addition, values))


def posterize(image: tf.Tensor, bits) -> tf.Tensor:
  """Keeps the `bits` most significant bits of each value (8: unchanged)."""
  shift = tf.cast(8 - bits, tf.uint8)
  return tf.bitwise.left_shift(tf.bitwise.right_shift(image, shift), shift)


def color(image: tf.Tensor, factor) -> tf.Tensor:
  """Saturation: 0 is grey, 1 the image, 2 twice as saturated."""
  return _blend(_grey(image), image, factor)


def contrast(image: tf.Tensor, factor) -> tf.Tensor:
  """Contrast against the image's mean luma: 0 is flat grey, 1 the image."""
  return _blend(tf.reduce_mean(_grey(image)), image, factor)


def brightness(image: tf.Tensor, factor) -> tf.Tensor:
  """0 is black, 1 the image."""
  return _blend(tf.zeros([], tf.float32), image, factor)


def sharpness(image: tf.Tensor, factor) -> tf.Tensor:
  """Sharpness against PIL's SMOOTH filter (3x3, centre weight 5 of 13), border pixels kept:
  0 is smoothed, 1 the image, 2 sharpened."""
  values = tf.cast(image, tf.float32)
  kernel = tf.constant([[1, 1, 1], [1, 5, 1], [1, 1, 1]], tf.float32) / 13
  kernel = tf.tile(kernel[:, :, None, None], [1, 1, image.shape[-1], 1])
  smooth = tf.nn.depthwise_conv2d(values[None], kernel, [1, 1, 1, 1], 'VALID')[0]
  smooth = tf.round(smooth)
  interior = tf.pad(tf.ones_like(smooth), [[1, 1], [1, 1], [0, 0]])
  degenerate = tf.where(interior > 0, tf.pad(smooth, [[1, 1], [1, 1], [0, 0]]), values)
  return _blend(degenerate, image, factor)


def _transform(image: tf.Tensor, matrix) -> tf.Tensor:
  """Resamples `image` (nearest pixel, FILL outside) so that output pixel (x, y) = column, row
  takes input pixel (a0 x + a1 y + a2, b0 x + b1 y + b2), `matrix` = [a0, a1, a2, b0, b1, b2]."""
  transform = tf.concat([tf.cast(tf.stack(matrix), tf.float32), tf.zeros([2])], 0)[None]
  out = tf.raw_ops.ImageProjectiveTransformV3(
      images=tf.cast(image, tf.float32)[None], transforms=transform,
      output_shape=tf.shape(image)[:2], fill_value=float(FILL), interpolation='NEAREST',
      fill_mode='CONSTANT')
  return tf.cast(out[0], tf.uint8)


def rotate(image: tf.Tensor, degrees) -> tf.Tensor:
  """Rotates counter-clockwise by `degrees` about the image centre."""
  radians = tf.cast(degrees, tf.float32) * math.pi / 180
  cos, sin = tf.cos(radians), tf.sin(radians)
  height, width = image.shape[0], image.shape[1]
  cx, cy = (width - 1) / 2, (height - 1) / 2
  return _transform(image, [cos, -sin, cx - cos * cx + sin * cy,
                            sin, cos, cy - sin * cx - cos * cy])


def shear_x(image: tf.Tensor, shear) -> tf.Tensor:
  """Output pixel (x, y) takes input pixel (x + shear * y, y)."""
  return _transform(image, [1.0, shear, 0.0, 0.0, 1.0, 0.0])


def shear_y(image: tf.Tensor, shear) -> tf.Tensor:
  """Output pixel (x, y) takes input pixel (x, y + shear * x)."""
  return _transform(image, [1.0, 0.0, 0.0, shear, 1.0, 0.0])


def translate_x(image: tf.Tensor, pixels) -> tf.Tensor:
  """Moves the content `pixels` to the right (negative: left)."""
  return _transform(image, [1.0, 0.0, -pixels, 0.0, 1.0, 0.0])


def translate_y(image: tf.Tensor, pixels) -> tf.Tensor:
  """Moves the content `pixels` down (negative: up)."""
  return _transform(image, [1.0, 0.0, 0.0, 0.0, 1.0, -pixels])


# Magnitude -> argument. `level` is magnitude / MAX_LEVEL, `sign` +1 or -1 at random.

def _enhance(op):
  return lambda image, level, sign: op(image, 1 + sign * level * MAX_ENHANCE)


OPS = {
    'identity': lambda image, level, sign: image,
    'auto_contrast': lambda image, level, sign: auto_contrast(image),
    'equalize': lambda image, level, sign: equalize(image),
    'rotate': lambda image, level, sign: rotate(image, sign * level * MAX_DEGREES),
    'solarize': lambda image, level, sign: solarize(image, 256 - level * 256),
    'solarize_add': lambda image, level, sign: solarize_add(image, level * SOLARIZE_ADD_MAX),
    'posterize': lambda image, level, sign: posterize(
        image, 8 - tf.cast(tf.minimum(level, 1.75) * MAX_POSTERIZE_BITS_REMOVED, tf.int32)),
    'color': _enhance(color),
    'contrast': _enhance(contrast),
    'brightness': _enhance(brightness),
    'sharpness': _enhance(sharpness),
    'shear_x': lambda image, level, sign: shear_x(image, sign * level * MAX_SHEAR),
    'shear_y': lambda image, level, sign: shear_y(image, sign * level * MAX_SHEAR),
    'translate_x': lambda image, level, sign: translate_x(
        image, sign * level * MAX_TRANSLATE * image.shape[1]),
    'translate_y': lambda image, level, sign: translate_y(
        image, sign * level * MAX_TRANSLATE * image.shape[0]),
}


def randaugment(image: tf.Tensor, key: tf.Tensor, num_layers: int, magnitude: float) -> tf.Tensor:
  """`num_layers` random operations of OPS at `magnitude`, each applied with probability 1/2.

  Args:
    image: uint8 (height, width, channels) with static shape, channels 1 or 3.
    key: int64 (2,) stateless random key; the same key gives the same result.
    num_layers: operations applied in turn.
    magnitude: strength of every operation, 10 being the usual largest.
  Returns:
    uint8 (height, width, channels).
  """
  level, shape = magnitude / MAX_LEVEL, image.shape
  branches = list(OPS.values())

  def layer(image, layer_key):
    choice, apply, flip = tf.unstack(tf.random.stateless_uniform([3], layer_key))
    sign = tf.where(flip < 0.5, -1.0, 1.0)
    index = tf.where(apply < 0.5, tf.cast(choice * len(branches), tf.int32), 0)  # 0: identity.
    image = tf.switch_case(index, [lambda op=op: op(image, level, sign) for op in branches])
    return tf.ensure_shape(image, shape)

  if not num_layers:
    return image
  # A loop over the layers' keys: the operations enter the graph once, whatever num_layers is.
  return tf.foldl(layer, tf.random.experimental.stateless_split(key, num_layers), image)

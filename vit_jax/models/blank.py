"""A model's parameters from a blank image batch, the input that `model.init` traces.

flax's `init` runs the model once to learn its parameters' shapes; the input only has to have an
image's shape, so every caller passes one blank (1, H, W, 3) float32 image (`blank_images`).
`param_shapes` computes the shapes alone (jax.eval_shape: no memory, no compilation);
`init_params` the initialised arrays. Any module that takes (images, train=False) fits: the
VisionTransformer, mpp.MaskedPatchViT. This module imports nothing of vit_jax, so that
vit_jax.sharding can use it.
"""
from typing import Any

import jax
import jax.numpy as jnp

ImageSize = int | tuple[int, int]  # Pixels of a square image, or (height, width).


def image_hw(image_size: ImageSize) -> tuple[int, int]:
  """(height, width) in pixels of `image_size`: an int for a square image, or (height, width)."""
  if isinstance(image_size, (tuple, list)):
    return int(image_size[0]), int(image_size[1])
  return int(image_size), int(image_size)


def size_text(image_size: ImageSize) -> str:
  """'224x320': `image_size` as height x width in pixels, as the commands print it."""
  return '{}x{}'.format(*image_hw(image_size))


def blank_images(image_size: ImageSize) -> jax.ShapeDtypeStruct:
  """The (1, H, W, 3) float32 batch that `init` traces."""
  height, width = image_hw(image_size)
  return jax.ShapeDtypeStruct((1, height, width, 3), jnp.float32)


def init_params(model, rng: jax.Array, image_size: ImageSize) -> Any:
  """`model`'s initial parameters from `rng`, for images of `image_size`."""
  images = blank_images(image_size)
  return model.init(rng, jnp.zeros(images.shape, images.dtype), train=False)['params']


def param_shapes(model, image_size: ImageSize) -> Any:
  """`model`'s parameter tree for images of `image_size` as jax.ShapeDtypeStructs, computed
  without allocating or compiling anything."""
  return jax.eval_shape(lambda: init_params(model, jax.random.key(0), image_size))

"""Tests of vit_jax/data/orientation.py: JPEGs that carry an EXIF orientation, in both of TIFF's
byte orders, turned upright as PIL's ImageOps.exif_transpose turns them; and preprocessing
(image_ops) that sizes such an image as stored, then turns it, as if it had been upright."""
import io
import struct

import ml_collections
import numpy as np
from PIL import Image
from PIL import ImageOps
import pytest
import tensorflow as tf

from helpers import PHOTOS
from vit_jax.data import image_ops
from vit_jax.data import orientation

ORIENTATIONS = range(1, 9)
DECODERS_DIFFER = 8  # Pixel levels by which libjpeg's decoders in TensorFlow and PIL may differ.


def exif_block(value: int, byte_order: str = '<', tags_before: int = 2) -> bytes:
  """An APP1 segment's data: the EXIF header and a TIFF structure in `byte_order` ('<' II, '>'
  MM) whose IFD0 holds `tags_before` other SHORT tags (0x0200 on), then Orientation = `value`."""
  tiff = (b'II' if byte_order == '<' else b'MM') + struct.pack(byte_order + 'HI', 42, 8)
  entries = [struct.pack(byte_order + 'HHIHH', 0x0200 + i, 3, 1, 7, 0) for i in range(tags_before)]
  entries.append(struct.pack(byte_order + 'HHIHH', 0x0112, 3, 1, value, 0))
  ifd = struct.pack(byte_order + 'H', len(entries)) + b''.join(entries) + b'\0\0\0\0'
  return b'Exif\0\0' + tiff + ifd


def jpeg(pixels: np.ndarray, exif: bytes = b'') -> bytes:
  """`pixels` (uint8 (height, width, 3)) encoded as a JPEG at full quality, with `exif`."""
  out = io.BytesIO()
  Image.fromarray(pixels).save(out, 'JPEG', quality=100, subsampling=0, exif=exif)
  return out.getvalue()


def pil_upright(encoded: bytes) -> np.ndarray:
  with Image.open(io.BytesIO(encoded)) as image:
    return np.asarray(ImageOps.exif_transpose(image))


def assert_close(decoded: np.ndarray, expected: np.ndarray):
  """TensorFlow's JPEG decoder against PIL's: the same shape, within DECODERS_DIFFER levels."""
  assert decoded.shape == expected.shape
  assert np.abs(decoded.astype(int) - expected).max() <= DECODERS_DIFFER


def turned(encoded) -> tf.Tensor:
  """The image of `encoded` decoded and turned at once as its EXIF orientation shows it."""
  return orientation.upright(image_ops.decode_image(encoded), orientation.exif_orientation(encoded))


def decoded_upright(encoded: bytes) -> np.ndarray:
  return turned(tf.constant(encoded)).numpy()


@pytest.fixture(scope='module')
def pixels():
  """A 24 x 40 px image of smooth ramps with no symmetry: every turn and mirror of it differs
  from it by 100 or more somewhere, while two JPEG decoders differ by a few levels."""
  rows, cols = np.mgrid[0:24, 0:40]
  return np.stack([rows * 10, cols * 6, rows * 3 + cols * 2], -1).astype(np.uint8)


@pytest.mark.parametrize('byte_order', ['<', '>'])
@pytest.mark.parametrize('value', ORIENTATIONS)
def test_each_orientation_reads_and_turns_as_pil_shows_it(pixels, value, byte_order):
  encoded = jpeg(pixels, exif_block(value, byte_order))
  assert orientation.exif_orientation(tf.constant(encoded)).numpy() == value
  assert_close(decoded_upright(encoded), pil_upright(encoded))
  assert decoded_upright(encoded).shape == ((24, 40, 3) if value < 5 else (40, 24, 3))


def test_the_exif_that_pil_writes_after_a_jfif_header_reads_as_pil_reads_it(pixels):
  exif = Image.Exif()
  exif[0x010F] = 'A camera maker'
  exif[0x0112] = 8
  out = io.BytesIO()
  Image.fromarray(pixels).save(out, 'JPEG', exif=exif.tobytes())
  encoded = out.getvalue()
  assert encoded[2:4] == b'\xff\xe0'  # A JFIF APP0 segment comes first.
  assert orientation.exif_orientation(tf.constant(encoded)).numpy() == 8
  assert_close(decoded_upright(encoded), pil_upright(encoded))


def test_files_without_the_tag_read_as_stored(pixels, tmp_path):
  Image.fromarray(pixels).save(tmp_path / 'image.png')
  as_stored = [jpeg(pixels), jpeg(pixels, exif_block(6, tags_before=0)[:-20]),  # Cut short.
               (tmp_path / 'image.png').read_bytes(), b'', b'Exif\0\0MM']
  with open(PHOTOS[0], 'rb') as f:
    as_stored.append(f.read())  # A real photo without an orientation.
  for encoded in as_stored:
    assert orientation.exif_orientation(tf.constant(encoded)).numpy() == orientation.AS_STORED


def test_a_damaged_exif_block_never_raises_and_never_reads_past_its_end(pixels):
  rng = np.random.default_rng(0)
  good = bytearray(jpeg(pixels, exif_block(6)))
  for _ in range(40):
    damaged = bytearray(good)
    at = rng.integers(6, 64, size=4)
    damaged[at[0]:at[0] + 4] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
    value = orientation.exif_orientation(tf.constant(bytes(damaged))).numpy()
    assert 1 <= value <= 8
  beyond = exif_block(6, tags_before=80)  # The tag past the entries searched.
  assert orientation.exif_orientation(tf.constant(jpeg(pixels, beyond))).numpy() == 1


def test_upright_turns_in_a_traced_dataset_map(pixels):
  encoded = [jpeg(pixels, exif_block(value)) for value in ORIENTATIONS]
  shapes = tf.data.Dataset.from_tensor_slices(encoded).map(lambda e: tf.shape(turned(e)))
  assert [tuple(s) for s in shapes.as_numpy_iterator()] == [(24, 40, 3)] * 4 + [(40, 24, 3)] * 4


@pytest.mark.parametrize('resize', [None, 30])
def test_preprocessing_sizes_a_stored_image_then_turns_it_as_if_it_were_upright(pixels, resize):
  """Sized in its stored frame and turned at the end (cheap: the image is small by then), each
  orientation's image is evaluated, and trained without a random crop or flip, as its upright
  image is, to float rounding, at a crop whose sides differ."""
  pp = ml_collections.ConfigDict(dict(crop=(20, 12), resize=resize, inception_crop=False,
                                      flip=False))
  for value in ORIENTATIONS:
    encoded = tf.constant(jpeg(pixels, exif_block(value)))
    stored, turn = image_ops.decode_image(encoded), orientation.exif_orientation(encoded)
    upright = turned(encoded)
    evaluated = image_ops.preprocess_eval(stored, pp, turn).numpy()
    assert evaluated.shape == (20, 12, 3)
    np.testing.assert_allclose(evaluated, image_ops.preprocess_eval(upright, pp).numpy(),
                               atol=1e-5, err_msg=str(value))
    key = tf.constant([0, 1], tf.int64)
    np.testing.assert_allclose(image_ops.preprocess_train(stored, key, pp, turn).numpy(),
                               image_ops.preprocess_train(upright, key, pp).numpy(), atol=1e-5,
                               err_msg=str(value))

"""The orientation a camera recorded in a JPEG, and the image turned to it, as TensorFlow ops.

A phone or camera stores the pixels as its sensor read them and records in the EXIF tag
Orientation (0x0112 of the TIFF structure in the JPEG's APP1 segment) how to show them:

    1 as stored          2 mirrored left-right   3 turned 180 degrees   4 mirrored top-bottom
    5 transposed         6 turned 90 degrees clockwise
    7 transversed        8 turned 90 degrees counter-clockwise

Image viewers, PIL's `ImageOps.exif_transpose` (and so `predict` and `visualize`) show a photo so;
TensorFlow's decoders ignore the tag, and a portrait photo taken with the phone held upright would
train lying on its side. `exif_orientation` reads the tag from the first `WINDOW` bytes of the
file, where the EXIF segment of a camera's JPEG begins, without a loop: it splits them at the
'Exif\\0\\0' header that starts the APP1 segment's data and, where there is one, reads the
entries of the first directory (IFD0) of the TIFF structure after it all at once. A file without
the tag, damaged or cut short, or not a JPEG, reads as `AS_STORED`, and costs one split.
"""
import tensorflow as tf

from vit_jax.data import image_files

AS_STORED = 1  # The orientation of an image without the tag: show the pixels as stored.
WINDOW = 4096  # Bytes read from the start of a file: its SOI, APP0 and APP1 headers and IFD0.
_EXIF_HEADER = b'Exif\x00\x00'  # Starts the data of the APP1 segment that holds EXIF.
_APP1 = b'\xff\xe1'  # Its marker, before the segment's 2 length bytes.
_MAX_ENTRIES = 64  # Entries of IFD0 searched for the tag; a camera's IFD0 has about a dozen.
_ENTRY_SHORTS = 6  # 12 bytes: tag, type, count (2 shorts), value (left-aligned) or its offset.


@tf.autograph.experimental.do_not_convert  # No Python control flow on tensors to convert.
def exif_orientation(encoded: tf.Tensor) -> tf.Tensor:
  """int32 () in 1..8: the Orientation tag of the JPEG bytes `encoded` (string ()), else
  AS_STORED."""
  head = tf.strings.substr(encoded, 0, WINDOW, unit='BYTE')
  parts = tf.strings.split(head, _EXIF_HEADER, maxsplit=1)  # (1,), or (2,) around the header.
  has_header = tf.io.is_jpeg(encoded) & tf.equal(tf.size(parts), 2)
  return tf.cond(has_header, lambda: _tagged_orientation(head, parts[0], parts[1]),
                 lambda: tf.constant(AS_STORED))


def _tagged_orientation(head: tf.Tensor, before: tf.Tensor, tiff: tf.Tensor) -> tf.Tensor:
  """The Orientation tag of the TIFF structure `tiff` (the bytes of `head` after the EXIF header,
  `before` the bytes before it) if it is in IFD0 of an APP1 segment, else AS_STORED."""
  header = tf.strings.length(before)
  app1 = tf.strings.substr(tf.strings.join([head, _APP1]), tf.maximum(header - 4, 0), 2)
  # Padded so that any read of up to WINDOW bytes from a position up to WINDOW stays inside it.
  tiff = tf.strings.join([tiff, b'\0' * 2 * WINDOW])
  order = tf.strings.substr(tiff, 0, 2)
  little = tf.equal(order, b'II')

  def numbers(at, count, dtype=tf.uint16):
    """`count` integers of `dtype` from byte `at` of the TIFF (whose offsets count from its
    start), in its byte order; zeros where `at` is outside the window."""
    at = tf.where((at >= 0) & (at <= WINDOW), at, WINDOW)  # WINDOW: in the padding.
    raw = tf.strings.substr(tiff, at, count * dtype.size)
    as_little, as_big = (tf.io.decode_raw(raw, dtype, little_endian=e) for e in (True, False))
    return tf.cast(tf.where(little, as_little, as_big), tf.int64)

  ifd0 = numbers(4, 1, tf.int32)[0]  # An offset over 2**31 is past the window either way.
  entries = tf.reshape(numbers(ifd0 + 2, _MAX_ENTRIES * _ENTRY_SHORTS),
                       [_MAX_ENTRIES, _ENTRY_SHORTS])
  is_tag = ((tf.range(_MAX_ENTRIES, dtype=tf.int64) < numbers(ifd0, 1)[0]) &
            tf.equal(entries[:, 0], image_files.EXIF_ORIENTATION))
  value = tf.cast(tf.reduce_max(tf.where(is_tag, entries[:, 4], 0)), tf.int32)
  found = ((header >= 4) & tf.equal(app1, _APP1) & (little | tf.equal(order, b'MM')) &
           (value >= 1) & (value <= 8))
  return tf.where(found, value, AS_STORED)


@tf.autograph.experimental.do_not_convert
def upright(image: tf.Tensor, orientation: tf.Tensor) -> tf.Tensor:
  """(height, width, C) pixels as stored -> as the EXIF `orientation` (int32 () in 1..8) shows
  them: transposed for 5 to 8, then mirrored left-right (2, 7), turned 180 degrees (3, 8) or
  mirrored top-bottom (4, 5). An image as stored (1) is passed on, not copied."""
  def turned():
    transposed = tf.transpose(image, tf.where(orientation >= 5, [1, 0, 2], [0, 1, 2]))
    flips = (orientation - 1) % 4  # 0 none, 1 columns, 2 both, 3 rows.
    axes = tf.boolean_mask([0, 1], tf.stack([flips >= 2, (flips == 1) | (flips == 2)]))
    return tf.reverse(transposed, axes)

  shown = tf.cond(tf.equal(orientation, AS_STORED), lambda: image, turned)
  return tf.ensure_shape(shown, [None, None, image.shape[-1]])  # The dynamic perm loses it.

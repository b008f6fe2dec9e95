"""A user's own files: how an image folder is laid out (its classes, the test share held out of a
folder without split folders), images to classify or look into, read at a model's resolution,
and class names, one a line. PIL and NumPy only, no TensorFlow, so that config files and the
tools use it before TensorFlow loads (data/folders.py reads the folders into tf.data)."""
import collections
import importlib.util
import os
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
from PIL import Image
from PIL import ImageOps

IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.gif', '.webp')  # tf.io.decode_image's.
# An image folder DIR labelled per pixel: each DIR/<split>/IMAGES/NAME.ext pairs with the mask
# DIR/<split>/MASKS/NAME.png, an 8-bit greyscale PNG of class ids (data/folders.py reads them).
IMAGES, MASKS = 'images', 'masks'
# In an image folder DIR, the labels of a multi-label folder: columns `file` (a path relative to
# DIR, e.g. train/0001.jpg) and `labels` (the image's class names, separated by spaces).
LABELS_CSV = 'labels.csv'
# A folder of class folders with no train/ split, DIR/<class_name>/*.jpg (as torchvision's
# ImageFolder reads one): the last FLAT_TEST_FRACTION of each class's images in the fixed
# class-mixed order (flat_test_count) are its split `test`, the others its split `train`.
FLAT_SPLITS = ('train', 'test')
FLAT_TEST_FRACTION = 0.1
# The class names of tfds' imagenet2012 (WordNet IDs), in label order; read without importing tfds.
IMAGENET2012_LABELS = ('datasets', 'imagenet2012', 'labels.txt')
EXIF_ORIENTATION = 0x0112  # The EXIF tag of how to show the pixels; 5 to 8 swap the sides.


def missing_folder(dataset: str) -> Optional[str]:
  """The error (`no_folder_line`) for a `config.dataset` that can only be a folder's path, not a
  tfds name, where no folder exists; None for any other. Only a folder's path starts with '.',
  '/' or '~', or ends with '/' ('my/photos' may be either: tfds is asked first)."""
  if ((dataset.startswith(('.', '/', '~')) or dataset.endswith('/'))
      and not os.path.isdir(os.path.expanduser(dataset))):
    return no_folder_line(dataset)
  return None


def no_folder_line(dataset: str) -> str:
  """The error for a `config.dataset` path where no folder exists."""
  return (f'config.dataset={dataset!r} is a path, and no folder exists there (relative paths '
          f'start at {os.getcwd()}): give an image folder DIR with DIR/train/<class>/ and '
          'DIR/test/<class>/, or DIR/<class>/.')


def visible(names: Iterable[str]) -> list[str]:
  """The file or folder `names` that are not hidden (do not start with '.'): an image folder's
  contents without Jupyter's .ipynb_checkpoints or macOS's .DS_Store and ._NAME.jpg files."""
  return [name for name in names if not name.startswith('.')]


def subfolders(folder: str) -> list[str]:
  """The names of the folders in `folder`, sorted, hidden ones left out."""
  return sorted(visible(entry.name for entry in os.scandir(folder) if entry.is_dir()))


def is_image_file(path: str) -> bool:
  """Whether the file at `path` is an image by its extension (IMAGE_EXTENSIONS, any case)."""
  return path.lower().endswith(IMAGE_EXTENSIONS)


def files_under(folder: str, skip: Sequence[str] = ()) -> Iterator[str]:
  """The paths of the files in `folder` and its subfolders (but those named in `skip`), hidden
  ones left out: a folder's files in the order of their names, then each subfolder's in turn."""
  for parent, subfolders, names in os.walk(folder):
    subfolders[:] = sorted(name for name in visible(subfolders) if name not in skip)
    yield from (os.path.join(parent, name) for name in sorted(visible(names)))


def is_flat_folder(directory: str) -> bool:
  """Whether `directory` holds its class folders itself: no train/ split and no labels.csv, and
  a subfolder with an image in it or in a folder of its own."""
  if os.path.exists(os.path.join(directory, 'train')) or os.path.exists(
      os.path.join(directory, LABELS_CSV)):
    return False
  return any(is_image_file(path) for subfolder in subfolders(directory)
             for path in files_under(os.path.join(directory, subfolder)))


def flat_test_count(images: int) -> int:
  """How many of the `images` of one class of a flat folder are held out as its split `test`:
  a tenth, and at least one of a class of two or more, so that every class is tested."""
  return max(1, round(images * FLAT_TEST_FRACTION)) if images > 1 else 0


def flat_train_size(class_sizes: Sequence[int]) -> int:
  """How many images of a flat folder whose classes hold `class_sizes` images are its split
  `train`; the rest are `test`."""
  return sum(images - flat_test_count(images) for images in class_sizes)


def imagenet2012_labels_path() -> str:
  """The labels file of tfds' imagenet2012 inside the installed tensorflow-datasets."""
  spec = importlib.util.find_spec('tensorflow_datasets')
  if spec is None:
    raise FileNotFoundError('--labels imagenet2012 reads its names from tensorflow-datasets, '
                            'which is not installed; pass a labels file instead.')
  return os.path.join(spec.submodule_search_locations[0], *IMAGENET2012_LABELS)


def load_labels(labels: Optional[str], num_classes: int,
                saved: Optional[list[str]] = None) -> list[str]:
  """Class names: 'imagenet2012', a text file with one name per line, or None: the names saved
  with the model (`saved`, runs.saved_label_names), else class indices."""
  if labels is None:
    if saved and len(saved) == num_classes:
      return list(saved)
    return [f'class {i}' for i in range(num_classes)]
  path = imagenet2012_labels_path() if labels == 'imagenet2012' else labels
  if not os.path.isfile(path):
    raise FileNotFoundError(f'No such labels file: {path}')
  with open(path) as f:
    names = [line.strip() for line in f if line.strip()]
  if len(names) != num_classes:
    raise ValueError(f'The labels ({path}) name {len(names)} classes but the checkpoint has '
                     f'{num_classes}.')
  return names


def _eight_bit(image: Image.Image) -> Image.Image:
  """A 16-bit greyscale image (a PNG's, PIL mode I;16 or I) as 8 bits, its values' high bytes,
  as TensorFlow decodes it for training (PIL's own conversion would clip it at 255); any other
  image as it is."""
  if image.mode.startswith('I;16') or image.mode == 'I':
    return Image.fromarray((np.clip(np.asarray(image), 0, 65535) >> 8).astype(np.uint8))
  return image


def upright(image: Image.Image) -> Image.Image:
  """A JPEG turned as its EXIF orientation shows it, as training reads it (data/orientation.py);
  any other image as stored."""
  return ImageOps.exif_transpose(image) if image.format == 'JPEG' else image


def shown_size(image: Image.Image) -> tuple[int, int]:
  """(width, height) of `image` as `upright` shows it; reads its header only."""
  turned = image.format == 'JPEG' and image.getexif().get(EXIF_ORIENTATION, 1) in (5, 6, 7, 8)
  return image.size[::-1] if turned else image.size


def _framed(image: Image.Image, height: int, width: int, resize: Optional[int]) -> Image.Image:
  """`image` resized (bilinear) to height x width; with `resize`, as a run with that
  config.pp.resize evaluates: its short side resized to `resize`, then the centre cropped."""
  if not resize:
    return image.resize((width, height), Image.Resampling.BILINEAR)
  scale = resize / min(image.size)
  scaled = image.resize((max(resize, width, round(image.width * scale)),
                         max(resize, height, round(image.height * scale))),
                        Image.Resampling.BILINEAR)
  left, top = (scaled.width - width) // 2, (scaled.height - height) // 2
  return scaled.crop((left, top, left + width, top + height))


def load_image(path: str, image_size: int | tuple[int, int],
               resize: Optional[int] = None) -> np.ndarray:
  """The image at `path` at `image_size` (a side, or (height, width)): resized to it, or with
  `resize` (config.pp.resize) its short side resized to that and the centre taken, as (height,
  width, 3) float32 RGB values in [-1, 1]. A JPEG is turned upright first (`upright`)."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f'{path}: no such file')
  try:
    with Image.open(path) as image:
      height, width = image_size if isinstance(image_size, (tuple, list)) else (image_size,) * 2
      image = _framed(_eight_bit(upright(image)).convert('RGB'), height, width, resize)
  except (OSError, ValueError, Image.DecompressionBombError) as e:
    raise ValueError(f'{path}: cannot decode the image ({e})') from None
  return np.asarray(image, np.float32) / 127.5 - 1


def folder_images(folder: str, count: int) -> list[str]:
  """Up to `count` image files of the image folder `folder` (a config.dataset) to look at: of its
  test/ split where it has one, else of the folder itself; one class folder after another, each
  in the order of the file names; a folder labelled per pixel gives its images, not its masks."""
  root = os.path.join(folder, 'test') if os.path.isdir(os.path.join(folder, 'test')) else folder
  by_folder = collections.defaultdict(list)
  for path in filter(is_image_file, files_under(root, skip=[MASKS])):
    by_folder[os.path.dirname(path)].append(path)
  by_folder = list(by_folder.values())
  in_turn = [paths[i] for i in range(max(map(len, by_folder), default=0))
             for paths in by_folder if i < len(paths)]
  return in_turn[:count]

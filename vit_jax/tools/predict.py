"""Classifies images with a ViT checkpoint and prints the top-5 classes of each, with their
probabilities: the softmax of the logits, or for a model a run trained with the sigmoid loss
(`config.loss`, saved in its model.npz) each class's own sigmoid, which need not sum to 1.

    python -m vit_jax.predict --model ViT-B_16 --checkpoint ViT-B_16_imagenet2012.npz \\
        --labels imagenet2012 cat.jpg dog.png
    python -m vit_jax.predict --checkpoint WORKDIR cat.jpg
    python -m vit_jax.predict --checkpoint augreg:B/16-384 --labels imagenet2012 cat.jpg
    python -m vit_jax.predict --checkpoint WORKDIR my_photos/ --out predictions.csv

A folder stands for its image files and those of its subfolders (hidden ones left out), in the
order of their paths. With --out, the predictions go to a CSV file (columns file, then class_1,
probability_1, ... for the --top classes), and the console gets one line.

Each image is resized (bilinear) to the model's resolution, the one its training run recorded
or its position embeddings imply (384 px for a file fine-tuned at 384), and its values are
scaled to [-1, 1]: the preprocessing of the published checkpoints. The model of a run that
evaluated with config.pp.resize (its short side resized, then the centre cropped), which its
model.npz records, sees each image framed the same way. At another --image_size
(384, or HEIGHTxWIDTH such as 224x320, multiples of the patch) the model interpolates its
position embeddings to that grid as it runs (`VisionTransformer.any_size`, timm's
dynamic_img_size). The model is the
one whose spec vit_jax saved in the file (training runs, vit_jax.convert), and the class names
those a training run saved with it; a published file needs
--model, its registry name, unless given by its published name (`checkpoints.published`), and
the number of classes and the representation size then come from its parameters.
A missing file or an image that cannot be decoded is reported by name, the other images are still
classified, and the exit status is 1.

A segmentation model (a run of --config.objective=segmentation) classifies every pixel: for each
image it prints the classes that cover the most pixels, with their share, and with --masks DIR
writes DIR/NAME.png, the class id of each pixel (grey levels 0 to C - 1). Neither --out nor a
mask file may exist already: predict overwrites nothing, and says so before it loads the model.
"""
import argparse
import csv
import os
import sys
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from PIL import Image

from vit_jax import console
from vit_jax import errors
from vit_jax.checkpoints import runs
from vit_jax.data import image_files
from vit_jax.models import blank
from vit_jax.tasks import segmentation

BATCH_SIZE = 16


def image_size_arg(text: str) -> int | tuple[int, int]:
  """--image_size: '384' (square) or '224x320' (height x width), in pixels."""
  try:
    sides = tuple(int(side) for side in text.lower().split('x'))
  except ValueError:
    sides = ()
  if len(sides) not in (1, 2) or min(sides) <= 0:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not an image size: give pixels, 384, or HEIGHTxWIDTH, 224x320')
  return sides[0] if len(sides) == 1 else sides


def at_size(model, trained_size, image_size):
  """`model` to apply to images of `image_size`: itself at `trained_size`, else its `any_size`
  (position embeddings interpolated as it runs)."""
  if blank.image_hw(image_size) == blank.image_hw(trained_size):
    return model
  return model.any_size(trained_size)


def top_k(probabilities: np.ndarray, labels: list[str], k: int) -> list[str]:
  """Lines '  42.15%  name (index)' of the k most probable classes, most probable first."""
  return [f'  {100 * probabilities[i]:6.2f}%  {labels[i]} ({i})'
          for i in np.argsort(-probabilities)[:k]]


def csv_row(path: str, probabilities: np.ndarray, labels: list[str], k: int) -> list[str]:
  """[path, name, probability in [0, 1], ...] of the k most probable classes."""
  return [path, *(value for i in np.argsort(-probabilities)[:k]
                  for value in (labels[i], f'{probabilities[i]:.6f}'))]


def image_paths(arguments: list[str]) -> list[str]:
  """The files to classify: each argument that is not a folder as it is; of a folder, its image
  files and its subfolders' (image_files.files_under); a ValueError for a folder without any."""
  paths = []
  for argument in arguments:
    if not os.path.isdir(argument):
      paths.append(argument)
      continue
    images = list(filter(image_files.is_image_file, image_files.files_under(argument)))
    if not images:
      raise ValueError(f'The folder {argument} holds no {"/".join(image_files.IMAGE_EXTENSIONS)} '
                       'images, nor do its subfolders: name image files or a folder of them.')
    paths += images
  return paths


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
  parser = console.command_parser(
      'predict', description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('images', nargs='+', help='image files (JPEG, PNG, ... anything PIL reads), '
                      'or folders of them')
  parser.add_argument('--model', help='registry name, e.g. ViT-B_16; needed for files without a '
                      'saved model spec (the published ones)')
  parser.add_argument('--checkpoint', required=True,
                      help='.npz in the published layout, a training workdir (its model.npz), '
                      'or a published name, e.g. augreg:B/16-384 (python -m vit_jax.checkpoint '
                      '--list)')
  parser.add_argument('--labels', help="'imagenet2012' (tfds' WordNet IDs) or a file with one "
                      'class name per line; default: the class names a training run saved with '
                      'the model, else class indices')
  parser.add_argument('--image_size', type=image_size_arg,
                      help='pixels, 384, or HEIGHTxWIDTH, 224x320; default: the resolution the '
                      "model was trained at (its run's record, or its position embeddings')")
  parser.add_argument('--top', type=int, default=5, help='classes printed per image')
  parser.add_argument('--masks', help='for a segmentation model: a folder to write each '
                      "image's predicted classes to, as NAME.png (new files)")
  parser.add_argument('--out', help='a new CSV file to write the predictions to (file, then '
                      'class_1, probability_1, ... of the --top classes), instead of printing '
                      'them')
  return parser.parse_args(argv)


def predictor(model, activation=jax.nn.softmax):
  """(params, images (B, H, W, 3)) -> (scores (B, C), class maps): a classifier's
  probabilities (`activation` of its logits: softmax, or sigmoid for a model trained with the
  sigmoid loss) and None, or for a segmentation model the share of the pixels predicted as each
  class and the predicted class of each pixel, int32 (B, H, W); jitted."""

  def predict(params, images):
    logits = model.apply({'params': params}, images, train=False)
    if not isinstance(model, segmentation.SegmentationViT):
      return activation(logits), None
    classes = jnp.argmax(logits, -1)
    return jnp.mean(jax.nn.one_hot(classes, model.num_classes), axis=(1, 2)), classes

  return jax.jit(predict)


def mask_files(folder: str, paths: list[str]) -> dict[str, str]:
  """{image path: FOLDER/NAME.png, where its mask goes}, FOLDER made; a ValueError where two
  images share a NAME, an errors.OutputError where such a file exists."""
  images = {}  # Of each mask file.
  for path in paths:
    mask = os.path.join(folder, os.path.splitext(os.path.basename(path))[0] + '.png')
    if mask in images:
      raise ValueError(f'{images[mask]} and {path} would both write their mask to {mask}: '
                       'predict them with --masks folders of their own.')
    images[mask] = path
  for mask in images:
    errors.prepare_new_output(mask, '--masks')
  return {path: mask for mask, path in images.items()}


def write_mask(mask: str, classes: np.ndarray) -> None:
  """Writes a class map (H, W) to the new file `mask` (a .png of `mask_files`), 8-bit grey."""
  with open(mask, 'xb') as f:
    Image.fromarray(classes.astype(np.uint8)).save(f, format='PNG')


def batched_predictions(predict, params, paths: list[str], image_size, resize) -> Iterator[
    tuple[str, Optional[np.ndarray], Optional[np.ndarray]]]:
  """(path, scores (C,), class map (H, W) of a segmentation model or None) for each of `paths`
  in turn, or (path, None, None) for a file that cannot be read, its error printed on stderr.

  Reads and classifies BATCH_SIZE images at a time (fewer where there are fewer), each batch
  padded to that size so that `predict` (predictor's) compiles once.
  """
  batch = min(BATCH_SIZE, len(paths))
  for start in range(0, len(paths), batch):
    images = {}
    for path in paths[start:start + batch]:
      try:
        images[path] = image_files.load_image(path, image_size, resize)
      except (ValueError, FileNotFoundError) as e:
        print(f'error: {e}', file=sys.stderr)
        yield path, None, None
    if not images:
      continue
    pixels = np.zeros((batch, *next(iter(images.values())).shape), np.float32)
    pixels[:len(images)] = list(images.values())
    scores, maps = jax.device_get(predict(params, pixels))
    for i, path in enumerate(images):
      yield path, scores[i], None if maps is None else maps[i]


def main(argv: Optional[list[str]] = None) -> int:
  args = parse_args(argv)
  try:
    if args.out:
      errors.prepare_new_output(args.out)
    paths = image_paths(args.images)
    masks = mask_files(args.masks, paths) if args.masks else {}
    model, params = runs.load_model(args.checkpoint, args.model)
    trained_size = runs.trained_image_size(args.checkpoint, params, model)
    image_size = args.image_size or trained_size
    resize = runs.saved_framing(args.checkpoint, trained_size, image_size)
    model = at_size(model, trained_size, image_size)
    labels = image_files.load_labels(args.labels, model.num_classes,
                         runs.saved_label_names(args.checkpoint))
    activation = jax.nn.sigmoid if runs.saved_loss(args.checkpoint) == 'sigmoid_xent' else (
        jax.nn.softmax)
    predict = predictor(model, activation)
    # Traced, not compiled: an image size the model cannot cut into patches (or tiles) is a
    # ValueError here, before any image is read.
    jax.eval_shape(predict, params,
                   jax.ShapeDtypeStruct((1, *blank.image_hw(image_size), 3), jnp.float32))
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1

  per_pixel = isinstance(model, segmentation.SegmentationViT)
  rows, failed = [], False
  for path, scores, classes in batched_predictions(predict, params, paths, image_size, resize):
    if scores is None:
      failed = True
    elif args.out:
      rows.append(csv_row(path, scores, labels, args.top))
    else:
      print(f'{path} ({blank.size_text(image_size)} px'
            f'{", pixels per class" if per_pixel else ""}):')
      print('\n'.join(top_k(scores, labels, args.top)))
    if classes is not None and masks:
      write_mask(masks[path], classes)
  if args.out:
    write_csv(args.out, rows, min(args.top, len(labels)))
  return 1 if failed else 0

def write_csv(path: str, rows: list[list[str]], k: int) -> None:
  """Writes the `rows` of csv_row under their header, and says so in one line."""
  with open(path, 'x', newline='') as f:
    writer = csv.writer(f)
    writer.writerow(['file', *(f'{column}_{j}' for j in range(1, k + 1)
                               for column in ('class', 'probability'))])
    writer.writerows(rows)
  print(f'Wrote the top {k} classes of {len(rows):,} images to {path}.')

if __name__ == '__main__':
  console.run(main)

"""Writes a multi-label image folder made of the embedded Fashion-MNIST: scenes of 56 x 56 pixels,
each a 2 x 2 grid of 28-pixel cells of which 1 to 3 hold an item, listed in DIR/labels.csv with
the classes they show (an image folder with a labels.csv is multi-label: docs/training.md).

  python scripts/build_multilabel_folder.py fashion_scenes
  python -m vit_jax.main --config.dataset=fashion_scenes --config.loss=sigmoid_xent

The folder must not exist yet. The output is deterministic: the scenes of each split take the
split's images in stored order, each image once, and their cells and number of items from a fixed
seed. Class names are Fashion-MNIST's with spaces as underscores ('Ankle_boot'): labels.csv
separates them by spaces.
"""
import argparse
import os
import sys
from typing import Iterator

import numpy as np
from PIL import Image

from vit_jax import console
from vit_jax import errors
# vit_jax.data.folders (it imports TensorFlow) is imported where it is used: after the console
# has quieted TensorFlow's start-up lines.

SCENES = {'train': 5000, 'test': 1000}  # Scenes per split; each takes 2 images on average.
CELL = 28  # Pixels: one Fashion-MNIST image.
MAX_ITEMS = 3  # Of the 4 cells, at least one stays empty.


def scenes(images: np.ndarray, count: int, seed: int) -> Iterator[tuple[np.ndarray, list[int]]]:
  """(uint8 (56, 56) scene, the indices into `images` it shows) for `count` scenes, each of 1 to
  MAX_ITEMS of the images (N, 28, 28) taken in order in random cells; a ValueError where the
  images run out."""
  rng = np.random.default_rng(seed)
  taken = 0
  for _ in range(count):
    items = int(rng.integers(1, MAX_ITEMS + 1))
    if taken + items > len(images):
      raise ValueError(f'{len(images)} images make fewer than {count} scenes: ask for fewer.')
    canvas = np.zeros((2 * CELL, 2 * CELL), np.uint8)
    for image, cell in zip(images[taken:taken + items], rng.permutation(4)[:items]):
      row, column = divmod(int(cell), 2)
      canvas[row * CELL:(row + 1) * CELL, column * CELL:(column + 1) * CELL] = image
    yield canvas, list(range(taken, taken + items))
    taken += items


def write_folder(root: str, counts: dict[str, int] = SCENES, seed: int = 0) -> str:
  """Writes `counts[split]` scenes as root/<split>/<i>.png and their classes into
  root/labels.csv; returns `root`."""
  from vit_jax.data import embedded
  from vit_jax.data import folders
  rows = ['file,labels']
  with np.load(embedded.PATH) as data:
    names = [str(name).replace(' ', '_') for name in data['label_names']]
    for index, (split, count) in enumerate(counts.items()):
      os.makedirs(os.path.join(root, split), exist_ok=True)
      images, labels = data[f'{split}_images'], data[f'{split}_labels']
      for i, (scene, shown) in enumerate(scenes(images, count, seed + index)):
        Image.fromarray(scene).save(os.path.join(root, split, f'{i}.png'))
        classes = sorted({names[labels[j]] for j in shown})
        rows.append(f'{split}/{i}.png,{" ".join(classes)}')
  with open(os.path.join(root, folders.LABELS_CSV), 'w') as f:
    f.write('\n'.join(rows) + '\n')
  return root


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('folder', help='Where to write the image folder.')
  for split, count in SCENES.items():
    parser.add_argument(f'--{split}', type=int, default=count, help=f'Scenes of {split}.')
  args = parser.parse_args()
  try:
    errors.prepare_new_output(args.folder, 'folder')
  except errors.OutputError as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  write_folder(args.folder, {split: getattr(args, split) for split in SCENES})
  print(f'Wrote {args.folder}: {args.train} train and {args.test} test scenes, and their '
        'labels.csv.')
  return 0


if __name__ == '__main__':
  console.run(main)

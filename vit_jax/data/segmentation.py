"""`fashion_mnist_segmentation`: a segmentation dataset composed, deterministically, from the
embedded Fashion-MNIST (no file of its own).

Each canvas is CANVAS x CANVAS grey pixels (56: 2 x 2 items of 28) holding 2 to 4 items of the
embedded split of the same name ('train', 'test'), each item used once. The canvas is cut into
2 x 2 cells of ITEM pixels; each item goes into its own cell, shifted by a whole patch of the
default run's model (SHIFT_STEP, 7 px) or not, along each axis, and clipped to the canvas, so that
items keep the alignment with the patches that the default run trained on; an item is pasted
where its pixels are nonzero, over the items before it. The mask holds, per pixel, the class + 1
of the item whose pixel shows there, and BACKGROUND (0) elsewhere: 11 classes, 'background' and
the 10 of Fashion-MNIST. Which items, how many per canvas, their cells and shifts follow from
SEED and the split alone, in numpy, so every run composes the same canvases
(`tests/test_segmentation.py`).
"""
import numpy as np

CANVAS = 56  # Pixels per side of a canvas.
ITEM = 28  # Pixels per side of an item (Fashion-MNIST's images).
ITEMS_PER_CANVAS = (2, 4)  # Fewest and most items on a canvas.
# An item's shift from the corner of its cell: -1, 0 or 1 steps of SHIFT_STEP pixels, the patch
# size of the default run's model, so that items stay aligned with its patches as in pre-training.
SHIFT_STEP = 7
SEED = 0
BACKGROUND = 0  # The mask's value where no item is; an item's class c is c + 1.
SPLIT_STREAMS = {'train': 0, 'test': 1}  # Mixed into SEED per split.


def background_and(label_names: list[str]) -> list[str]:
  """The class names of the masks: 'background', then the items' classes."""
  return ['background', *label_names]


def layout(num_items: int, seed: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
  """Which items go on which canvas, and where, drawn from `seed` (numpy's default_rng).

  Returns:
    items: int (canvases, ITEMS_PER_CANVAS[1]), indices of the items of each canvas in pasting
      order, -1 for none (each canvas has 2 to 4); every index of range(num_items) at most once.
    corners: int (canvases, ITEMS_PER_CANVAS[1], 2), the (row, column) of each item's top-left
      pixel on the canvas.
  """
  rng = np.random.default_rng(seed)
  fewest, most = ITEMS_PER_CANVAS
  counts = rng.integers(fewest, most + 1, size=num_items // fewest)
  counts = counts[np.cumsum(counts) <= num_items]
  order = rng.permutation(num_items)
  items = np.full((len(counts), most), -1)
  for canvas, (start, count) in enumerate(zip(np.cumsum(counts) - counts, counts)):
    items[canvas, :count] = order[start:start + count]
  cells = np.argsort(rng.random((len(counts), 4)), axis=1)  # A different cell per item.
  cell_corners = np.stack([cells // 2, cells % 2], axis=-1) * ITEM
  shifts = rng.integers(-1, 2, size=(len(counts), most, 2)) * SHIFT_STEP
  corners = np.clip(cell_corners + shifts, 0, CANVAS - ITEM)
  return items, corners


def compose(images: np.ndarray, labels: np.ndarray,
            seed: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
  """Canvases and masks of the items `images` uint8 (N, ITEM, ITEM), classes `labels` (N,).

  Returns:
    canvases uint8 (canvases, CANVAS, CANVAS), masks uint8 (canvases, CANVAS, CANVAS) of
    BACKGROUND and class + 1, laid out by `layout(N, seed)`.
  """
  items, corners = layout(len(images), seed)
  canvases = np.zeros((len(items), CANVAS, CANVAS), np.uint8)
  masks = np.zeros_like(canvases)
  for canvas, mask, chosen, where in zip(canvases, masks, items, corners):
    for item, (row, column) in zip(chosen[chosen >= 0], where):
      shown = images[item] > 0
      window = np.s_[row:row + ITEM, column:column + ITEM]
      canvas[window][shown] = images[item][shown]
      mask[window][shown] = labels[item] + 1
  return canvases, masks


def split_of(arrays: dict[str, np.ndarray], split: str) -> tuple[np.ndarray, np.ndarray]:
  """(canvases, masks) of `split` ('train' or 'test') composed from the embedded `arrays`."""
  return compose(arrays[f'{split}_images'], arrays[f'{split}_labels'],
                 (SEED, SPLIT_STREAMS[split]))

"""How much of each patch's class the tokens of a ViT's blocks carry, pre-trained and untrained.

A ridge regression from the frozen tokens of each block (each token standardised over its
features) to the class that covers most of each patch's pixels, fitted on the patches of
--train images and scored on those of --test images of the test split: on the 28 px items of
the embedded Fashion-MNIST (the default run's training images), and on the 56 px canvases of
`fashion_mnist_segmentation` encoded whole (position embeddings interpolated to the 8 x 8 grid)
and in 28 px tiles (`config.seg.window`, vit_jax/tasks/segmentation.py). Prints, per start and
images, the share of the item patches (those mostly covered by an item) classified right.

  python -m vit_jax.main                  # the default run, once: workdirs/default
  python benchmarks/patch_probe.py [--checkpoint workdirs/default]
"""
import argparse

import jax
import numpy as np

from vit_jax import hardware
from vit_jax.checkpoints import runs
from vit_jax.data import segmentation as canvases
from vit_jax.data import embedded
from vit_jax.models import blank
from vit_jax.tasks import segmentation

RIDGE = 1.0  # The L2 penalty of the regression, on standardised tokens.


def patch_classes(masks: np.ndarray, patch: int) -> np.ndarray:
  """(N, H, W) class ids -> (N, H / patch, W / patch): each patch's most frequent id."""
  n, h, w = masks.shape
  cells = masks.reshape(n, h // patch, patch, w // patch, patch).transpose(0, 1, 3, 2, 4)
  counts = np.stack([(cells == c).sum((-2, -1)) for c in range(masks.max() + 1)], -1)
  return counts.argmax(-1)


def block_maps(model, params, images: np.ndarray, window: int | None) -> np.ndarray:
  """(blocks, N, rows, columns, D) tokens of every block for uint8 (N, H, W) grey `images`, each
  standardised over D; with `window`, of each window x window tile encoded alone."""
  tiled = segmentation.with_segmentation(model, window)
  apply = jax.jit(lambda x: tiled.apply({'params': params}, x, method='intermediates',
                                        blocks=tuple(range(model.num_layers)), maps=True).tokens)
  maps = []
  for start in range(0, len(images), 250):
    x = np.repeat(images[start:start + 250, ..., None], 3, -1).astype(np.float32) / 127.5 - 1
    maps.append(np.stack(apply(x)))
  maps = np.concatenate(maps, axis=1)
  return (maps - maps.mean(-1, keepdims=True)) / (maps.std(-1, keepdims=True) + 1e-6)


def ridge_accuracy(train: np.ndarray, train_classes: np.ndarray, test: np.ndarray,
                   test_classes: np.ndarray) -> float:
  """The share of the test patches of an item (class > 0) whose class a ridge regression of the
  one-hot classes on the (..., D) tokens, fitted on the train patches, gets right."""
  def with_bias(x):
    x = x.reshape(-1, x.shape[-1])
    return np.concatenate([x, np.ones((len(x), 1), x.dtype)], 1)
  x, num_classes = with_bias(train), max(train_classes.max(), test_classes.max()) + 1
  weights = np.linalg.solve(x.T @ x + RIDGE * np.eye(x.shape[1]),
                            x.T @ np.eye(num_classes)[train_classes.reshape(-1)])
  predicted = (with_bias(test) @ weights).argmax(-1)
  truth = test_classes.reshape(-1)
  return float(np.mean(predicted[truth > 0] == truth[truth > 0]))


def main():
  hardware.skip_absent_tpu()
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--checkpoint', default='workdirs/default')
  parser.add_argument('--train', type=int, default=1500, help='Images to fit the probe on.')
  parser.add_argument('--test', type=int, default=500, help='Images to score it on.')
  args = parser.parse_args()
  hardware.use_one_device_per_core()

  model, pretrained = runs.load_model(args.checkpoint, dynamic_img_size=True)
  item = runs.native_image_size(pretrained, model)
  untrained = jax.device_get(blank.init_params(model, jax.random.key(0), item))
  with np.load(embedded.PATH) as data:
    arrays = {name: data[name] for name in data.files}
  views = {}
  for split, count in (('train', args.train), ('test', args.test)):
    items = arrays[f'{split}_images'][:count]
    item_masks = np.where(items > 0, arrays[f'{split}_labels'][:count, None, None] + 1, 0)
    canvas, canvas_masks = (a[:count] for a in canvases.split_of(arrays, split))
    views.setdefault(f'{item} px items', []).append((items, item_masks, None))
    views.setdefault(f'{canvases.CANVAS} px canvases, whole', []).append(
        (canvas, canvas_masks, None))
    views.setdefault(f'{canvases.CANVAS} px canvases, {item} px tiles', []).append(
        (canvas, canvas_masks, item))
  patch = model.patch_pixels[0]
  blocks = ' '.join(f'{f"block {i + 1}":>8}' for i in range(model.num_layers))
  print(f'item patches classified right, ridge probe of {args.train} train / {args.test} test '
        f'images\n{"start":<12} {"images":<28} {blocks}')
  for start, params in (('pre-trained', pretrained), ('untrained', untrained)):
    for name, ((train, train_masks, window), (test, test_masks, _)) in views.items():
      train_maps, test_maps = (block_maps(model, params, x, window) for x in (train, test))
      shares = [ridge_accuracy(a, patch_classes(train_masks, patch), b,
                               patch_classes(test_masks, patch))
                for a, b in zip(train_maps, test_maps)]
      print(f'{start:<12} {name:<28} ' + ' '.join(f'{s:>8.3f}' for s in shares), flush=True)


if __name__ == '__main__':
  main()

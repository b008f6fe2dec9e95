"""Builds `vit_jax/data/fashion_mnist_embedded.npz`, the dataset that ships inside the package.

Source: the original Fashion-MNIST files (Xiao, Rasul, Vollgraf 2017, arXiv:1708.07747; MIT
licence, Zalando SE), as installed by Debian's `dataset-fashion-mnist` package:

  sudo apt-get install dataset-fashion-mnist
  python scripts/build_embedded_dataset.py

The output is deterministic: a class-balanced subset of the training set (the first
`--train_per_class` images of each class, in file order) and the full 10,000-image test set, each
shuffled with a fixed seed so that slices such as `train[:90%]` are class-mixed. Images are stored
as uint8 (N, 28, 28) grey, labels as uint8 (N,), compressed with `numpy.savez_compressed`.
"""
import argparse
import gzip
import os

import numpy as np

LABEL_NAMES = ('T-shirt/top', 'Trouser', 'Pullover', 'Dress', 'Coat', 'Sandal', 'Shirt',
               'Sneaker', 'Bag', 'Ankle boot')
_IDX_MAGIC = {1: 2049, 3: 2051}  # IDX magic number by array rank: labels, images.
_ORDER_SEED = 20170828  # The date of arXiv:1708.07747; fixes the stored order.


def read_idx(path: str) -> np.ndarray:
  """Reads a gzipped IDX file (the MNIST format) into a uint8 array."""
  with gzip.open(path, 'rb') as f:
    data = f.read()
  magic, = np.frombuffer(data[:4], '>i4')
  rank = magic & 0xff
  if _IDX_MAGIC.get(rank) != magic:
    raise ValueError(f'{path} is not a uint8 IDX file of labels or images (magic {magic}).')
  shape = tuple(np.frombuffer(data[4:4 + 4 * rank], '>i4'))
  return np.frombuffer(data[4 + 4 * rank:], np.uint8).reshape(shape)


def balanced_subset(labels: np.ndarray, per_class: int) -> np.ndarray:
  """Indices of the first `per_class` examples of each class, in file order."""
  picks = [np.flatnonzero(labels == c)[:per_class] for c in range(len(LABEL_NAMES))]
  if min(len(p) for p in picks) < per_class:
    raise ValueError(f'Some class has fewer than {per_class} training examples.')
  return np.sort(np.concatenate(picks))


def build(source_dir: str, train_per_class: int) -> dict[str, np.ndarray]:
  """Returns the arrays of the embedded dataset, shuffled with a fixed seed."""
  def load(prefix):
    return (read_idx(os.path.join(source_dir, f'{prefix}-images-idx3-ubyte.gz')),
            read_idx(os.path.join(source_dir, f'{prefix}-labels-idx1-ubyte.gz')))

  train_images, train_labels = load('train')
  test_images, test_labels = load('t10k')
  keep = balanced_subset(train_labels, train_per_class)
  rng = np.random.default_rng(_ORDER_SEED)
  train_order = rng.permutation(keep)
  test_order = rng.permutation(len(test_labels))
  return {
      'train_images': train_images[train_order], 'train_labels': train_labels[train_order],
      'test_images': test_images[test_order], 'test_labels': test_labels[test_order],
      'label_names': np.array(LABEL_NAMES),
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--source_dir', default='/usr/share/datasets/fashion-mnist')
  parser.add_argument('--train_per_class', type=int, default=2000)
  parser.add_argument('--output', default=os.path.normpath(os.path.join(
      os.path.dirname(__file__), '..', 'vit_jax', 'data', 'fashion_mnist_embedded.npz')))
  args = parser.parse_args()
  if not os.path.isdir(args.source_dir):
    raise SystemExit(f'{args.source_dir} does not exist: install the Debian package '
                     '`dataset-fashion-mnist` or pass --source_dir.')
  arrays = build(args.source_dir, args.train_per_class)
  np.savez_compressed(args.output, **arrays)
  size_mib = os.path.getsize(args.output) / 2**20
  print(f'Wrote {args.output}: {len(arrays["train_labels"])} train + '
        f'{len(arrays["test_labels"])} test images, {size_mib:.1f} MiB.')


if __name__ == '__main__':
  main()

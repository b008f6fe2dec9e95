"""The data that ships inside vit_jax (README.md in this folder): the names of its two datasets
and the file of the embedded Fashion-MNIST. numpy only, so that a tool showing a few of its images
needs no TensorFlow."""
import os

import numpy as np

DATASET = 'fashion_mnist_embedded'
# Canvases of 2 to 4 items of the embedded data, with per-pixel labels (data/segmentation.py).
SEGMENTATION_DATASET = 'fashion_mnist_segmentation'
PATH = os.path.join(os.path.dirname(__file__), 'fashion_mnist_embedded.npz')


def arrays() -> dict[str, np.ndarray]:
  """The arrays of the embedded file by name: `train_images` and `test_images`, uint8 (N, 28, 28)
  grey; `train_labels` and `test_labels`, uint8 (N,); `label_names`, str (10,)."""
  if not os.path.exists(PATH):
    raise FileNotFoundError(
        f'The embedded dataset {PATH} is missing: reinstall vit_jax, or rebuild it with '
        '`python scripts/build_embedded_dataset.py`.')
  with np.load(PATH) as data:
    return {name: data[name] for name in data.files}

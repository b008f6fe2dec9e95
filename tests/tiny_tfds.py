"""A tiny tfds dataset, `tiny_fashion_mnist`: 120 train and 40 test images of the embedded data.

Tests prepare it with `TinyFashionMnist(data_dir=DIR).download_and_prepare()`. As a config file
it is the tiny model of tiny_config.py, and loading it registers the builder, so that vit_jax
prepares the dataset by name on first use, as it does `cifar10`:
`PYTHONPATH=tests python -m vit_jax.main --config=tests/tiny_tfds.py
--config.dataset=tiny_fashion_mnist --config.tfds_data_dir=DIR --workdir=WORKDIR`.
"""
import io

import numpy as np
from PIL import Image
import tensorflow_datasets as tfds

from vit_jax.data import embedded
import tiny_config

SPLIT_SIZES = {'train': 120, 'test': 40}


class TinyFashionMnist(tfds.core.GeneratorBasedBuilder):
  """The first SPLIT_SIZES images of each split of the embedded data, as PNG files."""
  VERSION = tfds.core.Version('1.0.0')

  def _info(self):
    with np.load(embedded.PATH) as data:
      label_names = data['label_names']
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(shape=(28, 28, 1)),
        'label': tfds.features.ClassLabel(names=[str(n) for n in label_names]),
    }))

  def _split_generators(self, dl_manager):
    del dl_manager
    return {split: self._generate_examples(split, count) for split, count in SPLIT_SIZES.items()}

  def _generate_examples(self, split, count):
    with np.load(embedded.PATH) as data:
      images, labels = data[f'{split}_images'][:count], data[f'{split}_labels'][:count]
    for i, (image, label) in enumerate(zip(images, labels)):
      png = io.BytesIO()
      Image.fromarray(image).save(png, format='png')
      png.seek(0)
      yield i, {'image': png, 'label': label}


def get_config():
  return tiny_config.get_config()

"""What a run checks and says of its dataset before anything compiles: that it reads, has two
classes or more and labels what the objective needs, images or pixels (`check_data`,
`check_classes`, `check_label_kind`), one line naming it with its image counts and
classes (`dataset_line`), and a warning where each image would be seen too often
(`warn_of_repetition`).
"""
import contextlib
import logging

import ml_collections

from vit_jax import tasks
from vit_jax.data import pipeline
from vit_jax.errors import ConfigError


@contextlib.contextmanager
def data_errors(prefix: str):
  """Raises the errors of the data sources (an unknown dataset, a bad split or folder, a test
  image that does not decode) as ConfigError, the message after `prefix`."""
  try:
    yield
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f'{prefix}{e}') from None


def check_data(config: ml_collections.ConfigDict, prefix: str) -> pipeline.DatasetInfo:
  """The dataset info of `config`; raises ConfigError, its message after `prefix`, where the
  dataset or a split does not exist or a test image does not decode."""
  with data_errors(prefix):
    return pipeline.get_dataset_info(config)


def check_classes(config: ml_collections.ConfigDict, info: pipeline.DatasetInfo) -> None:
  """Raises ConfigError where the dataset of a run whose task reads labels (a supervised one) has
  fewer than 2 classes: a classifier of one class scores every image right and learns nothing."""
  if tasks.for_config(config).needs_labels and info.num_classes < 2:
    raise ConfigError(
        f'config.dataset={config.dataset!r} has {info.num_classes} class'
        f'{"" if info.num_classes == 1 else "es"} ({", ".join(info.label_names) or "none"}): a '
        'classifier needs 2 or more. Use a dataset of several classes (an image folder: one '
        'folder per class, DIR/train/<class>/ and DIR/test/<class>/), or pre-train without '
        'labels with --config.objective=masked_patch_prediction.')


def check_label_kind(config: ml_collections.ConfigDict, info: pipeline.DatasetInfo) -> None:
  """Raises ConfigError where the objective labels each pixel and the dataset each image, or
  the other way round."""
  per_pixel = tasks.for_config(config).per_pixel_labels
  if per_pixel == info.per_pixel_labels or not tasks.for_config(config).needs_labels:
    return
  has, needs = ('a label per image', 'per pixel') if per_pixel else ('labels per pixel',
                                                                     'per image')
  raise ConfigError(
      f'config.dataset={config.dataset!r} has {has}, and config.objective={config.objective!r} '
      f'needs them {needs}: use a dataset of that kind (e.g. fashion_mnist_segmentation for '
      'segmentation, fashion_mnist_embedded for classification), or the matching objective.')


SHOWN_CLASS_NAMES = 5  # Class names the dataset line shows; '...' for the rest.


def dataset_line(config: ml_collections.ConfigDict, info: pipeline.DatasetInfo) -> str:
  """'Dataset NAME: N train images (SPLIT), M test images (SPLIT), K classes (a, b, ...).', with
  ' Multi-label.' after it for multi-label data."""
  names = ', '.join(info.label_names[:SHOWN_CLASS_NAMES])
  more = ', ...' if info.num_classes > SHOWN_CLASS_NAMES else ''
  return (f'Dataset {config.dataset}: {info.num_train:,} train images ({config.train_split}), '
          f'{info.num_test:,} test images ({config.test_split}), {info.num_classes} classes '
          f'({names}{more}).{" Multi-label." if info.multi_label else ""}')


# Passes over each training image beyond which a run from scratch gets a warning: its config's
# schedule was made for more data (on 20 images, 900 steps of 128 spend minutes on a flat loss).
MAX_PASSES = 100
SMALL_DATA_CONFIG = 'configs/scratch_small.py'


def warn_of_repetition(config: ml_collections.ConfigDict,
                       info: pipeline.DatasetInfo) -> None:
  """Logs a warning where a run from scratch sees each training image more than MAX_PASSES
  times, naming SMALL_DATA_CONFIG. Fine-tuning is left alone: the paper fine-tunes for hundreds
  of passes over small datasets."""
  passes = config.total_steps * config.batch / info.num_train
  if passes > MAX_PASSES and not config.pretrained_path:
    logging.warning(
        'This run sees each of its %s training images about %s times (%s steps of %s images), '
        'a schedule made for more data. For a small image folder, --config=%s:DIR fits the '
        'schedule to it (about %d passes, with augmentation and regularisation); or lower '
        '--config.total_steps.', f'{info.num_train:,}', f'{passes:,.0f}',
        f'{config.total_steps:,}', config.batch, SMALL_DATA_CONFIG, MAX_PASSES)

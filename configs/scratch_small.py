"""`--config=configs/scratch_small.py:DIR[,CROP]`: a small ViT from scratch on a small image folder.

DIR holds DIR/train/<class>/* and DIR/test/<class>/*, or DIR/<class>/* (a tenth of each class held
out to test; vit_jax/data/image_files.py); CROP is the resolution (default 64 px, a multiple of 8).
A few thousand to a few hundred thousand images train a ViT poorly without strong augmentation and
regularisation ("How to train your ViT?", Steiner et al., 2021: on less data, more AugReg), so this
preset takes the paper's recipe to small data: a 6-block ViT of width 192 (ViT-Ti's) on 8x8 patches,
AdamW (lr 1e-3, weight decay 0.05) with warmup and cosine decay over 100 epochs of batch 128 (a
smaller power of two for a folder of fewer images), Inception crops of 25-100% of the area, flips,
RandAugment (2, 10) and Mixup 0.2 (AugReg's 'light2' level), label smoothing 0.1 and dropout 0.1 and
stochastic depth 0.1. These are a starting point, not tuned values: the A/B of the default run in
docs/experiments.md shows what each costs on 28 px Fashion-MNIST."""
import math
import os

import ml_collections

from vit_jax.config import defaults
from vit_jax.data import image_files
from vit_jax.models import registry

EPOCHS = 100
WARMUP_EPOCHS = 5
BATCH = 128
STEPS_WITHOUT_FOLDER = 10_000  # When DIR/train cannot be counted (yet).


def count_images(folder: str) -> int:
  """Files with an image extension under `folder`, hidden ones left out (0 if it does not
  exist)."""
  return sum(map(image_files.is_image_file, image_files.files_under(folder)))


def training_images(folder: str) -> int:
  """The images a run on the image folder `folder` trains on: those of folder/train, or of a
  folder that holds its class folders itself, all but its held-out test share."""
  if not (os.path.isdir(folder) and image_files.is_flat_folder(folder)):
    return count_images(os.path.join(folder, 'train'))
  return image_files.flat_train_size([count_images(os.path.join(folder, name))
                                  for name in image_files.subfolders(folder)])


def get_config(arg: str = '') -> ml_collections.ConfigDict:
  folder, _, crop = arg.partition(',')
  if not folder:
    raise ValueError('--config=configs/scratch_small.py:DIR[,CROP]: give the image folder DIR '
                     '(with DIR/train/<class>/* and DIR/test/<class>/*), e.g. '
                     'configs/scratch_small.py:/data/flowers,64.')
  config = defaults.training_defaults()
  config.dataset = folder
  config.pp.crop = int(crop or 64)
  config.pp.resize = None
  config.pp.inception_crop, config.pp.area_min, config.pp.flip = True, 0.25, True
  config.pp.randaug = (2, 10)
  config.mixup.p = 0.2
  config.label_smoothing = 0.1
  config.model_name = 'ViT-Ti_8-6'
  config.model = registry.vit(config.model_name, patch=8, hidden=192, mlp=768, heads=3, layers=6,
                              dropout=0.1)
  config.model.transformer.stochastic_depth = 0.1

  images = training_images(folder)
  # A folder of fewer than BATCH images trains on batches of a power of two that it fills, so
  # that its 100 epochs stay 100 passes over each image (or fewer), not 100 batches of BATCH.
  config.batch = min(BATCH, 2 ** int(math.log2(images))) if images else BATCH
  config.batch_eval = 512
  steps_per_epoch = max(images // config.batch, 1)
  config.total_steps = EPOCHS * steps_per_epoch if images else STEPS_WITHOUT_FOLDER
  config.warmup_steps = min(WARMUP_EPOCHS * steps_per_epoch, config.total_steps // 10)
  config.optimizer = 'adamw'
  config.base_lr = 1e-3
  config.weight_decay = 0.05
  config.decay_type = 'cosine'
  config.eval_every = config.checkpoint_every = max(config.total_steps // 10, 100)
  return config

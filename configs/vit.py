"""`--config=configs/vit.py:MODEL,DATASET`: a registry model on a dataset preset.

MODEL is a short name (ti16, s16, b16, l16, h14, b32, r50_b16, ...: SHORT_NAMES of
vit_jax/models/registry.py) or a registry name (ViT-B_16); DATASET a preset of DATASETS, the
embedded dataset, any tfds name, or an image folder DIR with DIR/train/<class>/* and
DIR/test/<class>/*.
Without a pretrained path this trains from scratch; with `--config.pretrained_path=FILE.npz` it
fine-tunes as in the paper (momentum SGD, batch 512, cosine decay, no weight decay, global-norm
clip 1).
"""
import ml_collections

from vit_jax.config import defaults
from vit_jax.models import registry

# Fine-tuning presets of the paper's transfer experiments (Appendix B.1.1), at 384 px.
DATASETS = {
    'cifar10': dict(train_split='train[:98%]', val_split='train[98%:]', test_split='test',
                    total_steps=10_000, crop=384, resize=None, flip=True),
    'cifar100': dict(train_split='train[:98%]', val_split='train[98%:]', test_split='test',
                     total_steps=10_000, crop=384, resize=None, flip=True),
    'imagenet2012': dict(train_split='train[:99%]', val_split='train[99%:]',
                         test_split='validation', total_steps=20_000, crop=384, resize=438,
                         flip=True),
    'oxford_iiit_pet': dict(train_split='train[:90%]', val_split='train[90%:]',
                            test_split='test', total_steps=500, crop=384, resize=None, flip=True),
    'oxford_flowers102': dict(train_split='train', val_split=None, test_split='test',
                              total_steps=500, crop=384, resize=None, flip=True),
    'fashion_mnist_embedded': dict(train_split='train', val_split=None, test_split='test',
                                   total_steps=2_000, crop=224, resize=None, flip=True),
}
# Anything else (a tfds name or an image folder) gets these.
OTHER_DATASET = dict(train_split='train', val_split=None, test_split='test', total_steps=2_000,
                     crop=384, resize=None, flip=True)


def get_config(arg: str = 'b16,cifar10') -> ml_collections.ConfigDict:
  model, _, dataset = arg.partition(',')
  if not dataset:
    raise ValueError(f'--config=configs/vit.py:{arg}: give MODEL,DATASET, e.g. b16,cifar10.')
  config = defaults.with_model(defaults.training_defaults(), registry.full_name(model))
  preset = DATASETS.get(dataset, OTHER_DATASET)
  config.dataset = dataset
  config.train_split, config.test_split = preset['train_split'], preset['test_split']
  config.evals.val.split = preset['val_split']  # Minival: the share of train out of train_split.
  config.total_steps = preset['total_steps']
  config.pp.crop, config.pp.resize, config.pp.flip = preset['crop'], preset['resize'], preset[
      'flip']
  config.eval_every = config.checkpoint_every = max(config.total_steps // 10, 100)
  return config

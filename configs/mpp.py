"""`--config=configs/mpp.py:ARG`: masked patch prediction pre-training (paper Section 4.6,
Appendix B.1.2; vit_jax/tasks/mpp.py), then fine-tuning with `--config.pretrained_path=WORKDIR`.

ARG `MODEL,DATASET` (default `b16,imagenet2012`; MODEL as in configs/vit.py, e.g. b16 or a
registry name): the paper's recipe. 50% of the patches corrupted (80% masked, 10% replaced by a
random patch, 10% kept), their 3-bit mean colour predicted; Adam at lr 2e-4 with 10k warmup
steps and cosine decay, batch 4096 (the paper: 1M steps, about 14 epochs of JFT; the same number
of steps here), weight decay 0.1 and gradient clipping at norm 1 as in its supervised
pre-training (Appendix B.1), 224 px Inception crops and flips.

ARG `fashion_mnist`: the same objective on a CPU: the default run's model and data
(`python -m vit_jax.main`), its AdamW settings (lr 2e-3: 2e-4 is too slow for its few steps) and
half its steps, 450, so that pre-training and a fine-tuning of 450 steps together match the 900
of the default run trained from scratch (docs/experiments.md: Masked patch prediction).
"""
import ml_collections

from vit_jax.config import defaults
from vit_jax.models import registry


def get_config(arg: str = 'b16,imagenet2012') -> ml_collections.ConfigDict:
  if arg == 'fashion_mnist':
    config = defaults.get_config()
    config.total_steps = 450
    config.warmup_steps = 50
    config.eval_every = config.checkpoint_every = 225
  else:
    model, _, dataset = arg.partition(',')
    if not dataset:
      raise ValueError(f'--config=configs/mpp.py:{arg}: give MODEL,DATASET, e.g. '
                       'b16,imagenet2012, or fashion_mnist.')
    config = defaults.with_model(defaults.training_defaults(), registry.full_name(model))
    config.dataset = dataset
    config.train_split, config.evals.val.split = 'train[:99%]', 'train[99%:]'
    config.test_split = 'validation' if dataset == 'imagenet2012' else 'test'
    config.pp.crop, config.pp.resize = 224, None
    config.batch = 4096
    config.total_steps = 1_000_000
    config.warmup_steps = 10_000
    config.optimizer = 'adamw'
    config.base_lr = 2e-4
    config.weight_decay = 0.1
    config.eval_every = config.checkpoint_every = 10_000
  config.objective = 'masked_patch_prediction'
  config.mpp.corruption_rate = 0.5
  config.mpp.mask_random_keep = (0.8, 0.1, 0.1)
  config.mpp.target = 'mean_color_3bit'
  return config

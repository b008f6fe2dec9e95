"""The default run: a small ViT trained from scratch on the embedded Fashion-MNIST, on a CPU.

`python -m vit_jax.main` trains it in under 5 minutes on 2 CPU cores (README has the figures):
7x7 patches of the 28x28 images (16 tokens and the class token), width 128, 4 blocks of 4
heads, AdamW with warmup and cosine decay, label smoothing, random flips. Random-area crops
(the paper's Inception crop) cost accuracy at this resolution and schedule, so they are off.
"""
from configs import common
from configs import models


def get_config():
  config = common.get_config()
  config.dataset = 'fashion_mnist_embedded'
  config.pp.crop = 28
  config.pp.flip = True
  config.pp.inception_crop = False
  config.model_name = 'ViT-mini_7'
  config.model = models.vit('ViT-mini_7', patch=7, hidden=128, mlp=512, heads=4, layers=4)
  config.batch = 128
  config.batch_eval = 1000
  config.total_steps = 900
  config.warmup_steps = 100
  config.optimizer = 'adamw'
  config.base_lr = 2e-3
  config.weight_decay = 0.05
  config.grad_clip_norm = 1.0
  config.label_smoothing = 0.1
  config.progress_every = 100
  config.eval_every = 450
  config.checkpoint_every = 450
  return config

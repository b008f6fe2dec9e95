"""The default run: a small ViT trained from scratch on the embedded Fashion-MNIST, on a CPU.

`python -m vit_jax.main` trains it in a few minutes on 2 CPU cores (see README for the figures).
"""
from configs import common
from configs import models


def get_config():
  config = common.get_config()
  config.dataset = 'fashion_mnist_embedded'
  config.pp.crop = 28
  config.pp.flip = True
  config.pp.inception_crop = True
  config.model_name = 'ViT-mini_4'
  config.model = models.vit('ViT-mini_4', patch=4, hidden=128, mlp=256, heads=4, layers=4)
  config.batch = 256
  config.batch_eval = 1000
  config.total_steps = 1000
  config.warmup_steps = 100
  config.optimizer = 'adamw'
  config.base_lr = 2e-3
  config.weight_decay = 0.05
  config.grad_clip_norm = 1.0
  config.label_smoothing = 0.1
  config.progress_every = 50
  config.eval_every = 500
  config.checkpoint_every = 500
  return config

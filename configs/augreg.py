"""`--config=configs/augreg.py:MODEL,DATA[,LEVEL[,REG]]`: ViTs from scratch the AugReg way.

"How to train your ViT? Data, Augmentation, and Regularization in Vision Transformers" (Steiner
et al., 2021), the recipe of the AugReg checkpoints, e.g. `configs/augreg.py:B/16,i1k,medium2`.

MODEL: Ti/16, S/16, S/32, B/16, B/32, L/16 (the paper's ViTs). DATA: `i1k` (tfds imagenet2012,
300 epochs) or `i21k` (ImageNet-21k, 300 epochs; set --config.dataset to your copy: a tfds name
or an image folder). LEVEL: the augmentation level of AUG_LEVELS, default medium2. REG: the
dropout and stochastic-depth rate, 0.0 or 0.1 as in the paper; default 0.1 on i1k and 0.0 on
i21k, the paper's finding that regularisation helps with ImageNet-1k's 1.3M images and mostly
hurts with ImageNet-21k's 14M.

Sources. The levels and the optimiser are the paper's (Section 3 and Appendix), checked against
the released big_vision configs (configs/vit_i1k.py and vit_i21k.py, their RANDAUG_DEF and
MIXUP_DEF tables; the paper's 'heavy' is big_vision's 'strong'): Adam (b1 0.9, b2 0.999), batch
4096, learning rate 1e-3 with 10k warmup steps and cosine decay, global-norm clip 1, weight decay
0.1 (relative to the learning rate, as optax's adamw applies it: big_vision's absolute 1e-4),
Inception crop and flip at 224 px, evaluation at 224 px from 256. On ImageNet-21k the loss is
big_vision's sigmoid cross-entropy (`loss='sigmoid_xent'`, the head's bias starting at
-log(21843) = -9.99, big_vision's -10): many of its images show several of its classes, and a
copy with multi-hot labels (an image folder with a labels.csv) trains as multi-label and
reports mAP. Differences: on ImageNet-1k the loss here is the softmax one (big_vision's is the
sigmoid one there too, head bias -6.9: add --config.loss=sigmoid_xent for it); dropout here acts
on the blocks' MLP outputs and embeddings as in the original ViT code.
"""
import ml_collections

from vit_jax.config import defaults

MODELS = {'Ti/16': 'ViT-Ti_16', 'S/16': 'ViT-S_16', 'S/32': 'ViT-S_32', 'B/16': 'ViT-B_16',
          'B/32': 'ViT-B_32', 'L/16': 'ViT-L_16'}
# Level: (RandAugment (num_layers, magnitude), or None; Mixup alpha).
AUG_LEVELS = {
    'none': (None, 0.0),
    'light1': ((2, 0), 0.0),
    'light2': ((2, 10), 0.2),
    'medium1': ((2, 15), 0.2),
    'medium2': ((2, 15), 0.5),
    'heavy1': ((2, 20), 0.5),
    'heavy2': ((2, 20), 0.8),
}
DATA = {
    # ImageNet-1k: 1,281,167 training images, 1% held out as minival (as big_vision does).
    'i1k': dict(dataset='imagenet2012', train_split='train[:99%]', val_split='train[99%:]',
                test_split='validation', images=1_281_167, reg=0.1, loss='softmax_xent'),
    # ImageNet-21k, fall 2011 release: about 14.2M images of 21,843 classes. No public tfds
    # builder: point config.dataset at your copy (and its splits, e.g. 'train[:51200]' as the
    # held-out part, as big_vision does).
    'i21k': dict(dataset='imagenet21k', train_split='train', val_split=None, test_split='test',
                 images=14_197_122, reg=0.0, loss='sigmoid_xent'),
}
EPOCHS = 300
BATCH = 4096


def get_config(arg: str = 'B/16,i1k,medium2') -> ml_collections.ConfigDict:
  model, data, level, reg = (arg.split(',') + [None] * 3)[:4]
  if model not in MODELS or data not in DATA or (level or 'medium2') not in AUG_LEVELS:
    raise ValueError(f'--config=configs/augreg.py:{arg}: give MODEL,DATA[,LEVEL[,REG]] with '
                     f'MODEL in {list(MODELS)}, DATA in {list(DATA)}, LEVEL in '
                     f'{list(AUG_LEVELS)}, e.g. B/16,i1k,medium2,0.1.')
  preset = DATA[data]
  config = defaults.with_model(defaults.training_defaults(), MODELS[model])
  config.dataset = preset['dataset']
  config.train_split, config.evals.val.split = preset['train_split'], preset['val_split']
  config.test_split = preset['test_split']
  config.loss = preset['loss']

  config.pp.crop, config.pp.resize = 224, 256
  config.pp.inception_crop, config.pp.flip = True, True
  config.pp.randaug, config.mixup.p = AUG_LEVELS[level or 'medium2']
  rate = float(reg) if reg else preset['reg']
  config.model.transformer.dropout_rate = config.model.transformer.stochastic_depth = rate

  config.batch = config.batch_eval = BATCH
  config.total_steps = round(EPOCHS * preset['images'] / BATCH)
  config.warmup_steps = 10_000
  config.optimizer = 'adamw'
  config.base_lr = 1e-3
  config.weight_decay = 0.1
  config.decay_type = 'cosine'
  config.grad_clip_norm = 1.0
  config.label_smoothing = 0.0
  config.eval_every = config.checkpoint_every = 5_000
  config.progress_every = 100
  return config

"""The training defaults every config builds on, and the default run of `python -m vit_jax.main`.

`training_defaults()` holds data, model, optimiser, schedule, logging and checkpoint settings;
the experiment files of the repository's `configs/` folder (loaded by path,
`--config=configs/vit.py:b16,cifar10`) start from it. `get_config()` is the run that
`python -m vit_jax.main` trains without `--config`: it lives in the package so that an installed
vit_jax has it, whatever the current directory.
"""
import copy
import math

import ml_collections

from vit_jax.models import registry
from vit_jax.tasks import supervised


# In config.fewshot.datasets: the run's own dataset, config.dataset, whatever it is set to.
OWN_DATASET = 'config.dataset'


def training_defaults() -> ml_collections.ConfigDict:
  """Every config field with its default: ViT-B_16 fine-tuning settings of the paper.

  FIELD_HELP (below) says what each field means."""
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Data.
  config.dataset = 'fashion_mnist_embedded'
  config.tfds_data_dir = ml_collections.FieldReference(None, field_type=str)
  config.tfds_manual_dir = ml_collections.FieldReference(None, field_type=str)
  config.train_split = 'train'
  config.test_split = 'test'
  config.val_split = ml_collections.FieldReference(None, field_type=str)  # Minival.
  config.skip_bad_images = False
  config.resume_changed_data = False
  config.shuffle_buffer = 50_000
  config.prefetch = 2
  config.pp = ml_collections.ConfigDict({
      'crop': ml_collections.FieldReference(224, field_type=object),  # Or (height, width).
      'resize': ml_collections.FieldReference(None, field_type=int),
      'flip': True,
      'inception_crop': True,
      'area_min': 0.05,
      'randaug': ml_collections.FieldReference(None, field_type=tuple),
  })

  # Model: a registry name (vit_jax.models.registry.MODEL_CONFIGS) and its config (`with_model`).
  config.model_name = 'ViT-B_16'
  config.model = ml_collections.ConfigDict()  # Filled from the registry by `with_model`.
  config.dtype = 'float32'  # Computation dtype; parameters stay float32.
  # Memory: the blocks as one nn.scan (compile time independent of depth), and rematerialised
  # under a jax.checkpoint policy (see models_vit.REMAT_POLICIES), e.g. 'nothing_saveable'.
  config.scan_layers = False
  config.remat_policy = ml_collections.FieldReference(None, field_type=str)
  config.attention = 'auto'
  # Position information (vit_jax.models.positions.POSEMB_KINDS); learned_1d: the published layout.
  config.posemb = 'learned_1d'
  config.pretrained_path = ml_collections.FieldReference(None, field_type=str)
  config.posemb_method = 'bilinear'  # How pretrained position embeddings are resized.
  config.pretrained_keep_head = False  # True: keep the file's head (same classes).

  # Optimisation.
  config.batch = 512
  config.batch_eval = 512
  # An int, or 'auto': the fewest micro-batches whose step fits the devices' memory (vit_jax.fit).
  config.accum_steps = ml_collections.FieldReference(1, field_type=object)
  config.total_steps = 10_000
  config.warmup_steps = 500
  config.optimizer = 'sgd'
  config.base_lr = 0.03
  config.min_lr = 0.0
  config.decay_type = 'cosine'
  config.momentum = 0.9
  config.weight_decay = 0.0
  config.grad_clip_norm = 1.0
  config.label_smoothing = 0.0
  # 'softmax_xent' or 'sigmoid_xent' (vit_jax/tasks/supervised.py): the sigmoid one starts the
  # head's bias at -log(num_classes); either takes multi-label data.
  config.loss = supervised.DEFAULT_LOSS
  # Per-parameter learning rates and freezing (vit_jax/training/param_groups.py): (regex,
  # multiplier) pairs over '/'-joined parameter paths, first match wins; layer-wise decay; a
  # regex of the frozen.
  config.lr_mults = ()
  config.layer_decay = ml_collections.FieldReference(None, field_type=float)  # None or 0: off.
  config.frozen = ml_collections.FieldReference(None, field_type=str)  # None: none frozen.
  # Mixup of each training batch with itself rolled by one, ratio ~ Beta(p, p) (train_step.mixup).
  config.mixup = ml_collections.ConfigDict({'p': 0.0})
  # Exponential moving average of the weights, evaluated beside them and exported as model.npz.
  config.ema_decay = 0.0  # 0: off.

  # Objective: 'supervised' (labels), 'masked_patch_prediction' (self-supervised pre-training
  # of the paper's Section 4.6, vit_jax/tasks/mpp.py; labels unused) or 'segmentation' (labels
  # per pixel, vit_jax/tasks/segmentation.py).
  config.objective = 'supervised'
  config.mpp = ml_collections.ConfigDict({
      'corruption_rate': 0.5,
      'mask_random_keep': (0.8, 0.1, 0.1),
      'target': 'mean_color_3bit',
  })
  # Segmentation (vit_jax/tasks/segmentation.py): the label value of pixels that count nowhere.
  config.seg = ml_collections.ConfigDict({
      'ignore_label': 255,
      'window': ml_collections.FieldReference(None, field_type=int),  # None, 0: the whole image.
  })

  # Devices: a ('data', 'model') mesh, and the layout of params and optimiser state on it (see
  # vit_jax/sharding.py).
  config.mesh = ml_collections.ConfigDict({'data': -1, 'model': 1})
  config.sharding = 'data'
  config.logical_axis_rules = []

  # Deprecated: few-shot evaluation's fields as older flags and config files set them; None:
  # unset. vit_jax.evaluators.migrate moves those set into config.evals.fewshot.
  config.fewshot = ml_collections.ConfigDict({
      field: ml_collections.FieldReference(None, field_type=_type_of(default))
      for field, default in fewshot_fields().items()})

  # Logging and checkpoints.
  config.progress_every = 50
  config.eval_every = 1000
  config.val_every = ml_collections.FieldReference(None, field_type=int)  # None: eval_every.
  config.checkpoint_every = 1000
  config.keep_checkpoints = 2

  # Evaluation: {name: entry}, each entry of a `type` of vit_jax.evaluators.TYPES with its own
  # data and cadence (`every`); its metrics are named after it (test_accuracy,
  # fewshot/DATASET_5shot). docs/evaluation.md, "Evaluators", has the fields of each type.
  config.evals = ml_collections.ConfigDict({
      # The objective's evaluation (type None) of config.test_split, every config.eval_every.
      'test': objective_entry(config.get_ref('test_split')),
      # Of a minival split held out of train_split, e.g. 'train[98%:]'; None: off.
      'val': objective_entry(ml_collections.FieldReference(None, field_type=str)),
      # Few-shot linear evaluation of the frozen representation (evaluators/linear_probe.py).
      'fewshot': {'type': 'fewshot', **fewshot_fields()},
  })
  return config


def objective_entry(split) -> dict:
  """An entry of config.evals evaluating `split` by the objective's evaluator (type None)
  every config.eval_every steps (every None)."""
  return {'type': ml_collections.FieldReference(None, field_type=str), 'split': split,
          'every': ml_collections.FieldReference(None, field_type=int)}


def _type_of(value) -> type:
  """The type of a config value, that of a FieldReference's value for one."""
  return value.get_type() if isinstance(value, ml_collections.FieldReference) else type(value)


def fewshot_fields() -> dict:
  """The fields of few-shot evaluation and their defaults (off: no datasets)."""
  return {
      'datasets': (),  # (): off.
      'shots': (5, 10),
      'every': ml_collections.FieldReference(None, field_type=int),  # None: at the end only.
      'num_train': ml_collections.FieldReference(None, field_type=int),  # None: the whole split.
      'num_test': ml_collections.FieldReference(None, field_type=int),  # None: the whole split.
      'seeds': 1,
      'train_split': 'train',
      'test_split': 'test',
  }


def with_model(config: ml_collections.ConfigDict, model_name: str) -> ml_collections.ConfigDict:
  """Sets `model_name` and copies the registry's model config into `config.model`.

  An unknown name leaves `config.model` empty; training then stops with the known names.
  """
  config.model_name = model_name
  if model_name in registry.MODEL_CONFIGS:
    config.model = registry.MODEL_CONFIGS[model_name].copy_and_resolve_references()
  return config


# The optimiser of the paper's transfer runs (Appendix B.1.1) as training_defaults() sets it, the
# one of configs/vit.py's fine-tuning presets: momentum SGD at 0.03, no weight decay, cosine
# decay, global-norm clipping at 1, no label smoothing.
TRANSFER_FIELDS = ('optimizer', 'base_lr', 'momentum', 'weight_decay', 'decay_type', 'min_lr',
                   'grad_clip_norm', 'label_smoothing')


def continued_at(config: ml_collections.ConfigDict, crop: int, pretrained_path: str,
                 total_steps: int) -> ml_collections.ConfigDict:
  """`config`, a trained run's, continued from its model `pretrained_path` at `crop` pixels on
  the same classes, with the trained head kept and the paper's transfer recipe
  (TRANSFER_FIELDS) for `total_steps` updates, a tenth of them warmup.

  The patches grow with the images (crop / config.pp.crop times, e.g. 7 to 14 px from 28 to
  56 px), so the grid of tokens and the position embeddings stay, and the patch-embedding
  kernel is resized to the new patch size (`finetune.resize_patch_kernel`): on the same images
  resized, every token, and so the model's output, starts as it was. With the patch size kept
  instead ("--config.model.patches.size=(7,7)"), the position embeddings are interpolated to
  the larger grid and the first layer has to relearn what its patches show. docs/finetuning.md
  has what each reaches. Raises a ValueError when the patch size would not be a whole number of
  pixels."""
  config = copy.deepcopy(config)  # Its None fields keep their types, for overrides.
  transfer = training_defaults()
  for name in TRANSFER_FIELDS:
    config[name] = transfer[name]
  config.model.patches.size = tuple(_grown_patch(size, config.pp.crop, crop)
                                    for size in config.model.patches.size)
  config.pp.crop = crop
  config.pretrained_path = pretrained_path
  config.pretrained_keep_head = True
  config.total_steps = total_steps
  config.warmup_steps = total_steps // 10
  config.eval_every = config.checkpoint_every = total_steps
  config.progress_every = max(total_steps // 5, 1)
  return config


def _grown_patch(patch: int, crop: int, new_crop: int) -> int:
  """The side in pixels of a `patch`-pixel patch of a `crop`-pixel image resized to `new_crop`."""
  if patch * new_crop % crop:
    raise ValueError(f'Continuing at {new_crop} px from {crop} px grows the {patch}-pixel patches '
                     f'to {patch * new_crop / crop:g} px, not a whole number: choose a size '
                     f'that is a multiple of {crop // math.gcd(patch, crop)} px.')
  return patch * new_crop // crop


def get_config() -> ml_collections.ConfigDict:
  """The default run: a small ViT trained from scratch on the embedded Fashion-MNIST, on a CPU.

  `python -m vit_jax.main` trains it in minutes on a CPU (the README has the figures):
  7x7 patches of the 28x28 images (16 tokens and the class token), width 128, 4 blocks of 4
  heads, AdamW with warmup and cosine decay, label smoothing, random flips. Random-area crops
  (the paper's Inception crop) cost accuracy at this resolution and schedule, so they are off.
  At the end it measures 5- and 10-shot linear accuracy of the representation on its dataset
  (config.fewshot).
  """
  config = training_defaults()
  config.dataset = 'fashion_mnist_embedded'
  config.pp.crop = 28
  config.pp.flip = True
  config.pp.inception_crop = False
  config.model_name = 'ViT-mini_7'
  config.model = registry.vit('ViT-mini_7', patch=7, hidden=128, mlp=512, heads=4, layers=4)
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
  # 5- and 10-shot accuracy of the representation at the end, on the run's own dataset (with
  # --config.dataset=DIR, that folder): shots drawn from 10,000 training images, scored on 1,000
  # test images (docs/evaluation.md: what it costs).
  config.evals.fewshot.update(datasets=(OWN_DATASET,), num_train=10_000, num_test=1000)
  return config


def resolve_model(config: ml_collections.ConfigDict) -> None:
  """Makes `config.model` the model that `config.model_name` names, where the two disagree.

  A config file sets both, so a name that differs from `config.model.name` was set afterwards
  (`--config.model_name=ViT-B_16`): the registry's model of that name replaces `config.model`.
  A ValueError names a name that is neither `config.model.name` nor a registry model. A model
  config without a `name` (older config files) is taken to be the one `config.model_name` names.
  """
  if config.model and config.model.get('name', config.model_name) == config.model_name:
    return
  if config.model_name not in registry.MODEL_CONFIGS:
    current = f' (config.model is {config.model.get("name")!r})' if config.model else ''
    raise ValueError(f'Unknown model config.model_name={config.model_name!r}{current}. Known '
                     f'models: {", ".join(registry.MODEL_CONFIGS)} (short names: '
                     'vit_jax.models.registry.SHORT_NAMES).')
  with_model(config, config.model_name)

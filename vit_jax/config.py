"""The training defaults every config builds on, and the default run of `python -m vit_jax.main`.

`training_defaults()` holds data, model, optimiser, schedule, logging and checkpoint settings;
the experiment files of the repository's `configs/` folder (loaded by path,
`--config=configs/vit.py:b16,cifar10`) start from it. `get_config()` is the run that
`python -m vit_jax.main` trains without `--config`: it lives in the package so that an installed
vit_jax has it, whatever the current directory.
"""
import dataclasses
import math
from typing import Any

import ml_collections

from vit_jax import registry

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
      'crop': 224,
      'resize': ml_collections.FieldReference(None, field_type=int),
      'flip': True,
      'inception_crop': True,
      'area_min': 0.05,
      'randaug': ml_collections.FieldReference(None, field_type=tuple),
  })

  # Model: a registry name (see vit_jax.registry.MODEL_CONFIGS) and its config (`with_model`).
  config.model_name = 'ViT-B_16'
  config.model = ml_collections.ConfigDict()  # Filled from the registry by `with_model`.
  config.dtype = 'float32'  # Computation dtype; parameters stay float32.
  # Memory: the blocks as one nn.scan (compile time independent of depth), and rematerialised
  # under a jax.checkpoint policy (see models_vit.REMAT_POLICIES), e.g. 'nothing_saveable'.
  config.scan_layers = False
  config.remat_policy = ml_collections.FieldReference(None, field_type=str)
  config.attention = 'auto'
  # Position information (vit_jax.positions.POSEMB_KINDS); learned_1d: the published layout.
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
  # Per-parameter learning rates and freezing (vit_jax/param_groups.py): (regex, multiplier)
  # pairs over '/'-joined parameter paths, first match wins; layer-wise decay; a regex of frozen.
  config.lr_mults = ()
  config.layer_decay = ml_collections.FieldReference(None, field_type=float)  # None or 0: off.
  config.frozen = ml_collections.FieldReference(None, field_type=str)  # None: none frozen.
  # Mixup of each training batch with itself rolled by one, ratio ~ Beta(p, p) (train_step.mixup).
  config.mixup = ml_collections.ConfigDict({'p': 0.0})
  # Exponential moving average of the weights, evaluated beside them and exported as model.npz.
  config.ema_decay = 0.0  # 0: off.

  # Objective: 'supervised' (labels) or 'masked_patch_prediction' (self-supervised pre-training
  # of the paper's Section 4.6, vit_jax/mpp.py; labels unused).
  config.objective = 'supervised'
  config.mpp = ml_collections.ConfigDict({
      'corruption_rate': 0.5,
      'mask_random_keep': (0.8, 0.1, 0.1),
      'target': 'mean_color_3bit',
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
      # Few-shot linear evaluation of the frozen representation (vit_jax/fewshot.py).
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
  kernel is resized to the new patch size (`checkpoint.resize_patch_kernel`): on the same images
  resized, every token, and so the model's output, starts as it was. With the patch size kept
  instead ("--config.model.patches.size=(7,7)"), the position embeddings are interpolated to
  the larger grid and the first layer has to relearn what its patches show. docs/finetuning.md
  has what each reaches. Raises a ValueError when the patch size would not be a whole number of
  pixels."""
  config = config.copy_and_resolve_references()
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


# One line on each few-shot field (config.evals.fewshot).
FEWSHOT_HELP = {
    'datasets': 'Few-shot linear evaluation during training on these datasets (as '
                f"config.dataset names them; {OWN_DATASET!r}: the run's own); (): off.",
    'shots': 'Few-shot: the k of k-shot, images per class the regression sees.',
    'every': 'Few-shot: evaluate every this many steps, and at the end; None: at the end only.',
    'num_train': 'Few-shot: draw the shots from the first this many images of train_split (all '
                 "where it has fewer; not where it is sliced itself, e.g. 'train[:500]'); None: "
                 'all.',
    'num_test': 'Few-shot: score on the first this many images of test_split (as num_train); '
                'None: all.',
    'seeds': 'Few-shot: shot choices averaged over.',
    'train_split': 'Few-shot: split name the shots (and the held-out images that choose the L2) '
                   'come from.',
    'test_split': 'Few-shot: split name scored on.',
}

# One line on each field, in the order `python -m vit_jax.main --help` lists them.
FIELD_HELP = {
    'seed': 'Seed of the initial params, the data order and the augmentation.',
    'dataset': "'fashion_mnist_embedded', a tfds name, or an image folder DIR with "
               'DIR/{train,test}/<class>/*.',
    'tfds_data_dir': 'Where tfds datasets are (or get) prepared; None: tfds default.',
    'tfds_manual_dir': 'Where the manually downloaded files of a tfds dataset are.',
    'train_split': "Split string to train on, e.g. 'train[:98%]'.",
    'test_split': "Split string to evaluate on, e.g. 'test'.",
    'val_split': 'Deprecated: config.evals.val.split.',
    'skip_bad_images': 'Image folders: skip (and count) files that do not decode, instead of '
                       'stopping.',
    'resume_changed_data': 'Resume from a checkpoint whose training data changed since (the '
                           'file list, the tfds version or split sizes) in a new order; by '
                           'default such a resume is refused.',
    'shuffle_buffer': 'tfds datasets: records in the shuffle buffer.',
    'prefetch': 'Batches prepared ahead of the step.',
    'pp.crop': 'Model resolution in pixels (a multiple of the patch size).',
    'pp.resize': 'Evaluation: resize the short side to this, then crop the centre; None: '
                 'resize to pp.crop.',
    'pp.flip': 'Training: random horizontal flips.',
    'pp.inception_crop': 'Training: random-area, random-aspect crops (the paper), or whole '
                         'images.',
    'pp.area_min': 'Inception crop: the smallest fraction of the image area kept.',
    'pp.randaug': 'Training: RandAugment (num_layers, magnitude), e.g. (2, 10), magnitude 10 '
                  'the usual largest (vit_jax/randaugment.py); None: off.',
    'model_name': 'Registry model (vit_jax.registry.MODEL_CONFIGS) that fills config.model; '
                  'override its fields as --config.model.hidden_size=...',
    'dtype': "Computation dtype, 'float32' or 'bfloat16'; params stay float32.",
    'scan_layers': 'Run the blocks as one nn.scan: compile time independent of depth.',
    'remat_policy': 'Rematerialise blocks under this jax.checkpoint policy, e.g. '
                    "'nothing_saveable'; None: off.",
    'attention': "Attention kernel: 'xla', 'cudnn' (fused; NVIDIA GPUs, 16-bit floats), "
                 "'splash' (Pallas flash attention; TPUs) or 'auto' (cudnn on NVIDIA GPUs, else "
                 'xla: also on TPUs, until a TPU measures splash faster).',
    'posemb': "Position information: 'learned_1d' (published), 'none', 'learned_2d', "
              "'relative' (attention bias; XLA attention) or 'sincos_2d' (fixed).",
    'pretrained_path': 'Fine-tune from this .npz checkpoint, training workdir, or published name '
                       '(augreg:B/16; python -m vit_jax.checkpoint --list).',
    'posemb_method': "How pretrained position embeddings are resized: 'bilinear', ...",
    'pretrained_keep_head': "Keep the checkpoint's head (same classes) instead of a new one.",
    'batch': 'Global batch: examples per update, over all devices.',
    'batch_eval': 'Global batch of evaluation.',
    'accum_steps': "Micro-batches per update (gradient accumulation); divides batch. 'auto': "
                   'the fewest whose step fits the memory of the devices.',
    'total_steps': 'Updates to train for.',
    'warmup_steps': 'Updates of linear learning-rate warmup from 0.',
    'optimizer': "'sgd' (momentum, bfloat16 accumulator) or 'adamw'.",
    'base_lr': 'Peak learning rate, reached after warmup.',
    'min_lr': 'Learning rate at the end of the decay.',
    'decay_type': "Learning-rate decay after warmup: 'cosine' or 'linear'.",
    'momentum': 'SGD momentum.',
    'weight_decay': "AdamW's decoupled weight decay, on kernels.",
    'grad_clip_norm': 'Clip gradients to this global norm.',
    'label_smoothing': 'Label smoothing of the training loss.',
    'lr_mults': "Learning-rate multipliers: (regex, multiplier) pairs over '/'-joined parameter "
                "paths (blocks named 'Transformer/encoderblock_{i}/...', scanned or not), the "
                "first re.search match winning, e.g. (('^head', 10.0),); others: 1.",
    'layer_decay': 'Layer-wise learning-rate decay d: block i of L gets d^(L - i), the '
                   'embeddings d^(L + 1), final norm and head 1 (times lr_mults); None or 0: '
                   'off.',
    'frozen': "Regex (re.search) of the parameter paths to freeze: no updates, optimiser state "
              "or weight decay, e.g. '^(?!head)' (a linear probe); None: none.",
    'mixup.p': 'Mixup: alpha of the Beta(alpha, alpha) mixing ratio of each training batch '
               '(one ratio per step, at least 1/2), e.g. 0.2; 0: off.',
    'ema_decay': 'Keep an EMA of the weights with this decay per step, e.g. 0.9998: evaluated '
                 'too (*_ema), written as model.npz (raw: model_raw.npz); 0: off.',
    'objective': "'supervised' (labels), or 'masked_patch_prediction' (self-supervised "
                 'pre-training, vit_jax/mpp.py; labels unused).',
    'mpp.corruption_rate': "Masked patch prediction: share of each image's patches corrupted "
                           'and predicted.',
    'mpp.mask_random_keep': 'Masked patch prediction: shares of the corrupted patches replaced '
                            'by the [mask] embedding, by a random other patch, and kept.',
    'mpp.target': "Masked patch prediction: 'mean_color_3bit' (512 classes), "
                  "'downsampled_3bit' (4x4 of them) or 'patch_l2' (pixels).",
    'mesh.data': "Devices on the mesh's data axis; -1: all that mesh.model leaves.",
    'mesh.model': "Devices on the mesh's model axis (tensor parallelism); divides the devices.",
    'sharding': "Layout of params and optimiser state: 'data', 'fsdp', 'tensor', "
                "'fsdp+tensor'.",
    'logical_axis_rules': "(logical axis, 'data' | 'model' | None) rules placed before "
                          "vit_jax.sharding.LOGICAL_AXIS_RULES, e.g. [('mlp', None)].",
    'progress_every': 'Log the loss and speed every this many steps.',
    'eval_every': 'Evaluate on the test split every this many steps, and at the end.',
    'val_every': 'Deprecated: config.evals.val.every.',
    'checkpoint_every': 'Save a checkpoint every this many steps, and at the end.',
    'keep_checkpoints': 'Checkpoints kept in WORKDIR/checkpoints; 0: all of them.',
    **{f'evals.{name}.{field}': meaning for name in ('test', 'val') for field, meaning in {
        'type': "Evaluator (vit_jax.evaluators.TYPES): 'classification' or 'mpp'; None: the "
                "objective's.",
        'every': 'Evaluate every this many steps, and at the end; None: eval_every.'}.items()},
    'evals.test.split': 'The same field as test_split.',
    'evals.val.split': "Minival split string evaluated on its own, e.g. 'train[98%:]' (held out "
                       'of train_split); None: off.',
    'evals.fewshot.type': "Evaluator of config.evals.fewshot: 'fewshot'.",
    **{f'evals.fewshot.{field}': meaning for field, meaning in FEWSHOT_HELP.items()},
    **{f'fewshot.{field}': f'Deprecated: config.evals.fewshot.{field}.' for field in FEWSHOT_HELP},
}


@dataclasses.dataclass(frozen=True)
class Range:
  """The values a numeric config field takes: numbers of `kind` (int, or float, which takes
  ints too) from `low` to `high` (None: unbounded), each bound itself included unless `open`
  says so ('low', 'high' or 'both'); besides, the `special` values, as (value, what it means):
  values outside the bounds that are taken too (None, -1), or ones inside with a meaning (0)."""
  kind: type
  low: float | None = None
  high: float | None = None
  open: str = ''
  special: tuple[tuple[Any, str], ...] = ()

  @property
  def low_open(self) -> bool:
    return self.open in ('low', 'both')

  @property
  def high_open(self) -> bool:
    return self.open in ('high', 'both')


POSITIVE_INT = Range(int, 0, open='low')
FRACTION = Range(float, 0, 1, open='high')  # A rate in [0, 1).

EVERY = Range(int, 0, open='low', special=((None, 'eval_every'),))
FEWSHOT_RANGES = {
    'every': Range(int, 0, open='low', special=((None, 'at the end only'),)),
    'num_train': Range(int, 0, open='low', special=((None, 'the whole split'),)),
    'num_test': Range(int, 0, open='low', special=((None, 'the whole split'),)),
    'seeds': POSITIVE_INT,
}

# The type and range of every numeric field, checked before anything compiles
# (validation.values_error); `test_every_numeric_config_field_has_a_range` keeps it complete.
# Model fields (config.model.*) come from the registry and are checked where present.
FIELD_RANGES = {
    'seed': Range(int, 0),
    'shuffle_buffer': POSITIVE_INT,
    'prefetch': Range(int, 0),
    'pp.crop': POSITIVE_INT,
    'pp.resize': Range(int, 0, open='low', special=((None, 'resize to pp.crop'),)),
    'pp.area_min': Range(float, 0, 1, open='low'),
    'batch': POSITIVE_INT,
    'batch_eval': POSITIVE_INT,
    'accum_steps': Range(int, 0, open='low', special=(('auto', 'the fewest that fit'),)),
    'total_steps': POSITIVE_INT,
    'warmup_steps': Range(int, 0),
    'base_lr': Range(float, 0, open='low'),
    'min_lr': Range(float, 0),
    'momentum': FRACTION,
    'weight_decay': Range(float, 0),
    'grad_clip_norm': Range(float, 0, open='low'),
    'label_smoothing': FRACTION,
    'layer_decay': Range(float, 0, 1, open='low', special=((None, 'off'), (0, 'off'))),
    'mixup.p': Range(float, 0),
    'ema_decay': FRACTION,
    'mpp.corruption_rate': Range(float, 0, 1, open='low'),
    'mesh.data': Range(int, 0, open='low',
                       special=((-1, 'all the devices that config.mesh.model leaves'),)),
    'mesh.model': POSITIVE_INT,
    'progress_every': POSITIVE_INT,
    'eval_every': POSITIVE_INT,
    'val_every': EVERY,
    'checkpoint_every': POSITIVE_INT,
    'keep_checkpoints': Range(int, 0, special=((0, 'all of them'),)),
    'evals.test.every': EVERY,
    'evals.val.every': EVERY,
    **{f'evals.fewshot.{field}': allowed for field, allowed in FEWSHOT_RANGES.items()},
    **{f'fewshot.{field}': dataclasses.replace(
        allowed, special=((None, f'config.evals.fewshot.{field}'),))
       for field, allowed in FEWSHOT_RANGES.items()},
    'model.hidden_size': POSITIVE_INT,
    'model.representation_size': Range(int, 0, open='low', special=((None, 'none'),)),
    'model.transformer.mlp_dim': POSITIVE_INT,
    'model.transformer.num_heads': POSITIVE_INT,
    'model.transformer.num_layers': POSITIVE_INT,
    'model.transformer.dropout_rate': FRACTION,
    'model.transformer.attention_dropout_rate': FRACTION,
    'model.transformer.stochastic_depth': Range(float, 0, 1),
    'model.resnet.width_factor': POSITIVE_INT,
}


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
                     'vit_jax.registry.SHORT_NAMES).')
  with_model(config, config.model_name)

"""What each config field means and which values it takes, one table each: FIELD_HELP (what
`python -m vit_jax.main --help` prints) and FIELD_RANGES (the type and range of each numeric
field, a `Range`, checked by `config.checks` before anything compiles).
"""
import dataclasses
from typing import Any

from vit_jax.config import defaults


# One line on each few-shot field (config.evals.fewshot).
FEWSHOT_HELP = {
    'datasets': 'Few-shot linear evaluation during training on these datasets (as '
                f"config.dataset names them; {defaults.OWN_DATASET!r}: the run's own); (): off.",
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
    'pp.crop': 'Model resolution in pixels (a multiple of the patch size): a side for square '
               'images, or (height, width), e.g. (224, 320).',
    'pp.resize': 'Evaluation: resize the short side to this, then crop the centre; None: '
                 'resize to pp.crop.',
    'pp.flip': 'Training: random horizontal flips.',
    'pp.inception_crop': 'Training: random-area, random-aspect crops (the paper), or whole '
                         'images.',
    'pp.area_min': 'Inception crop: the smallest fraction of the image area kept.',
    'pp.randaug': 'Training: RandAugment (num_layers, magnitude), e.g. (2, 10), magnitude 10 '
                  'the usual largest (vit_jax/data/randaugment.py); None: off.',
    'model_name': 'Registry model (vit_jax.models.registry.MODEL_CONFIGS) that fills config.model; '
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
    'loss': "Supervised loss: 'softmax_xent', or 'sigmoid_xent' (each class a yes/no, the "
            'head bias starting at -log(num_classes) as in BiT and big_vision; for multi-label '
            "data, e.g. ImageNet-21k). Softmax on multi-label data spreads each image's target "
            'over its labels.',
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
    'objective': "'supervised' (labels), 'masked_patch_prediction' (self-supervised "
                 "pre-training, vit_jax/tasks/mpp.py; labels unused), or 'segmentation' (labels "
                 'per pixel, vit_jax/tasks/segmentation.py).',
    'mpp.corruption_rate': "Masked patch prediction: share of each image's patches corrupted "
                           'and predicted.',
    'mpp.mask_random_keep': 'Masked patch prediction: shares of the corrupted patches replaced '
                            'by the [mask] embedding, by a random other patch, and kept.',
    'mpp.target': "Masked patch prediction: 'mean_color_3bit' (512 classes), "
                  "'downsampled_3bit' (4x4 of them) or 'patch_l2' (pixels).",
    'seg.ignore_label': 'Segmentation: the label of pixels that count in neither loss nor '
                        'metrics (255: as the PNG masks of Pascal VOC mark them).',
    'seg.window': 'Segmentation: encode each window x window px tile of the image apart (e.g. '
                  'the resolution the model was pre-trained at) and join their patch maps; '
                  'None or 0: the whole image at once.',
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
        'type': "Evaluator (vit_jax.evaluators.TYPES): 'classification', 'mpp' or "
                "'segmentation'; None: the objective's.",
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
    'seg.ignore_label': Range(int, -1),
    'seg.window': Range(int, 0, special=((None, 'the whole image'), (0, 'the whole image'))),
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

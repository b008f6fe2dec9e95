"""Training defaults shared by every config: data, optimiser, schedule, logging, checkpoints."""
import ml_collections

from configs import models


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0

  # Data: the embedded dataset, a tfds name, or an image folder DIR/{train,test}/{class}/*.
  config.dataset = 'fashion_mnist_embedded'
  config.tfds_data_dir = ml_collections.FieldReference(None, field_type=str)
  config.tfds_manual_dir = ml_collections.FieldReference(None, field_type=str)
  config.train_split = 'train'
  config.test_split = 'test'
  config.skip_bad_images = False
  config.shuffle_buffer = 50_000
  config.prefetch = 2
  config.pp = ml_collections.ConfigDict({
      'crop': 224,  # Model resolution in pixels.
      'resize': ml_collections.FieldReference(None, field_type=int),  # Eval: short side first.
      'flip': True,
      'inception_crop': True,
      'area_min': 0.05,  # Inception crop: smallest fraction of the image area kept.
  })

  # Model: a registry name (see vit_jax.models.MODEL_CONFIGS) or a registry-style config.
  config.model_name = 'ViT-B_16'
  config.model = ml_collections.ConfigDict()  # Filled from the registry by `with_model`.
  config.dtype = 'float32'  # Computation dtype; parameters stay float32.
  # Memory: the blocks as one nn.scan (compile time independent of depth), and rematerialised
  # under a jax.checkpoint policy (see models_vit.REMAT_POLICIES), e.g. 'nothing_saveable'.
  config.scan_layers = False
  config.remat_policy = ml_collections.FieldReference(None, field_type=str)
  config.pretrained_path = ml_collections.FieldReference(None, field_type=str)
  config.posemb_method = 'bilinear'  # How pretrained position embeddings are resized.
  config.pretrained_keep_head = False  # True: keep the file's head (same classes).

  # Optimisation.
  config.batch = 512  # Global batch.
  config.batch_eval = 512
  config.accum_steps = 1  # Gradient accumulation: micro-batches per update.
  config.total_steps = 10_000
  config.warmup_steps = 500
  config.optimizer = 'sgd'  # 'sgd' (momentum, bfloat16 accumulator) or 'adamw'.
  config.base_lr = 0.03
  config.min_lr = 0.0
  config.decay_type = 'cosine'  # 'cosine' or 'linear'.
  config.momentum = 0.9
  config.weight_decay = 0.0  # AdamW's decoupled weight decay.
  config.grad_clip_norm = 1.0
  config.label_smoothing = 0.0

  # Devices: a ('data', 'model') mesh; data=-1 takes all devices the model axis leaves.
  config.mesh = ml_collections.ConfigDict({'data': -1, 'model': 1})
  # Layout of params and optimiser state: 'data', 'fsdp', 'tensor' or 'fsdp+tensor' (see
  # vit_jax/sharding.py). Rules (logical axis, 'data' | 'model' | None) placed here take
  # precedence over vit_jax.sharding.LOGICAL_AXIS_RULES, e.g. [('mlp', None)].
  config.sharding = 'data'
  config.logical_axis_rules = []

  # Logging and checkpoints.
  config.progress_every = 50
  config.eval_every = 1000
  config.checkpoint_every = 1000
  config.keep_checkpoints = 2
  return config


def with_model(config: ml_collections.ConfigDict, model_name: str) -> ml_collections.ConfigDict:
  """Sets `model_name` and copies the registry's model config into `config.model`.

  An unknown name leaves `config.model` empty; training then stops with the known names.
  """
  config.model_name = model_name
  if model_name in models.MODEL_CONFIGS:
    config.model = models.MODEL_CONFIGS[model_name].copy_and_resolve_references()
  return config

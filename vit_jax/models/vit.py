"""The Vision Transformer (Dosovitskiy et al., ICLR 2021) as Flax linen modules.

Shapes: B batch, H/W image height/width in pixels, P patch size, T tokens, D hidden size,
N heads, K = D/N head size, M MLP size. Images are NHWC floats in [-1, 1].

The parameter tree is the one of the published checkpoints:
`embedding`, `cls`, `Transformer/posembed_input/pos_embedding`,
`Transformer/encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1,
MlpBlock_0}`,
`Transformer/encoder_norm`, optional `pre_logits`, `head`, and for hybrids the ResNet stem's
`conv_root`, `gn_root`, `block{i}/unit{j}/...`. Other `posemb` kinds (`positions`) replace
`pos_embedding` with theirs, or with none. With `scan_layers=True` the blocks are instead
one `Transformer/encoderblock` whose every leaf has a leading layer axis (see `Encoder`).
Every parameter names its dimensions (`sharding.with_axes`: 'embed' D, 'heads' N, 'head_dim' K,
'mlp' M, ...) for vit_jax.sharding's rules; parameter trees stay plain arrays.

`VisionTransformer.__call__` runs the stages `embed_patches`, `add_class_token`, `encode` and
`pool_and_classify`. Each declares its parameters under the names above, whichever compact
method calls it, so that a subclass (vit_jax.tasks.mpp.MaskedPatchViT) recombines them in its
own `__call__` without changing the layout. `VisionTransformer.intermediates` runs them too,
keeping the outputs of chosen blocks (`Intermediates`).
"""
from typing import Any, Optional, Sequence

from flax import struct
import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from vit_jax.models import attention
from vit_jax.models import blank
from vit_jax.models import encoder
from vit_jax.models import positions
from vit_jax.models import resnet
from vit_jax.sharding import with_axes


Dtype = Any

CLASSIFIERS = ('token', 'gap', 'unpooled', 'token_unpooled')
TOKEN_CLASSIFIERS = ('token', 'token_unpooled')  # Those that put a class token first.
NOT_DYNAMIC = ("dynamic_img_size=True does not work with posemb='relative': its 1-D offsets "
               'over the raster have no meaning on a grid of another width; resize the images '
               'to the size the model was trained at.')


def reshape_rows(x: jax.Array, *shape: int) -> jax.Array:
  """(B, ...) -> (B, *shape), the batch axis keeping its sharding: on a mesh of Explicit axes
  (jax.make_mesh's default) jax needs the sharding of a reshape's output stated."""
  sharding = jax.typeof(x).sharding
  return jnp.reshape(x, (x.shape[0], *shape),
                     out_sharding=sharding.update(spec=P(sharding.spec[0])))


class PatchEmbedding(nn.Module):
  """Cuts (B, H, W, C) into PxP patches and projects each linearly: -> (B, H/P, W/P, D).

  Its `kernel` (P, P, C, D) and `bias` (D,) are those of a convolution with kernel = stride = P,
  computed as one matrix product over the flattened patches (Eq. 1's E).
  """
  hidden_size: int
  patch_size: tuple[int, int]
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    b, h, w, c = x.shape
    ph, pw = self.patch_size
    kernel = self.param(
        'kernel', with_axes(nn.initializers.lecun_normal(), 'conv_height', 'conv_width', 'conv_in',
                            'embed'), (ph, pw, c, self.hidden_size))
    bias = self.param('bias', with_axes(nn.initializers.zeros, 'embed'), (self.hidden_size,))
    patches = reshape_rows(x, h // ph, ph, w // pw, pw, c).transpose(0, 1, 3, 2, 4, 5)
    patches = reshape_rows(patches, h // ph, w // pw, ph * pw * c).astype(self.dtype)
    kernel = kernel.reshape(ph * pw * c, self.hidden_size).astype(self.dtype)
    return patches @ kernel + bias.astype(self.dtype)


@struct.dataclass
class Intermediates:
  """What `VisionTransformer.intermediates` returns, its arrays float32; a pytree whose
  `blocks` are static (they stay ints under jax.jit).

  Attributes:
    blocks: the chosen blocks, 0-based, in the order asked.
    tokens: per chosen block its output tokens (B, T, D) (the class token first where the model
      has one), or with `maps` its patch tokens as a map (B, rows, columns, D).
    class_tokens: with `maps`, per chosen block its class token (B, D); None without `maps` or
      without a class token.
    features: the features the head sees, (B, representation_size or D) (per token for the
      unpooled classifiers), as `VisionTransformer.features` gives them.
  """
  blocks: tuple[int, ...] = struct.field(pytree_node=False)
  tokens: tuple[jax.Array, ...]
  class_tokens: Optional[tuple[jax.Array, ...]]
  features: jax.Array


def block_indices(blocks: Sequence[int], num_layers: int) -> tuple[int, ...]:
  """`blocks` as 0-based indices of `num_layers` blocks (-1 the last); a ValueError naming the
  range for one out of it."""
  blocks = tuple(int(i) for i in blocks)
  if outside := [i for i in blocks if not -num_layers <= i < num_layers]:
    raise ValueError(f'blocks={blocks}: {outside[0]} is out of range; the model has {num_layers} '
                     f'blocks, 0 to {num_layers - 1} (or -{num_layers} to -1 from the last).')
  return tuple(i % num_layers for i in blocks)


class VisionTransformer(nn.Module):
  """ViT: (B, H, W, 3) images in [-1, 1] -> logits.

  Logits are (B, num_classes) for the `token` and `gap` classifiers, and per token,
  (B, T, num_classes), for `unpooled` (patch tokens) and `token_unpooled` (class token first).
  `dtype` is the computation dtype; parameters are always float32.
  """
  num_classes: int
  patch_size: tuple[int, int]
  hidden_size: int
  mlp_dim: int
  num_heads: int
  num_layers: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  classifier: str = 'token'
  representation_size: Optional[int] = None
  resnet_layers: Optional[Sequence[int]] = None  # None: no ResNet stem; (): root block only.
  resnet_width_factor: float = 1
  head_bias_init: float = 0.0
  approximate_gelu: bool = True
  dtype: Dtype = jnp.float32
  scan_layers: bool = False  # The blocks as one nn.scan; parameters at Transformer/encoderblock.
  remat_policy: Optional[str] = None  # A REMAT_POLICIES name: rematerialise each block.
  # 'cudnn': cuDNN's fused attention where it fits; 'splash': the Pallas TPU kernel.
  attention: str = 'xla'
  # Training: drop rate of the residual branches per example (stochastic depth); 0: off.
  stochastic_depth: float = 0.0
  # 'linear': rising from 0 at the first block to stochastic_depth at the last; or 'uniform'.
  stochastic_depth_schedule: str = 'linear'
  posemb: str = 'learned_1d'  # How positions enter: one of positions.POSEMB_KINDS.
  # Apply time (timm's dynamic_img_size; off in training): images of any size multiple of the
  # patch, the learned position parameters interpolated to their grid (`any_size`).
  dynamic_img_size: bool = False
  # With dynamic_img_size: the (rows, columns) learned_1d's embeddings were made for; None: square.
  posemb_grid: Optional[tuple[int, int]] = None

  def check_images(self, images):
    """Raises a ValueError, naming the sizes, for images the model cannot cut into patches."""
    if self.classifier not in CLASSIFIERS:
      raise ValueError(f'classifier={self.classifier!r}; choose one of {CLASSIFIERS}.')
    if self.attention not in attention.ATTENTION_KERNELS:
      raise ValueError(f'attention={self.attention!r}; choose one of {attention.ATTENTION_KERNELS} '
                       "(models.attention.resolve_attention turns 'auto' into one for the "
                       'devices).')
    if error := encoder.stochastic_depth_error(self.stochastic_depth,
                                               self.stochastic_depth_schedule):
      raise ValueError(error)
    positions.check_posemb(self.posemb, self.hidden_size)
    if self.dynamic_img_size and self.posemb == 'relative':
      raise ValueError(NOT_DYNAMIC)
    if images.ndim != 4:
      raise ValueError(f'Expected NHWC images of rank 4, got shape {images.shape}.')
    if not jnp.issubdtype(images.dtype, jnp.floating):
      raise ValueError(f'Expected float images with values in [-1, 1], got {images.dtype}: '
                       'scale them first, e.g. images / 127.5 - 1 for uint8 pixels.')
    stride = self.stem_stride
    ph, pw = self.patch_pixels
    _, h, w, _ = images.shape
    if h % ph or w % pw:
      raise ValueError(
          f'Image size {h}x{w} is not divisible by the patch size {ph}x{pw}'
          + (f' (patches {self.patch_size} on a stem of stride {stride})' if stride > 1 else '')
          + f'. Resize the images to a multiple of it, e.g. {h // ph * ph or ph}x'
          f'{w // pw * pw or pw}.')

  @property
  def stem_stride(self) -> int:
    """Input pixels per position of the map that is cut into patches (1 without a stem)."""
    return 1 if self.resnet_layers is None else resnet.stem_stride(self.resnet_layers)

  @property
  def patch_pixels(self) -> tuple[int, int]:
    """Input pixels (height, width) one patch covers: the patch size times the stem's stride."""
    return self.patch_size[0] * self.stem_stride, self.patch_size[1] * self.stem_stride

  @property
  def has_class_token(self) -> bool:
    """Whether a class token precedes the patch tokens (classifiers 'token', 'token_unpooled')."""
    return self.classifier in TOKEN_CLASSIFIERS

  def grid(self, image_size: int | tuple[int, int]) -> tuple[int, int]:
    """The (rows, columns) of patches of an image of `image_size` pixels: an int for a square
    image, or (height, width)."""
    h, w = blank.image_hw(image_size)
    ph, pw = self.patch_pixels
    return h // ph, w // pw

  def any_size(self, trained_size: int | tuple[int, int]) -> 'VisionTransformer':
    """This model applied to images of any size (a multiple of the patch), its parameters those
    of images of `trained_size` pixels (an int for square, or (height, width)): with
    `dynamic_img_size`, learned position parameters are interpolated to each image's grid
    (bilinear, corners aligned, as `finetune.load_pretrained` resizes them at load), and used as
    they are at `trained_size`. A ValueError (NOT_DYNAMIC) for posemb='relative'."""
    if self.posemb == 'relative':
      raise ValueError(NOT_DYNAMIC)
    return self.clone(dynamic_img_size=True, posemb_grid=self.grid(trained_size))

  def features(self, images, *, train=False):
    """The representation the head sees, as float32: (B, representation_size or hidden_size).

    The encoder-norm output of the class token (`token`) or the mean of the tokens (`gap`), through
    `pre_logits` when the model has one; per token, (B, T, ...), for the unpooled classifiers.
    Call it as `model.apply({'params': params}, images, method='features')`: the head's parameters
    go unused, so a model with any number of classes gives the same features.
    """
    return self(images, train=train, head=False)

  def embed_patches(self, images) -> tuple[jax.Array, tuple[int, int]]:
    """(B, H, W, 3) images -> (their patch embeddings (B, N, D), N = rows * columns in row-major
    order, the grid (rows, columns)), through the ResNet stem first for hybrids. A stage of a
    compact method: it declares `embedding` and the stem's parameters."""
    self.check_images(images)
    x = images
    if self.resnet_layers is not None:
      x = resnet.resnet_stem(x, self.resnet_layers, self.resnet_width_factor, self.dtype)
    x = PatchEmbedding(hidden_size=self.hidden_size, patch_size=self.patch_size, dtype=self.dtype,
                       name='embedding')(x)
    b, h, w, d = x.shape
    return reshape_rows(x, h * w, d), (h, w)

  def add_class_token(self, patches: jax.Array) -> jax.Array:
    """(B, N, D) patch embeddings -> the (B, T, D) tokens the encoder takes: the learned `cls`
    first (T = N + 1) where the classifier has a class token, else the patches (T = N)."""
    if not self.has_class_token:
      return patches
    b, _, d = patches.shape
    cls = self.param('cls', with_axes(nn.initializers.zeros, None, None, 'embed'), (1, 1, d))
    cls = jnp.broadcast_to(cls.astype(patches.dtype), (b, 1, d),
                           out_sharding=jax.typeof(patches).sharding)
    return jnp.concatenate([cls, patches], axis=1)

  def encode(self, tokens: jax.Array, grid: tuple[int, int], *, train: bool,
             keep: Optional[Sequence[int]] = None):
    """(B, T, D) tokens of patches on `grid` -> the encoder's outputs (B, T, D), after its final
    LayerNorm; with `keep` (0-based block indices), (those, the tuple of the outputs (B, T, D) of
    the blocks `keep`). Declares `Transformer`."""
    return encoder.Encoder(
        num_layers=self.num_layers, mlp_dim=self.mlp_dim, num_heads=self.num_heads,
        dropout_rate=self.dropout_rate, attention_dropout_rate=self.attention_dropout_rate,
        approximate_gelu=self.approximate_gelu, dtype=self.dtype, scan_layers=self.scan_layers,
        remat_policy=self.remat_policy, attention=self.attention,
        stochastic_depth=self.stochastic_depth,
        stochastic_depth_schedule=self.stochastic_depth_schedule, posemb=self.posemb,
        dynamic_img_size=self.dynamic_img_size, posemb_grid=self.posemb_grid,
        name='Transformer')(tokens, train=train, grid=grid, keep=keep)

  def pool_and_classify(self, tokens: jax.Array, *, head: bool = True) -> jax.Array:
    """(B, T, D) encoder outputs -> float32 logits, pooled as the classifier says (the class
    token, the mean, or none), through `pre_logits` where the model has one and `head`; with
    `head=False`, the features before `head`."""
    x = tokens
    if self.classifier == 'token':
      x = x[:, 0]
    elif self.classifier == 'gap':
      x = jnp.mean(x, axis=1)

    feature_axis = 'embed'
    if self.representation_size is not None:
      x = jnp.tanh(nn.Dense(
          self.representation_size, dtype=self.dtype, name='pre_logits',
          kernel_init=with_axes(nn.initializers.lecun_normal(), 'embed', 'repr'),
          bias_init=with_axes(nn.initializers.zeros, 'repr'))(x))
      feature_axis = 'repr'
    if not head:
      return x.astype(jnp.float32)
    logits = nn.Dense(self.num_classes, dtype=self.dtype, name='head',
                      kernel_init=with_axes(nn.initializers.zeros, feature_axis, 'classes'),
                      bias_init=with_axes(nn.initializers.constant(self.head_bias_init),
                                          'classes'))(x)
    return logits.astype(jnp.float32)

  @nn.compact
  def __call__(self, images, *, train, head=True):
    """Logits, or with `head=False` the `features` they are computed from: the stages
    `embed_patches`, `add_class_token`, `encode` and `pool_and_classify`, which subclasses
    (vit_jax.tasks.mpp.MaskedPatchViT) recombine."""
    patches, grid = self.embed_patches(images)
    tokens = self.encode(self.add_class_token(patches), grid, train=train)
    return self.pool_and_classify(tokens, head=head)

  # Compact, as __call__ is: its stages declare submodules, which Flax allows in compact methods
  # only; they build them under the same names, so that both read the same parameters.
  @nn.compact
  def intermediates(self, images, *, blocks: Sequence[int], maps: bool = False,
                    train: bool = False) -> Intermediates:
    """The outputs of the blocks `blocks` and the features, as float32 `Intermediates`.

    Call it as `model.apply({'params': params}, images, method='intermediates', blocks=(3, -1))`.
    `blocks` are 0-based, negative ones counting from the last (-1); others are a ValueError
    naming the range. Per chosen block, its output tokens (B, T, D), before the final
    LayerNorm; with `maps`, the patch tokens as a (B, rows, columns, D) map of the patch grid,
    and the class token (B, D) apart. `features` is what `features` gives: the pooled encoder
    output the head sees.
    """
    chosen = block_indices(blocks, self.num_layers)
    patches, grid = self.embed_patches(images)
    normed, outputs = self.encode(self.add_class_token(patches), grid, train=train, keep=chosen)
    outputs = tuple(x.astype(jnp.float32) for x in outputs)
    features = self.pool_and_classify(normed, head=False)
    if not maps:
      return Intermediates(chosen, outputs, None, features)
    extra = int(self.has_class_token)
    token_maps = tuple(reshape_rows(x[:, extra:], *grid, x.shape[-1]) for x in outputs)
    class_tokens = tuple(x[:, 0] for x in outputs) if extra else None
    return Intermediates(chosen, token_maps, class_tokens, features)


"""The Vision Transformer (Dosovitskiy et al., ICLR 2021) as Flax linen modules.

Shapes: B batch, H/W image height/width in pixels, P patch size, T tokens, D hidden size,
N heads, K = D/N head size, M MLP size. Images are NHWC floats in [-1, 1].

The parameter tree is the one of the published checkpoints:
`embedding`, `cls`, `Transformer/posembed_input/pos_embedding`,
`Transformer/encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1, MlpBlock_0}`,
`Transformer/encoder_norm`, optional `pre_logits`, `head`, and for hybrids the ResNet stem's
`conv_root`, `gn_root`, `block{i}/unit{j}/...`. With `scan_layers=True` the blocks are instead
one `Transformer/encoderblock` whose every leaf has a leading layer axis (see `Encoder`).
"""
import math
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax import models_resnet

Dtype = Any
CLASSIFIERS = ('token', 'gap', 'unpooled', 'token_unpooled')
REMAT_POLICIES = ('nothing_saveable', 'dots_saveable', 'dots_with_no_batch_dims_saveable',
                  'everything_saveable')
LAYERNORM_EPS = 1e-6


def _layer_norm(dtype, name=None):
  return nn.LayerNorm(epsilon=LAYERNORM_EPS, dtype=dtype, name=name)


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
    kernel = self.param('kernel', nn.initializers.lecun_normal(), (ph, pw, c, self.hidden_size))
    bias = self.param('bias', nn.initializers.zeros, (self.hidden_size,))
    patches = x.reshape(b, h // ph, ph, w // pw, pw, c).transpose(0, 1, 3, 2, 4, 5)
    patches = patches.reshape(b, h // ph, w // pw, ph * pw * c).astype(self.dtype)
    kernel = kernel.reshape(ph * pw * c, self.hidden_size).astype(self.dtype)
    return patches @ kernel + bias.astype(self.dtype)


class AddPositionEmbs(nn.Module):
  """Adds learned 1-D position embeddings `pos_embedding` (1, T, D) to (B, T, D) inputs."""
  posemb_init: Callable = nn.initializers.normal(stddev=0.02)

  @nn.compact
  def __call__(self, x):
    expected = (1, x.shape[1], x.shape[2])
    if self.has_variable('params', 'pos_embedding'):
      found = self.get_variable('params', 'pos_embedding').shape
      if tuple(found) != expected:
        raise ValueError(
            f'The image gives {x.shape[1]} tokens but the position embeddings '
            f'(Transformer/posembed_input/pos_embedding) have shape {tuple(found)}, '
            f'not {expected}. Resize the images to the resolution the model was built for, '
            'or resize the position embeddings (vit_jax.checkpoint.load_pretrained does it).')
    posemb = self.param('pos_embedding', self.posemb_init, expected)
    return x + posemb.astype(x.dtype)


class MlpBlock(nn.Module):
  """Dense(M), GELU, dropout, Dense(D), dropout: (B, T, D) -> (B, T, D)."""
  mlp_dim: int
  dropout_rate: float = 0.0
  approximate_gelu: bool = True
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, deterministic):
    dense = lambda features: nn.Dense(
        features, dtype=self.dtype, kernel_init=nn.initializers.xavier_uniform(),
        bias_init=nn.initializers.normal(stddev=1e-6))
    y = nn.gelu(dense(self.mlp_dim)(x), approximate=self.approximate_gelu)
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    y = dense(x.shape[-1])(y)
    return nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)


class DenseGeneralParams(nn.Module):
  """Declares the `kernel` and `bias` of a flax DenseGeneral and returns them unapplied.

  Lets the attention keep its kernels under their published names and still choose the
  products (and their output layouts) itself. The kernel is Xavier-uniform initialised over its
  flattened (inputs, outputs) shape, as DenseGeneral does.
  """
  in_shape: tuple[int, ...]
  out_shape: tuple[int, ...]

  @nn.compact
  def __call__(self):
    flat_shape = (math.prod(self.in_shape), math.prod(self.out_shape))
    init = lambda key, shape: nn.initializers.xavier_uniform()(key, flat_shape).reshape(shape)
    kernel = self.param('kernel', init, self.in_shape + self.out_shape)
    return kernel, self.param('bias', nn.initializers.zeros, self.out_shape)


def _cudnn_attention(dtype, head_size: int, seq_len: int, training: bool) -> bool:
  """Whether jax.nn.dot_product_attention can run cuDNN's fused attention on these inputs:
  on a GPU, in 16-bit floats, with a head size that is a multiple of 8 up to 128, and, when
  training, an even sequence length (jax 0.10.2's cuDNN gradient rejects odd ones, such as
  the 197 tokens of a class token and 14x14 patches)."""
  return (jax.default_backend() == 'gpu' and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
          and head_size % 8 == 0 and head_size <= 128 and not (training and seq_len % 2))


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head self-attention (Eq. 2's MSA): (B, T, D) -> (B, T, D).

  Parameters as in flax: `query|key|value/kernel` (D, N, K), `.../bias` (N, K),
  `out/kernel` (N, K, D), `out/bias` (D,). The projections give heads-major (B, N, T, K) values
  directly, so that both attention products are batched over leading (B, N) without transposes
  (what XLA's CPU backend runs fastest), and the query is scaled by 1/sqrt(K) before the
  logits, inside the bias add. On a GPU in 16-bit floats the attention is cuDNN's fused
  kernel, through jax.nn.dot_product_attention, where `_cudnn_attention` allows. When the
  caller makes `intermediates` mutable, the attention weights (B, N, T, T) are sown as
  `attention_weights` (used by the visualisations).
  """
  num_heads: int
  dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, deterministic):
    d = x.shape[-1]
    if d % self.num_heads:
      raise ValueError(f'hidden_size {d} is not divisible by num_heads {self.num_heads}.')
    n, k = self.num_heads, d // self.num_heads
    x = x.astype(self.dtype)

    def project(name):
      kernel, bias = DenseGeneralParams((d,), (n, k), name=name)()
      return (jnp.einsum('btd,dnk->bntk', x, kernel.astype(self.dtype))
              + bias.astype(self.dtype)[:, None])

    q = project('query') * jnp.asarray(1 / math.sqrt(k), self.dtype)
    key, value = project('key'), project('value')  # q, key, value: (B, N, T, K).

    use_dropout = self.dropout_rate > 0 and not deterministic
    if (use_dropout or self.is_mutable_collection('intermediates')
        or not _cudnn_attention(self.dtype, k, x.shape[1], training=not deterministic)):
      logits = jnp.einsum('bnqk,bntk->bnqt', q, key)
      weights = jax.nn.softmax(logits.astype(jnp.float32)).astype(self.dtype)
      self.sow('intermediates', 'attention_weights', weights)
      weights = nn.Dropout(self.dropout_rate)(weights, deterministic=deterministic)
      y = jnp.einsum('bnqt,bntk->bnqk', weights, value)
    else:
      y = jax.nn.dot_product_attention(
          *(a.swapaxes(1, 2) for a in (q, key, value)), scale=1.0,
          implementation='cudnn').swapaxes(1, 2)

    out_kernel, out_bias = DenseGeneralParams((n, k), (d,), name='out')()
    return jnp.einsum('bnqk,nkd->bqd', y, out_kernel.astype(self.dtype)) + out_bias.astype(
        self.dtype)


class Encoder1DBlock(nn.Module):
  """One pre-LayerNorm Transformer block, Eq. (2) and (3): (B, T, D) -> (B, T, D)."""
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  approximate_gelu: bool = True
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, inputs, deterministic):
    x = _layer_norm(self.dtype)(inputs)
    x = MultiHeadDotProductAttention(
        self.num_heads, self.attention_dropout_rate, self.dtype)(x, deterministic=deterministic)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    x = x + inputs
    y = _layer_norm(self.dtype)(x)
    y = MlpBlock(self.mlp_dim, self.dropout_rate, self.approximate_gelu, self.dtype)(
        y, deterministic=deterministic)
    return x + y


class _ScanStep(Encoder1DBlock):
  """Encoder1DBlock as the body of `nn.scan`: (x, deterministic) -> (x, None), same parameters."""

  def __call__(self, inputs, deterministic):
    return super().__call__(inputs, deterministic), None


def checkpoint_policy(name: str) -> Callable[..., bool]:
  """The `jax.checkpoint_policies` member `name`: which of a block's values the backward pass
  keeps instead of recomputing ('nothing_saveable' keeps only the block's input)."""
  if name not in REMAT_POLICIES:
    raise ValueError(f'remat_policy={name!r}; choose one of {REMAT_POLICIES}, or None for no '
                     'rematerialisation.')
  return getattr(jax.checkpoint_policies, name)


class Encoder(nn.Module):
  """Position embeddings, dropout, `num_layers` blocks and the final LayerNorm: (B,T,D) -> (B,T,D).

  `scan_layers` runs the blocks as one `nn.scan`, so that compilation does not grow with depth;
  their parameters are then those of one block, `encoderblock`, with a leading axis of size
  num_layers on every leaf (vit_jax.checkpoint.scan_blocks / unscan_blocks convert), and sown
  attention weights are stacked likewise: `encoderblock/.../attention_weights` is
  ((L, B, N, T, T),). `remat_policy` (a name of REMAT_POLICIES) rematerialises each block under
  that `jax.checkpoint` policy: the backward pass recomputes what the policy does not save.
  On XLA:CPU only scanned blocks gain from it: the CPU compiler drops the optimisation barriers
  that keep unscanned recomputations apart and merges them back into the forward pass.
  """
  num_layers: int
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  approximate_gelu: bool = True
  dtype: Dtype = jnp.float32
  scan_layers: bool = False
  remat_policy: Optional[str] = None

  def remat(self, block_class):
    """`block_class`, rematerialised under `remat_policy` when one is set."""
    if self.remat_policy is None:
      return block_class
    # In scan's loop XLA cannot fold the recomputation back into the forward pass: no CSE guard.
    return nn.remat(block_class, policy=checkpoint_policy(self.remat_policy),
                    prevent_cse=not self.scan_layers, static_argnums=(2,))

  @nn.compact
  def __call__(self, x, *, train):
    x = AddPositionEmbs(name='posembed_input')(x)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
    block_fields = (self.mlp_dim, self.num_heads, self.dropout_rate, self.attention_dropout_rate,
                    self.approximate_gelu, self.dtype)
    if self.scan_layers:
      blocks = nn.scan(self.remat(_ScanStep), variable_axes={'params': 0, 'intermediates': 0},
                       split_rngs={'params': True, 'dropout': True}, in_axes=nn.broadcast,
                       length=self.num_layers)
      x, _ = blocks(*block_fields, name='encoderblock')(x, not train)
    else:
      block = self.remat(Encoder1DBlock)
      for i in range(self.num_layers):
        x = block(*block_fields, name=f'encoderblock_{i}')(x, not train)
    return _layer_norm(self.dtype, name='encoder_norm')(x)


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

  def check_images(self, images):
    """Raises a ValueError, naming the sizes, for images the model cannot cut into patches."""
    if self.classifier not in CLASSIFIERS:
      raise ValueError(f'classifier={self.classifier!r}; choose one of {CLASSIFIERS}.')
    if images.ndim != 4:
      raise ValueError(f'Expected NHWC images of rank 4, got shape {images.shape}.')
    stride = self.stem_stride
    ph, pw = self.patch_size[0] * stride, self.patch_size[1] * stride
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
    return 1 if self.resnet_layers is None else models_resnet.stem_stride(self.resnet_layers)

  def features(self, images, *, train=False):
    """The representation the head sees, as float32: (B, representation_size or hidden_size).

    The encoder-norm output of the class token (`token`) or the mean of the tokens (`gap`), through
    `pre_logits` when the model has one; per token, (B, T, ...), for the unpooled classifiers.
    Call it as `model.apply({'params': params}, images, method='features')`: the head's parameters
    go unused, so a model with any number of classes gives the same features.
    """
    return self(images, train=train, head=False)

  @nn.compact
  def __call__(self, images, *, train, head=True):
    """Logits, or with `head=False` the `features` they are computed from."""
    self.check_images(images)
    x = images
    if self.resnet_layers is not None:
      x = models_resnet.resnet_stem(x, self.resnet_layers, self.resnet_width_factor, self.dtype)
    x = PatchEmbedding(self.hidden_size, self.patch_size, self.dtype, name='embedding')(x)
    b, h, w, d = x.shape
    x = x.reshape(b, h * w, d)

    if self.classifier in ('token', 'token_unpooled'):
      cls = self.param('cls', nn.initializers.zeros, (1, 1, d))
      x = jnp.concatenate([jnp.broadcast_to(cls.astype(x.dtype), (b, 1, d)), x], axis=1)

    x = Encoder(self.num_layers, self.mlp_dim, self.num_heads, self.dropout_rate,
                self.attention_dropout_rate, self.approximate_gelu, self.dtype,
                self.scan_layers, self.remat_policy, name='Transformer')(x, train=train)

    if self.classifier == 'token':
      x = x[:, 0]
    elif self.classifier == 'gap':
      x = jnp.mean(x, axis=1)

    if self.representation_size is not None:
      x = jnp.tanh(nn.Dense(self.representation_size, dtype=self.dtype, name='pre_logits')(x))
    if not head:
      return x.astype(jnp.float32)
    logits = nn.Dense(self.num_classes, dtype=self.dtype, name='head',
                      kernel_init=nn.initializers.zeros,
                      bias_init=nn.initializers.constant(self.head_bias_init))(x)
    return logits.astype(jnp.float32)

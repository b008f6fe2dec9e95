"""The Vision Transformer (Dosovitskiy et al., ICLR 2021) as Flax linen modules.

Shapes: B batch, H/W image height/width in pixels, P patch size, T tokens, D hidden size,
N heads, K = D/N head size, M MLP size. Images are NHWC floats in [-1, 1].

The parameter tree is the one of the published checkpoints:
`embedding`, `cls`, `Transformer/posembed_input/pos_embedding`,
`Transformer/encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_0, LayerNorm_1,
MlpBlock_0}`,
`Transformer/encoder_norm`, optional `pre_logits`, `head`, and for hybrids the ResNet stem's
`conv_root`, `gn_root`, `block{i}/unit{j}/...`. Other `posemb` kinds (vit_jax.positions) replace
`pos_embedding` with theirs, or with none. With `scan_layers=True` the blocks are instead
one `Transformer/encoderblock` whose every leaf has a leading layer axis (see `Encoder`).
Every parameter names its dimensions (`sharding.with_axes`: 'embed' D, 'heads' N, 'head_dim' K,
'mlp' M, ...) for vit_jax.sharding's rules; parameter trees stay plain arrays.
"""
import math
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from vit_jax.models import positions
from vit_jax.models import resnet
from vit_jax.sharding import with_axes

Dtype = Any
CLASSIFIERS = ('token', 'gap', 'unpooled', 'token_unpooled')
TOKEN_CLASSIFIERS = ('token', 'token_unpooled')  # Those that put a class token first.
REMAT_POLICIES = ('nothing_saveable', 'dots_saveable', 'dots_with_no_batch_dims_saveable',
                  'everything_saveable')
LAYERNORM_EPS = 1e-6
ATTENTION_KERNELS = ('xla', 'cudnn', 'splash')
# Training pads the tokens to a multiple of this for cuDNN's fused attention, whose gradient
# (jax 0.10.2) rejects odd sequence lengths such as 197 (a class token and 14x14 patches).
CUDNN_TRAIN_SEQ_MULTIPLE = 16
# The splash kernel's tiles of queries and keys (its default BlockSizes); the tokens are padded
# to a multiple of them (its key tiles must be multiples of the TPU's 128 vector lanes).
SPLASH_BLOCK = 128
TOKENS = ('batch', 'seq', 'embed')  # Logical axes of the (B, T, D) activations between blocks.
STOCHASTIC_DEPTH_SCHEDULES = ('linear', 'uniform')


def _layer_norm(dtype, name=None):
  return nn.LayerNorm(epsilon=LAYERNORM_EPS, dtype=dtype, name=name,
                      scale_init=with_axes(nn.initializers.ones, 'embed'),
                      bias_init=with_axes(nn.initializers.zeros, 'embed'))


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
    posemb = self.param('pos_embedding', with_axes(self.posemb_init, None, 'seq', 'embed'),
                        expected)
    return x + posemb.astype(x.dtype)


class MlpBlock(nn.Module):
  """Dense(M), GELU, dropout, Dense(D), dropout: (B, T, D) -> (B, T, D)."""
  mlp_dim: int
  dropout_rate: float = 0.0
  approximate_gelu: bool = True
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x, *, deterministic):
    dense = lambda features, axes: nn.Dense(
        features, dtype=self.dtype, kernel_init=with_axes(nn.initializers.xavier_uniform(), *axes),
        bias_init=with_axes(nn.initializers.normal(stddev=1e-6), axes[1]))
    y = nn.gelu(dense(self.mlp_dim, ('embed', 'mlp'))(x), approximate=self.approximate_gelu)
    y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
    y = dense(x.shape[-1], ('mlp', 'embed'))(y)
    return nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)


class DenseGeneralParams(nn.Module):
  """Declares the `kernel` and `bias` of a flax DenseGeneral and returns them unapplied.

  Lets the attention keep its kernels under their published names and still choose the
  products (and their output layouts) itself. The kernel is Xavier-uniform initialised over its
  flattened (inputs, outputs) shape, as DenseGeneral does. `in_axes` and `out_axes` are the
  logical names of the input and output dimensions.
  """
  in_shape: tuple[int, ...]
  out_shape: tuple[int, ...]
  in_axes: tuple[str, ...]
  out_axes: tuple[str, ...]

  @nn.compact
  def __call__(self):
    flat_shape = (math.prod(self.in_shape), math.prod(self.out_shape))
    init = lambda key, shape: nn.initializers.xavier_uniform()(key, flat_shape).reshape(shape)
    kernel = self.param('kernel', with_axes(init, *self.in_axes, *self.out_axes),
                        self.in_shape + self.out_shape)
    return kernel, self.param('bias', with_axes(nn.initializers.zeros, *self.out_axes),
                              self.out_shape)


def attention_error(attention: str, platform: str) -> Optional[str]:
  """Why `attention` cannot run on devices of `platform` ('cpu', 'gpu', 'tpu'), or None where
  it can: 'splash' is a Pallas kernel for TPUs only."""
  if attention == 'splash' and platform != 'tpu':
    return (f"attention='splash' is a TPU kernel, and these are {platform.upper()} devices: "
            "choose 'auto' or 'xla'.")
  return None


def resolve_attention(attention: str, devices) -> str:
  """The attention kernel for a model run on `devices`: 'auto' is 'cudnn' on NVIDIA GPUs and
  'xla' elsewhere (also on TPUs: 'splash' replaces it there only once a TPU measures it
  faster); the others stay as they are. A ValueError (`attention_error`) for a kernel the
  devices cannot run."""
  device = devices[0]
  if error := attention_error(attention, device.platform):
    raise ValueError(error)
  if attention != 'auto':
    return attention
  return 'cudnn' if device.platform == 'gpu' and 'NVIDIA' in device.device_kind else 'xla'


def cudnn_fits(dtype, head_size: int) -> bool:
  """Whether cuDNN's fused attention takes heads of `head_size` in `dtype`: 16-bit floats, and a
  head size that is a multiple of 8 up to 128."""
  return (jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_size % 8 == 0
          and head_size <= 128)


def padded_attention(q, k, v, multiple: int, implementation: str = 'cudnn'):
  """softmax(q k^T) v of heads-major (B, N, T, K) inputs, q already scaled, through
  jax.nn.dot_product_attention's `implementation`: T is padded with zeros up to a multiple of
  `multiple`, the padded keys are masked out (as past the sequence length) and the padded
  queries dropped from the (B, N, T, K) result."""
  b, _, t, _ = q.shape
  padded = -(-t // multiple) * multiple
  lengths = jnp.full((b,), t, jnp.int32) if padded > t else None
  to_btnk = lambda a: jnp.pad(a.swapaxes(1, 2), ((0, 0), (0, padded - t), (0, 0), (0, 0)))
  y = jax.nn.dot_product_attention(
      to_btnk(q), to_btnk(k), to_btnk(v), scale=1.0, query_seq_lengths=lengths,
      key_value_seq_lengths=lengths, implementation=implementation)
  return y[:, :t].swapaxes(1, 2)


def splash_attention(q, k, v, interpret: bool = False):
  """softmax(q k^T) v of heads-major (B, N, T, K) inputs, q already scaled, through the Pallas
  TPU splash kernel: T is padded with zeros up to a multiple of SPLASH_BLOCK, the padded keys
  are masked out by the kernel's static mask (whose fully masked tiles it skips), and the padded
  queries dropped from the (B, N, T, K) result. Under a mesh (the train step's) the kernel runs
  per device in a shard_map: batch over 'data', heads over 'model' where they divide.
  `interpret` runs the kernel in Pallas's interpreter, on any device (to check its results)."""
  # Here, not at the top: Pallas's TPU modules take about half a second to import.
  from jax.experimental.pallas.ops.tpu import splash_attention as splash
  b, n, t, _ = q.shape
  padded = -(-t // SPLASH_BLOCK) * SPLASH_BLOCK
  keys = np.broadcast_to(np.arange(padded) < t, (padded, padded))

  def per_device(q, k, v):  # (B', N', padded, K) each: a device's share of batch and heads.
    mask = splash.MultiHeadMask([splash.NumpyMask(keys)] * q.shape[1])
    return jax.vmap(splash.make_splash_mha_single_device(mask, interpret=interpret))(q, k, v)

  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    spec = P(*(axis if mesh.shape.get(axis, 1) > 1 and size % mesh.shape[axis] == 0 else None
               for axis, size in (('data', b), ('model', n))))
    # check_vma=False: the kernel's outputs do not say how they vary over the mesh.
    per_device = jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec,
                               check_vma=False)
  pad = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, padded - t), (0, 0)))
  return per_device(pad(q), pad(k), pad(v))[:, :, :t]


class MultiHeadDotProductAttention(nn.Module):
  """Multi-head self-attention (Eq. 2's MSA): (B, T, D) -> (B, T, D).

  Parameters as in flax: `query|key|value/kernel` (D, N, K), `.../bias` (N, K),
  `out/kernel` (N, K, D), `out/bias` (D,). The projections give heads-major (B, N, T, K) values
  directly, so that both attention products are batched over leading (B, N) without transposes
  (what XLA's CPU backend runs fastest), and the query is scaled by 1/sqrt(K) before the
  logits, inside the bias add. With `attention='cudnn'` the attention is cuDNN's fused kernel
  where `cudnn_fits` allows, through `padded_attention` (in training, on tokens padded to a
  multiple of CUDNN_TRAIN_SEQ_MULTIPLE); with `attention='splash'` it is the Pallas TPU
  splash kernel (`splash_attention`, tokens padded to SPLASH_BLOCK) where the model is applied
  under a mesh (the train step's, `sharding.with_rules`), which places the kernel on the
  devices: evaluation and inference, applied outside one, take XLA's path. Attention dropout,
  and the attention weights (B, N,
  T, T) sown as `attention_weights` when the caller makes `intermediates` mutable (for the
  visualisations), take XLA's path. With `relative_patches` P > 0 it is the relative attention
  of vit_jax.positions (on the last P tokens), its table `relative_embedding` (2P - 1, N, K),
  and always XLA's path: the logits bias it adds goes to no fused kernel here.
  """
  num_heads: int
  dropout_rate: float = 0.0
  dtype: Dtype = jnp.float32
  attention: str = 'xla'  # One of ATTENTION_KERNELS.
  relative_patches: int = 0  # posemb='relative': the number of patch tokens P; 0: off.

  @nn.compact
  def __call__(self, x, *, deterministic):
    d = x.shape[-1]
    if d % self.num_heads:
      raise ValueError(f'hidden_size {d} is not divisible by num_heads {self.num_heads}.')
    n, k = self.num_heads, d // self.num_heads
    x = x.astype(self.dtype)

    def project(name):
      kernel, bias = DenseGeneralParams((d,), (n, k), ('embed',), ('heads', 'head_dim'),
                                        name=name)()
      return (jnp.einsum('btd,dnk->bntk', x, kernel.astype(self.dtype))
              + bias.astype(self.dtype)[:, None])

    q = project('query') * jnp.asarray(1 / math.sqrt(k), self.dtype)
    key, value = project('key'), project('value')  # q, key, value: (B, N, T, K).

    use_dropout = self.dropout_rate > 0 and not deterministic
    relative = None if not self.relative_patches else positions.learned_table(
        self, positions.RELATIVE, (2 * self.relative_patches - 1, n, k), 'offset', 'heads',
        'head_dim')
    fused = not (self.attention == 'xla' or use_dropout or relative is not None
                 or self.is_mutable_collection('intermediates')
                 or (self.attention == 'cudnn' and not cudnn_fits(self.dtype, k))
                 or (self.attention == 'splash' and jax.sharding.get_abstract_mesh().empty))
    if not fused:
      logits = jnp.einsum('bnqk,bntk->bnqt', q, key)
      if relative is not None:
        logits = logits + positions.relative_logits(q, relative.astype(self.dtype))
      weights = jax.nn.softmax(logits.astype(jnp.float32)).astype(self.dtype)
      self.sow('intermediates', 'attention_weights', weights)
      weights = nn.Dropout(self.dropout_rate)(weights, deterministic=deterministic)
      y = jnp.einsum('bnqt,bntk->bnqk', weights, value)
    elif self.attention == 'splash':
      y = splash_attention(q, key, value)
    else:
      y = padded_attention(q, key, value, 1 if deterministic else CUDNN_TRAIN_SEQ_MULTIPLE)

    out_kernel, out_bias = DenseGeneralParams((n, k), (d,), ('heads', 'head_dim'), ('embed',),
                                              name='out')()
    return jnp.einsum('bnqk,nkd->bqd', y, out_kernel.astype(self.dtype)) + out_bias.astype(
        self.dtype)


def stochastic_depth_error(rate, schedule: str) -> Optional[str]:
  """Why (`stochastic_depth`, `stochastic_depth_schedule`) cannot work, or None where they can."""
  if not 0 <= rate <= 1:
    return f'stochastic_depth={rate!r} must be a drop rate in [0, 1], e.g. 0.1 (0: off).'
  if schedule not in STOCHASTIC_DEPTH_SCHEDULES:
    return (f'stochastic_depth_schedule={schedule!r}; choose one of '
            f'{STOCHASTIC_DEPTH_SCHEDULES}.')
  return None


def stochastic_depth_rates(rate: float, num_layers: int, schedule: str) -> tuple[float, ...]:
  """The drop rate of each of `num_layers` blocks: `rate` for every one ('uniform'), or rising
  linearly from 0 at the first block to `rate` at the last ('linear', as DeiT and timm)."""
  if schedule == 'uniform' or num_layers == 1:
    return (rate,) * num_layers
  return tuple(rate * i / (num_layers - 1) for i in range(num_layers))


def drop_path(branch, rate, rng):
  """Stochastic depth (Huang et al., 2016) of a residual branch (B, ...): each example's branch
  is zeroed with probability `rate` (a float or a traced scalar) and the others are scaled by
  1 / (1 - rate), so that its expected value is unchanged; at rate 1 all are zeroed."""
  keep_prob = 1 - jnp.asarray(rate, jnp.float32)
  keep = jax.random.bernoulli(rng, keep_prob, (branch.shape[0],) + (1,) * (branch.ndim - 1))
  scale = keep / jnp.maximum(keep_prob, jnp.finfo(jnp.float32).tiny)
  return branch * scale.astype(branch.dtype)


class Encoder1DBlock(nn.Module):
  """One pre-LayerNorm Transformer block, Eq. (2) and (3): (B, T, D) -> (B, T, D).

  `drop_rate` (a float or traced scalar; None: off) is the block's stochastic depth: the
  attention and MLP branches are each dropped per example (`drop_path`) in training.
  """
  mlp_dim: int
  num_heads: int
  dropout_rate: float = 0.0
  attention_dropout_rate: float = 0.0
  approximate_gelu: bool = True
  dtype: Dtype = jnp.float32
  attention: str = 'xla'
  relative_patches: int = 0  # See MultiHeadDotProductAttention.

  def drop_branch(self, branch, deterministic, drop_rate):
    """`branch` through `drop_path` in training with a `drop_rate`; as it is otherwise."""
    if deterministic or drop_rate is None:
      return branch
    return drop_path(branch, drop_rate, self.make_rng('dropout'))

  @nn.compact
  def __call__(self, inputs, deterministic, drop_rate=None):
    x = _layer_norm(self.dtype)(inputs)
    x = MultiHeadDotProductAttention(
        num_heads=self.num_heads, dropout_rate=self.attention_dropout_rate, dtype=self.dtype,
        attention=self.attention, relative_patches=self.relative_patches)(
            x, deterministic=deterministic)
    x = nn.Dropout(self.dropout_rate)(x, deterministic=deterministic)
    x = self.drop_branch(x, deterministic, drop_rate) + inputs
    y = _layer_norm(self.dtype)(x)
    y = MlpBlock(mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate,
                 approximate_gelu=self.approximate_gelu, dtype=self.dtype)(
                     y, deterministic=deterministic)
    return nn.with_logical_constraint(x + self.drop_branch(y, deterministic, drop_rate), TOKENS)


class _ScanStep(Encoder1DBlock):
  """Encoder1DBlock as the body of `nn.scan`: (x, deterministic, drop_rate) -> (x, None), same
  parameters; `drop_rate` is the layer's entry of the scanned (L,) rates, or None."""

  def __call__(self, inputs, deterministic, drop_rate=None):
    return super().__call__(inputs, deterministic, drop_rate), None


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
  In training, block i drops its branches at `stochastic_depth_rates(stochastic_depth, ...)[i]`;
  scanned blocks take their rate as a scanned input.
  `posemb` (vit_jax.positions) says how positions enter, for patches on a grid of (rows,
  columns) `grid`: at the input (`posembed_input`), or in each block's attention (relative).
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
  attention: str = 'xla'
  stochastic_depth: float = 0.0
  stochastic_depth_schedule: str = 'linear'
  posemb: str = 'learned_1d'

  def remat(self, block_class):
    """`block_class`, rematerialised under `remat_policy` when one is set."""
    if self.remat_policy is None:
      return block_class
    # In scan's loop XLA cannot fold the recomputation back into the forward pass: no CSE guard.
    return nn.remat(block_class, policy=checkpoint_policy(self.remat_policy),
                    prevent_cse=not self.scan_layers, static_argnums=(2,))

  @nn.compact
  def __call__(self, x, *, train, grid: Optional[tuple[int, int]] = None):
    if self.posemb == 'learned_1d':
      x = AddPositionEmbs(name='posembed_input')(x)
    elif grid is None:
      raise ValueError(f'posemb={self.posemb!r} needs the grid (rows, columns) of the patches.')
    else:
      x = positions.AddGridPositions(self.posemb, name='posembed_input')(x, grid)
    x = nn.with_logical_constraint(nn.Dropout(self.dropout_rate)(x, deterministic=not train),
                                   TOKENS)
    block_fields = dict(mlp_dim=self.mlp_dim, num_heads=self.num_heads,
                        dropout_rate=self.dropout_rate,
                        attention_dropout_rate=self.attention_dropout_rate,
                        approximate_gelu=self.approximate_gelu, dtype=self.dtype,
                        attention=self.attention,
                        relative_patches=math.prod(grid) if self.posemb == 'relative' else 0)
    rates = (stochastic_depth_rates(self.stochastic_depth, self.num_layers,
                                    self.stochastic_depth_schedule)
             if train and self.stochastic_depth > 0 else (None,) * self.num_layers)
    if self.scan_layers:
      scanned_rates = None if rates[0] is None else jnp.asarray(rates, jnp.float32)
      blocks = nn.scan(self.remat(_ScanStep), variable_axes={'params': 0, 'intermediates': 0},
                       split_rngs={'params': True, 'dropout': True},
                       in_axes=(nn.broadcast, nn.broadcast if scanned_rates is None else 0),
                       length=self.num_layers, metadata_params={nn.PARTITION_NAME: 'layers'})
      x, _ = blocks(**block_fields, name='encoderblock')(x, not train, scanned_rates)
    else:
      block = self.remat(Encoder1DBlock)
      for i in range(self.num_layers):
        x = block(**block_fields, name=f'encoderblock_{i}')(x, not train, rates[i])
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
  # 'cudnn': cuDNN's fused attention where it fits; 'splash': the Pallas TPU kernel.
  attention: str = 'xla'
  # Training: drop rate of the residual branches per example (stochastic depth); 0: off.
  stochastic_depth: float = 0.0
  # 'linear': rising from 0 at the first block to stochastic_depth at the last; or 'uniform'.
  stochastic_depth_schedule: str = 'linear'
  posemb: str = 'learned_1d'  # How positions enter: one of positions.POSEMB_KINDS.

  def check_images(self, images):
    """Raises a ValueError, naming the sizes, for images the model cannot cut into patches."""
    if self.classifier not in CLASSIFIERS:
      raise ValueError(f'classifier={self.classifier!r}; choose one of {CLASSIFIERS}.')
    if self.attention not in ATTENTION_KERNELS:
      raise ValueError(f'attention={self.attention!r}; choose one of {ATTENTION_KERNELS} '
                       "(models_vit.resolve_attention turns 'auto' into one for the devices).")
    if error := stochastic_depth_error(self.stochastic_depth, self.stochastic_depth_schedule):
      raise ValueError(error)
    positions.check_posemb(self.posemb, self.hidden_size)
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
    h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
    ph, pw = self.patch_pixels
    return h // ph, w // pw

  def features(self, images, *, train=False):
    """The representation the head sees, as float32: (B, representation_size or hidden_size).

    The encoder-norm output of the class token (`token`) or the mean of the tokens (`gap`), through
    `pre_logits` when the model has one; per token, (B, T, ...), for the unpooled classifiers.
    Call it as `model.apply({'params': params}, images, method='features')`: the head's parameters
    go unused, so a model with any number of classes gives the same features.
    """
    return self(images, train=train, head=False)

  @nn.compact
  def __call__(self, images, *, train, head=True, patch_task=None):
    """Logits, or with `head=False` the `features` they are computed from.

    `patch_task` (vit_jax.mpp.PatchTask, for masked patch prediction) changes the patch
    embeddings (B, N, D) by its `corrupt(self, patches)` before the class token and the position
    embeddings join them, and returns, in place of pooling and head, its `predict(self, tokens)`
    of the encoder outputs of the patch tokens (B, N, D).
    """
    self.check_images(images)
    x = images
    if self.resnet_layers is not None:
      x = resnet.resnet_stem(x, self.resnet_layers, self.resnet_width_factor, self.dtype)
    x = PatchEmbedding(hidden_size=self.hidden_size, patch_size=self.patch_size, dtype=self.dtype,
                       name='embedding')(x)
    b, h, w, d = x.shape
    x = reshape_rows(x, h * w, d)
    if patch_task is not None:
      x = patch_task.corrupt(self, x)

    if self.has_class_token:
      cls = self.param('cls', with_axes(nn.initializers.zeros, None, None, 'embed'), (1, 1, d))
      cls = jnp.broadcast_to(cls.astype(x.dtype), (b, 1, d), out_sharding=jax.typeof(x).sharding)
      x = jnp.concatenate([cls, x], axis=1)

    x = Encoder(num_layers=self.num_layers, mlp_dim=self.mlp_dim, num_heads=self.num_heads,
                dropout_rate=self.dropout_rate,
                attention_dropout_rate=self.attention_dropout_rate,
                approximate_gelu=self.approximate_gelu, dtype=self.dtype,
                scan_layers=self.scan_layers, remat_policy=self.remat_policy,
                attention=self.attention, stochastic_depth=self.stochastic_depth,
                stochastic_depth_schedule=self.stochastic_depth_schedule, posemb=self.posemb,
                name='Transformer')(x, train=train, grid=(h, w))
    if patch_task is not None:
      return patch_task.predict(self, x[:, int(self.has_class_token):])

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

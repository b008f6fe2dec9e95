"""Multi-head dot-product attention and its kernels: XLA's, cuDNN's fused attention (tokens padded
to a multiple of 16 in training) and the Pallas splash kernel of TPUs (`splash_attention`);
`resolve_attention` picks one for `config.attention`.
"""
import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from vit_jax.models import positions
from vit_jax.sharding import with_axes

Dtype = Any

ATTENTION_KERNELS = ('xla', 'cudnn', 'splash')


# Training pads the tokens to a multiple of this for cuDNN's fused attention, whose gradient
# (jax 0.10.2) rejects odd sequence lengths such as 197 (a class token and 14x14 patches).
CUDNN_TRAIN_SEQ_MULTIPLE = 16


# The splash kernel's tiles of queries and keys (its default BlockSizes); the tokens are padded
# to a multiple of them (its key tiles must be multiples of the TPU's 128 vector lanes).
SPLASH_BLOCK = 128


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
  of vit_jax.models.positions (on the last P tokens), its table `relative_embedding` (2P - 1, N, K),
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

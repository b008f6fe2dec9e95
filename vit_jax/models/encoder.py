"""The Transformer encoder of the ViT: pre-LayerNorm blocks of attention and MLP with residual
connections (Eq. 2-3 of the paper), stored per block or scanned (`scan_layers`), rematerialised
by `remat_policy`, with stochastic depth; the final LayerNorm.
"""
import math
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from vit_jax.models import attention
from vit_jax.models import positions
from vit_jax.sharding import with_axes

Dtype = Any

REMAT_POLICIES = ('nothing_saveable', 'dots_saveable', 'dots_with_no_batch_dims_saveable',
                  'everything_saveable')
LAYERNORM_EPS = 1e-6
TOKENS = ('batch', 'seq', 'embed')  # Logical axes of the (B, T, D) activations between blocks.
STOCHASTIC_DEPTH_SCHEDULES = ('linear', 'uniform')


def _layer_norm(dtype, name=None):
  return nn.LayerNorm(epsilon=LAYERNORM_EPS, dtype=dtype, name=name,
                      scale_init=with_axes(nn.initializers.ones, 'embed'),
                      bias_init=with_axes(nn.initializers.zeros, 'embed'))


class AddPositionEmbs(nn.Module):
  """Adds learned 1-D position embeddings `pos_embedding` (1, T, D) to (B, T, D) inputs whose
  last h*w tokens are the patches of a grid (h, w). With `dynamic`, embeddings made for another
  grid, `stored_grid` (None: square), are interpolated to this one (positions.resize_grid); the
  tokens before the patches (the class token) keep theirs."""
  posemb_init: Callable = nn.initializers.normal(stddev=0.02)
  dynamic: bool = False
  stored_grid: Optional[tuple[int, int]] = None

  @nn.compact
  def __call__(self, x, grid: Optional[tuple[int, int]] = None):
    expected = (1, x.shape[1], x.shape[2])
    stored = self.has_variable('params', 'pos_embedding')
    found = tuple(self.get_variable('params', 'pos_embedding').shape) if stored else expected
    resize = stored and self.dynamic and grid is not None and (
        found != expected or self.stored_grid not in (None, tuple(grid)))
    if found != expected and not resize:
      raise ValueError(
          f'The image gives {x.shape[1]} tokens but the position embeddings '
          f'(Transformer/posembed_input/pos_embedding) have shape {found}, '
          f'not {expected}. Resize the images to the resolution the model was built for, '
          'resize the position embeddings (vit_jax.checkpoints.finetune.load_pretrained does '
          'it), or apply the model with dynamic_img_size=True.')
    posemb = self.param('pos_embedding', with_axes(self.posemb_init, None, 'seq', 'embed'),
                        found)
    if resize:
      extra = x.shape[1] - grid[0] * grid[1]
      posemb = jnp.concatenate([posemb[:, :extra], positions.resize_grid(
          posemb[0, extra:], self.source_grid(found[1] - extra), grid)[None]], axis=1)
    return x + posemb.astype(x.dtype)

  def source_grid(self, num_patches: int) -> tuple[int, int]:
    """The grid of the `num_patches` stored embeddings: `stored_grid`, else a square; a
    ValueError when neither fits."""
    grid = self.stored_grid or (math.isqrt(num_patches),) * 2
    if grid[0] * grid[1] != num_patches:
      raise ValueError(f'The {num_patches} position embeddings do not form the grid {grid}: give '
                       'the model the grid they were made for (posemb_grid=(rows, columns)).')
    return tuple(grid)


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
    x = attention.MultiHeadDotProductAttention(
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
  """Encoder1DBlock as the body of `nn.scan`: (x, deterministic, drop_rate) -> (x, x or None),
  same parameters; `drop_rate` is the layer's entry of the scanned (L,) rates, or None. With
  `emit_outputs` each block's output is also the scan's output, stacked into (L, B, T, D)."""
  emit_outputs: bool = False

  def __call__(self, inputs, deterministic, drop_rate=None):
    x = super().__call__(inputs, deterministic, drop_rate)
    return x, x if self.emit_outputs else None


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
  scanned blocks take their rate as a scanned input. Called with `keep` (0-based block indices),
  it also returns the outputs (B, T, D) of those blocks, before the final LayerNorm: scanned
  blocks stack every block's output, (L, B, T, D) in the compute dtype (what training keeps for
  the backward pass anyway), and pick them from it.
  `posemb` (vit_jax.models.positions) says how positions enter, for patches on a grid of (rows,
  columns) `grid`: at the input (`posembed_input`), or in each block's attention (relative).
  With `dynamic_img_size`, learned position parameters made for another grid (learned_1d's:
  `posemb_grid`, None for a square one) are interpolated to `grid` (see VisionTransformer).
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
  dynamic_img_size: bool = False
  posemb_grid: Optional[tuple[int, int]] = None

  def remat(self, block_class):
    """`block_class`, rematerialised under `remat_policy` when one is set."""
    if self.remat_policy is None:
      return block_class
    # In scan's loop XLA cannot fold the recomputation back into the forward pass: no CSE guard.
    return nn.remat(block_class, policy=checkpoint_policy(self.remat_policy),
                    prevent_cse=not self.scan_layers, static_argnums=(2,))

  @nn.compact
  def __call__(self, x, *, train, grid: Optional[tuple[int, int]] = None,
               keep: Optional[Sequence[int]] = None):
    """(B, T, D) tokens -> the final LayerNorm's (B, T, D); with `keep`, (that, the tuple of the
    outputs of the blocks `keep`, in its order)."""
    if self.posemb == 'learned_1d':
      x = AddPositionEmbs(dynamic=self.dynamic_img_size, stored_grid=self.posemb_grid,
                          name='posembed_input')(x, grid)
    elif grid is None:
      raise ValueError(f'posemb={self.posemb!r} needs the grid (rows, columns) of the patches.')
    else:
      x = positions.AddGridPositions(self.posemb, dynamic=self.dynamic_img_size,
                                     name='posembed_input')(x, grid)
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
      x, stacked = blocks(**block_fields, emit_outputs=keep is not None, name='encoderblock')(
          x, not train, scanned_rates)
      outputs = () if keep is None else tuple(stacked[i] for i in keep)
    else:
      block = self.remat(Encoder1DBlock)
      every = []
      for i in range(self.num_layers):
        x = block(**block_fields, name=f'encoderblock_{i}')(x, not train, rates[i])
        every.append(x)
      outputs = () if keep is None else tuple(every[i] for i in keep)
    normed = _layer_norm(self.dtype, name='encoder_norm')(x)
    return normed if keep is None else (normed, outputs)

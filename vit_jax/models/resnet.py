"""The ResNet-v2 stem of the hybrid ViT: weight-standardised convolutions and GroupNorm.

Parameter names follow the published hybrid checkpoints (`conv_root`, `gn_root`,
`block{i}/unit{j}/conv1..3`, `gn1..3`, `conv_proj`, `gn_proj`).
"""
from typing import Any, Sequence

import flax.linen as nn
import jax.numpy as jnp

from vit_jax.sharding import with_axes

Dtype = Any


def standardize_weight(kernel: jnp.ndarray, eps: float = 1e-5) -> jnp.ndarray:
  """Zero mean, unit variance per output channel of a (kh, kw, cin, cout) kernel."""
  kernel = kernel - jnp.mean(kernel, axis=(0, 1, 2), keepdims=True)
  return kernel / (jnp.std(kernel, axis=(0, 1, 2), keepdims=True) + eps)


class StdConv(nn.Conv):
  """A convolution whose kernel is weight-standardised before use (Qiao et al., 2019)."""

  def param(self, name, *args, **kwargs):
    value = super().param(name, *args, **kwargs)
    return standardize_weight(value) if name == 'kernel' else value


def _conv(features: int, kernel_size, strides, dtype, name: str) -> StdConv:
  """A bias-free StdConv whose (kh, kw, cin, cout) kernel declares its logical axes."""
  return StdConv(features, kernel_size, strides, use_bias=False, dtype=dtype, name=name,
                 kernel_init=with_axes(nn.initializers.lecun_normal(), 'conv_height', 'conv_width',
                                       'conv_in', 'conv_out'))


def _group_norm(dtype, name: str, scale_init=nn.initializers.ones) -> nn.GroupNorm:
  """GroupNorm (32 groups) whose per-channel scale and bias declare their logical axis."""
  return nn.GroupNorm(dtype=dtype, name=name, scale_init=with_axes(scale_init, 'conv_out'),
                      bias_init=with_axes(nn.initializers.zeros, 'conv_out'))


class ResidualUnit(nn.Module):
  """Pre-activation-free bottleneck unit of BiT's ResNet-v2: (N,H,W,C) -> (N,H/s,W/s,4*features)."""
  features: int
  strides: tuple[int, int] = (1, 1)
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    conv = lambda feat, kernel, name, strides=(1, 1): _conv(feat, kernel, strides, self.dtype, name)
    norm = lambda name, scale_init=nn.initializers.ones: _group_norm(self.dtype, name, scale_init)

    residual = x
    if x.shape[-1] != 4 * self.features or self.strides != (1, 1):
      residual = conv(4 * self.features, (1, 1), 'conv_proj', self.strides)(residual)
      residual = norm('gn_proj')(residual)

    y = nn.relu(norm('gn1')(conv(self.features, (1, 1), 'conv1')(x)))
    y = nn.relu(norm('gn2')(conv(self.features, (3, 3), 'conv2', self.strides)(y)))
    y = norm('gn3', nn.initializers.zeros)(conv(4 * self.features, (1, 1), 'conv3')(y))
    return nn.relu(residual + y)


class ResNetStage(nn.Module):
  """`num_units` residual units (`unit1`, `unit2`, ...); the first one applies `first_strides`."""
  num_units: int
  features: int
  first_strides: tuple[int, int]
  dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    for j in range(self.num_units):
      strides = self.first_strides if j == 0 else (1, 1)
      x = ResidualUnit(self.features, strides, self.dtype, name=f'unit{j + 1}')(x)
    return x


def stem_stride(num_layers: Sequence[int]) -> int:
  """Input pixels per output position, per side, of a stem with these stages."""
  return 4 * 2**max(len(num_layers) - 1, 0)


def resnet_stem(x, num_layers: Sequence[int], width_factor: float = 1,
                dtype: Dtype = jnp.float32):
  """Root (7x7/2 conv, GroupNorm, ReLU, 3x3/2 max-pool), then stages of bottleneck units.

  Call it inside a compact method: its parameters (`conv_root`, `gn_root`, `block{i}`) land in
  the caller's scope, at the top level of the hybrid ViT as in the published checkpoints.
  Stage i (1-based) has `num_layers[i-1]` units of width `64 * width_factor * 2**(i-1)`; every
  stage after the first halves the resolution: (B, H, W, C) -> (B, H/s, W/s, C') with
  s = stem_stride(num_layers).
  """
  width = int(64 * width_factor)
  x = _conv(width, (7, 7), (2, 2), dtype, 'conv_root')(x)
  x = nn.relu(_group_norm(dtype, 'gn_root')(x))
  x = nn.max_pool(x, window_shape=(3, 3), strides=(2, 2), padding='SAME')
  for i, num_units in enumerate(num_layers):
    first_strides = (1, 1) if i == 0 else (2, 2)
    x = ResNetStage(num_units, width * 2**i, first_strides, dtype, name=f'block{i + 1}')(x)
  return x

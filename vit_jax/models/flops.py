"""FLOPs of a model's forward pass, counted from its shapes as XLA's cost analysis counts them:
`forward_flops(model, image_size)`, `gflops_per_image` (a training step costs about 3 times as
much: the forward pass and twice it for the backward).
"""
from vit_jax.models import blank
from vit_jax.models import vit


# FLOPs per element of the element-wise parts, as XLA's cost analysis counts them (exp, tanh
# and rsqrt count as transcendentals, not FLOPs): LayerNorm and GroupNorm (mean, variance,
# centre, scale, shift), softmax over each logit (max, subtract, sum, divide), tanh-approximated
# GELU, a max-pool output (one comparison per window element but the first), and the
# weight standardisation of each kernel element of the stem (once per forward pass, whatever the
# batch: counted here for a batch of one).
NORM_FLOPS = 5
SOFTMAX_FLOPS = 4
GELU_FLOPS = 8
STANDARDIZE_FLOPS = 7


def same_conv_taps(size: int, kernel: int, stride: int) -> tuple[int, int]:
  """(kernel taps that fall inside the input, summed over the outputs; output size) along one
  side of a 'SAME'-padded convolution or pool (padding taps do no work)."""
  out = -(-size // stride)
  before = max((out - 1) * stride + kernel - size, 0) // 2
  taps = sum(min(o * stride - before + kernel, size) - max(o * stride - before, 0)
             for o in range(out))
  return taps, out


def conv_flops(size: tuple[int, int], cin: int, cout: int, kernel: int,
               stride: int = 1) -> tuple[int, tuple[int, int]]:
  """(FLOPs of models_resnet.StdConv, bias-free and 'SAME', on a (height, width) = `size` x cin
  map, with its weight standardisation; its output size (height, width))."""
  (rows, out_h), (columns, out_w) = (same_conv_taps(side, kernel, stride) for side in size)
  return (2 * rows * columns + STANDARDIZE_FLOPS * kernel * kernel) * cin * cout, (out_h, out_w)


def residual_unit_flops(size: tuple[int, int], cin: int, features: int,
                        stride: int) -> tuple[int, tuple[int, int]]:
  """(FLOPs of models_resnet.ResidualUnit on a (height, width) = `size` x cin map, its output
  size)."""
  conv1, _ = conv_flops(size, cin, features, 1)
  conv2, out = conv_flops(size, features, features, 3, stride)
  conv3, _ = conv_flops(out, features, 4 * features, 1)
  area, out_area = size[0] * size[1], out[0] * out[1]
  flops = conv1 + conv2 + conv3 + (NORM_FLOPS + 1) * (area + out_area) * features  # gn, ReLU.
  flops += (NORM_FLOPS + 2) * out_area * 4 * features  # gn3, residual add, ReLU.
  if cin != 4 * features or stride != 1:
    projection, _ = conv_flops(size, cin, 4 * features, 1, stride)
    flops += projection + NORM_FLOPS * out_area * 4 * features
  return flops, out


def stem_flops(model: vit.VisionTransformer,
               image_size: blank.ImageSize) -> tuple[int, tuple[int, int], int]:
  """(FLOPs of the hybrid's ResNet stem on one image of `image_size` (a side, or (height,
  width)), (height, width) and channels of the map it gives); (0, the image's, 3) without a
  stem."""
  size = blank.image_hw(image_size)
  if model.resnet_layers is None:
    return 0, size, 3
  width = int(64 * model.resnet_width_factor)
  flops, size = conv_flops(size, 3, width, 7, 2)
  flops += (NORM_FLOPS + 1) * size[0] * size[1] * width  # gn_root, ReLU.
  (rows, out_h), (columns, out_w) = (same_conv_taps(side, 3, 2) for side in size)
  size = out_h, out_w
  flops += (rows * columns - out_h * out_w) * width  # Max-pool comparisons.
  channels = width
  for i, num_units in enumerate(model.resnet_layers):
    for j in range(num_units):
      unit, size = residual_unit_flops(size, channels, width * 2**i, 2 if i and not j else 1)
      flops, channels = flops + unit, 4 * width * 2**i
  return flops, size, channels


def block_flops(tokens: int, hidden: int, mlp: int, heads: int) -> int:
  """FLOPs of one Encoder1DBlock on (tokens, hidden): Q/K/V/out projections, both attention
  products (logits, weighted values), the MLP, and the element-wise parts."""
  t, d = tokens, hidden
  products = 2 * t * d * (4 * d + 2 * mlp) + 4 * t * t * d
  elementwise = (t * d * (2 * NORM_FLOPS + 8) + t * mlp * (GELU_FLOPS + 1)  # Biases, scale, adds.
                 + SOFTMAX_FLOPS * heads * t * t)
  return products + elementwise


def forward_flops(model: vit.VisionTransformer, image_size: blank.ImageSize = 224) -> int:
  """FLOPs of the forward pass of one image of `image_size` (a side, or (height, width)),
  counted from the model's shapes (a multiply-add is 2 FLOPs): the hybrid stem's convolutions,
  the patch embedding, each block (vit_jax.models.block_flops), the head. Matches XLA's cost
  analysis on CPU to within 1% for every registry model, and needs no backend."""
  flops, size, channels = stem_flops(model, image_size)
  (ph, pw), d = model.patch_size, model.hidden_size
  patches = (size[0] // ph) * (size[1] // pw)
  tokens = patches + (model.classifier in ('token', 'token_unpooled'))
  flops += 2 * patches * ph * pw * channels * d + patches * d + tokens * d  # Bias, posemb.
  flops += model.num_layers * block_flops(tokens, d, model.mlp_dim, model.num_heads)
  flops += NORM_FLOPS * tokens * d  # encoder_norm.
  outputs = tokens if model.classifier.endswith('unpooled') else 1
  if model.classifier == 'gap':
    flops += tokens * d + d
  if model.representation_size is not None:
    flops += outputs * (2 * d + 1) * model.representation_size
    d = model.representation_size
  return flops + outputs * (2 * d + 1) * model.num_classes


def gflops_per_image(model: vit.VisionTransformer, image_size: blank.ImageSize = 224) -> float:
  """Forward-pass GFLOPs of one image (`forward_flops` / 1e9)."""
  return forward_flops(model, image_size) / 1e9

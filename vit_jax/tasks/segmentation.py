"""Semantic segmentation, `config.objective = 'segmentation'`: a class for every pixel.

The head is the linear decoder of Segmenter (Strudel et al., 2021), the simplest of the
Segmenter and SETR family: the encoder's final, LayerNormed patch tokens as a (B, H/P, W/P, D)
map (the class token, where the model has one, left out), one Dense layer `seg_head` to C logits
per patch, and a bilinear upsampling of those logits to the (B, H, W, C) pixels. Its parameters
(PARAM_PREFIX, the task's `extra_param_prefixes`) replace the classifier's `head`, which the model
does not have; fine-tuning from a classification checkpoint drops that head and starts `seg_head`
afresh, and a classifier fine-tuned from a segmentation run drops `seg_head`.

The batches label each pixel: 'label' int (B, H, W), class ids in [0, C), or
`config.seg.ignore_label` (default 255, as the PNG masks of Pascal VOC mark unlabelled pixels)
for pixels that count nowhere. The loss is the per-pixel softmax cross-entropy (smoothed by
config.label_smoothing) averaged over the labelled pixels of the batch. Evaluation sums the
confusion matrix of the labelled pixels (`confusion`); from it `scores` gives the pixel accuracy
and the mean IoU over the classes present in the labels or the predictions.

With `config.seg.window`, the encoder sees each image as tiles of that many pixels, each encoded
alone (`SegmentationViT`): a classifier pre-trained at that size keeps its position embeddings
as they are, and its objects' scale and context. The spec of model.npz records the window
(`config_section`).
"""
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from vit_jax.models import vit
from vit_jax.sharding import with_axes
from vit_jax.tasks import task

PARAM_PREFIX = 'seg_'  # Names of the parameters segmentation adds to the published layout.


class SegmentationViT(vit.VisionTransformer):
  """A VisionTransformer whose output is per-pixel logits (B, H, W, num_classes), float32.

  Its parameters are the VisionTransformer's without `head` (`pre_logits` kept where the model
  has one, for `features`), and `seg_head` (D -> num_classes) on the patch tokens.

  With `window` (pixels), the encoder sees the image one window x window tile at a time: each
  tile is encoded as an image of its own, with its own class token and the position embeddings of
  a tile (`grid`), and the tiles' patch maps are joined before `seg_head`. This is ViTDet's window
  attention (Li et al., 2022), here in every block: a classifier pre-trained at window x window
  pixels then meets objects at the scale, and in the context, it learned them. Images are a
  whole number of tiles high and wide.
  """
  window: Optional[int] = None

  def grid(self, image_size: int | tuple[int, int]) -> tuple[int, int]:
    """The (rows, columns) of patches the encoder sees at once, which its position embeddings
    cover: an image of `image_size`'s, or with `window` a tile's."""
    return super().grid(self.window or image_size)

  def tiles(self, images: jax.Array) -> tuple[jax.Array, tuple[int, int]]:
    """(B, H, W, C) -> (the (B * R * S, window, window, C) tiles, row-major per image, (R, S)),
    R = H / window, S = W / window; the images themselves and (1, 1) without `window`. A
    ValueError naming the sizes for images that are not whole tiles."""
    if not self.window:
      return images, (1, 1)
    b, h, w, c = images.shape
    if h % self.window or w % self.window:
      raise ValueError(f'Image size {h}x{w} is not a whole number of the {self.window} px tiles '
                       f'the model encodes (window={self.window}): resize the images to a '
                       f'multiple of it, e.g. {max(h // self.window, 1) * self.window}x'
                       f'{max(w // self.window, 1) * self.window}.')
    rows, columns = h // self.window, w // self.window
    tiles = images.reshape(b, rows, self.window, columns, self.window, c)
    return (tiles.transpose(0, 1, 3, 2, 4, 5).reshape(-1, self.window, self.window, c),
            (rows, columns))

  def segment(self, tokens: jax.Array, grid: tuple[int, int], layout: tuple[int, int],
              image_size: tuple[int, int]) -> jax.Array:
    """(B * R * S, T, D) encoder outputs of the (R, S) `layout` of tiles per image, each of
    patches on `grid` -> float32 logits (B, H, W, num_classes) for images of `image_size`
    (H, W): `seg_head` per patch of the joined maps, upsampled bilinearly."""
    patches = tokens[:, int(self.has_class_token):]
    maps = join_tiles(vit.reshape_rows(patches, *grid, patches.shape[-1]), layout)
    head = nn.Dense(self.num_classes, dtype=self.dtype, name=PARAM_PREFIX + 'head',
                    kernel_init=with_axes(nn.initializers.zeros, 'embed', 'classes'),
                    bias_init=with_axes(nn.initializers.zeros, 'classes'))
    return upsample(head(maps).astype(jnp.float32), image_size)

  @nn.compact
  def __call__(self, images, *, train, head=True):
    """Per-pixel logits (B, H, W, num_classes); with `head=False` the VisionTransformer's pooled
    `features` instead (what few-shot evaluation and `features` read), with `window` their mean
    over the image's tiles."""
    tiles, layout = self.tiles(images)
    patches, grid = self.embed_patches(tiles)
    tokens = self.encode(self.add_class_token(patches), grid, train=train)
    if not head:
      return mean_over_tiles(self.pool_and_classify(tokens, head=False), images.shape[0])
    if self.is_initializing():
      self.pool_and_classify(tokens, head=False)  # Declares pre_logits, where the model has it.
    return self.segment(tokens, grid, layout, images.shape[1:3])

  def intermediates(self, images, *, blocks: Sequence[int], maps: bool = False,
                    train: bool = False) -> vit.Intermediates:
    """VisionTransformer.intermediates; with `window`, of the tiles, each encoded alone, joined
    as the image's: per chosen block the tiles' patch tokens as the image's (B, rows, columns, D)
    map, or without `maps` its (B, T, D) tokens, the patches row-major after the class token;
    that class token, and `features`, the mean of the tiles' ones."""
    if not self.window:
      return super().intermediates(images, blocks=blocks, maps=maps, train=train)
    tiles, layout = self.tiles(images)
    per_tile = super().intermediates(tiles, blocks=blocks, maps=True, train=train)
    batch = images.shape[0]
    token_maps = tuple(join_tiles(m, layout) for m in per_tile.tokens)
    class_tokens = (tuple(mean_over_tiles(c, batch) for c in per_tile.class_tokens)
                    if per_tile.class_tokens else None)
    features = mean_over_tiles(per_tile.features, batch)
    if maps:
      return vit.Intermediates(per_tile.blocks, token_maps, class_tokens, features)
    tokens = tuple(m.reshape(batch, -1, m.shape[-1]) for m in token_maps)
    if class_tokens:
      tokens = tuple(jnp.concatenate([c[:, None], t], axis=1)
                     for c, t in zip(class_tokens, tokens))
    return vit.Intermediates(per_tile.blocks, tokens, None, features)


def join_tiles(maps: jax.Array, layout: tuple[int, int]) -> jax.Array:
  """(B * R * S, h, w, D) maps of the tiles of `SegmentationViT.tiles`, row-major per image, in
  an (R, S) `layout` -> the (B, R * h, S * w, D) maps of the images."""
  (rows, columns), (h, w, d) = layout, maps.shape[1:]
  maps = maps.reshape(-1, rows, columns, h, w, d).transpose(0, 1, 3, 2, 4, 5)
  return maps.reshape(-1, rows * h, columns * w, d)


def mean_over_tiles(values: jax.Array, batch: int) -> jax.Array:
  """(B * R * S, ...) values of the tiles of `SegmentationViT.tiles` -> (B, ...), their mean
  per image (B = `batch`)."""
  return values.reshape(batch, -1, *values.shape[1:]).mean(axis=1)


def bilinear_weights(size: int, grid: int) -> np.ndarray:
  """float32 (size, grid): row i the weights of the `grid` cells at pixel i of `size`, bilinear
  with half-pixel centres and the edge cells extended (jax.image.resize's 'bilinear' when
  enlarging)."""
  centres = np.clip((np.arange(size) + 0.5) * grid / size - 0.5, 0, grid - 1)
  low = np.floor(centres).astype(int)
  high = np.minimum(low + 1, grid - 1)
  weights = np.zeros((size, grid), np.float32)
  np.add.at(weights, (np.arange(size), low), 1 - (centres - low))
  np.add.at(weights, (np.arange(size), high), centres - low)
  return weights


def upsample(maps: jax.Array, image_size: tuple[int, int]) -> jax.Array:
  """(B, rows, columns, C) -> (B, H, W, C), bilinear: one product per axis with the constant
  `bilinear_weights`, which XLA:CPU runs in about half the time of jax.image.resize's (that
  computes its weights in the step, with its gradient)."""
  rows = bilinear_weights(image_size[0], maps.shape[1])
  columns = bilinear_weights(image_size[1], maps.shape[2])
  return jnp.einsum('Ww,bHwc->bHWc', columns, jnp.einsum('Hh,bhwc->bHwc', rows, maps))


def with_segmentation(model: vit.VisionTransformer,
                      window: Optional[int] = None) -> SegmentationViT:
  """`model` as a SegmentationViT of its num_classes, encoding `window` px tiles (None: the
  whole image)."""
  fields = {f: getattr(model, f) for f in vit.VisionTransformer.__dataclass_fields__
            if f not in ('parent', 'name')}
  return SegmentationViT(**fields, window=window)


def pixel_losses(logits: jax.Array, labels: jax.Array, ignore_label: int,
                 label_smoothing: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """(loss, labelled), each float32 (B, H, W), of logits (B, H, W, C) against int labels
  (B, H, W): the softmax cross-entropy (of targets smoothed by `label_smoothing`), 0 where the
  label is `ignore_label`, and 1 where a pixel is labelled, 0 where it is ignored."""
  labelled = labels != ignore_label
  safe = jnp.where(labelled, labels, 0)
  if label_smoothing:
    targets = optax.smooth_labels(jax.nn.one_hot(safe, logits.shape[-1]), label_smoothing)
    loss = optax.softmax_cross_entropy(logits, targets)
  else:  # Without the one-hot targets: the faster form.
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, safe)
  labelled = labelled.astype(jnp.float32)
  return loss * labelled, labelled


def confusion(labels: jax.Array, predicted: jax.Array, weights: jax.Array,
              num_classes: int) -> jax.Array:
  """float32 (C, C): entry [k, j] the summed `weights` (B, H, W) of the pixels labelled k and
  predicted j (labels and predictions int (B, H, W); labels outside [0, C) count nowhere)."""
  truth = jax.nn.one_hot(labels, num_classes) * weights[..., None]
  return jnp.einsum('bhwk,bhwj->kj', truth, jax.nn.one_hot(predicted, num_classes))


def scores(confusion_matrix: np.ndarray) -> tuple[float, float]:
  """(pixel accuracy, mean IoU) of a (C, C) confusion matrix (`confusion`, summed over the
  batches). Class k's IoU is the pixels labelled and predicted k over those labelled or
  predicted k; the mean is over the classes with any such pixel (NaN without pixels)."""
  matrix = np.asarray(confusion_matrix, np.float64)
  hits = np.diag(matrix)
  union = matrix.sum(0) + matrix.sum(1) - hits
  present = union > 0
  accuracy = hits.sum() / matrix.sum() if matrix.sum() else float('nan')
  miou = np.mean(hits[present] / union[present]) if present.any() else float('nan')
  return float(accuracy), float(miou)


def train_loss(model: SegmentationViT, config: ml_collections.ConfigDict) -> task.LossFn:
  """loss_fn(params, batch, rng) -> (the mean cross-entropy of the batch's labelled pixels,
  {'pixel_accuracy': the share of them predicted right}), dropout drawn from `rng`."""

  def loss_fn(params: Any, batch: task.Batch, rng: jax.Array):
    logits = model.apply({'params': params}, batch['image'], train=True, rngs={'dropout': rng})
    loss, labelled = pixel_losses(logits, batch['label'], config.seg.ignore_label,
                                  config.label_smoothing)
    pixels = jnp.maximum(jnp.sum(labelled), 1)
    hits = (jnp.argmax(logits, -1) == batch['label']) * labelled
    return jnp.sum(loss) / pixels, {'pixel_accuracy': jnp.sum(hits) / pixels}

  return loss_fn


def make_eval_step(model: SegmentationViT,
                   config: ml_collections.ConfigDict) -> task.EvalStep:
  """eval(params, batch) -> sums over the labelled pixels of the unmasked examples: 'confusion'
  (C, C) (`confusion`), 'loss' (cross-entropy), 'pixels', and 'count' (examples)."""

  def eval_step(params: Any, batch: task.Batch):
    logits = model.apply({'params': params}, batch['image'], train=False)
    loss, labelled = pixel_losses(logits, batch['label'], config.seg.ignore_label)
    weights = labelled * batch['mask'][:, None, None]
    return {'confusion': confusion(batch['label'], jnp.argmax(logits, -1), weights,
                                   model.num_classes),
            'loss': jnp.sum(loss * weights), 'pixels': jnp.sum(weights),
            'count': jnp.sum(batch['mask'])}

  return eval_step


def config_error(config: ml_collections.ConfigDict) -> str | None:
  """Why the config cannot train a segmentation, or None where it can; one line."""
  if config.mixup.p:
    return (f'config.mixup.p={config.mixup.p} mixes images, but segmentation has one label per '
            'pixel to mix with them: set --config.mixup.p=0.')
  if config.pp.get('randaug'):
    return (f'config.pp.randaug={tuple(config.pp.randaug)} rotates, shears and shifts the image '
            'but not its per-pixel labels: set --config.pp.randaug=None for segmentation.')
  return window_error(config)


def window_error(config: ml_collections.ConfigDict) -> str | None:
  """Why config.seg.window cannot tile config.pp.crop into the model's patches, or None."""
  window = config.seg.get('window')
  if not window:
    return None
  crop = config.pp.crop
  sides = (crop, crop) if isinstance(crop, int) else tuple(crop)
  if any(side % window for side in sides):
    return (f'config.seg.window={window} does not tile config.pp.crop={crop}: make the crop a '
            f'multiple of the window, e.g. --config.pp.crop={max(sides[0] // window, 1) * window}.')
  patch = tuple(config.model.get('patches', {}).get('size', (1, 1)))
  if not config.model.get('resnet') and (window % patch[0] or window % patch[1]):
    return (f'config.seg.window={window} is not a whole number of the model\'s {patch[0]}x'
            f'{patch[1]} px patches: make it a multiple of them.')
  return None


TASK = task.Task(model=lambda model, config: with_segmentation(model, config.seg.get('window')),
                 train_loss=train_loss, eval_step=make_eval_step, evaluator='segmentation',
                 needs_labels=True, extra_param_prefixes=(PARAM_PREFIX,),
                 config_error=config_error, per_pixel_labels=True, config_section='seg')

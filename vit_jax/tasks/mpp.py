"""Masked patch prediction: self-supervised pre-training of a ViT (the paper's Section 4.6 and
Appendix B.1.2), `config.objective = 'masked_patch_prediction'`.

Per image, `corruption_plan` picks round(rate * N) of the N patches; of those, by
`mask_random_keep` (the paper's 80/10/10), each is replaced by the learned [mask] embedding
`mpp_mask_embedding` (D,), replaced by the embedding of a random other patch of the batch, or kept.
As BERT does with token embeddings, the corruption acts on the patch embeddings before the class
token and the position embeddings are added: a corrupted patch keeps its position, and loses its
content. From the encoder output of each corrupted patch the head `mpp_head` predicts its
`target`, computed from the pixels of the uncorrupted image:

- `mean_color_3bit`: the patch's mean colour, each channel quantised to COLOR_LEVELS levels, as
  one of COLORS = 512 classes;
- `downsampled_3bit`: the patch area-averaged to DOWNSAMPLED x DOWNSAMPLED pixels, each in 3-bit
  colour: 16 predictions of 512 classes;
- `patch_l2`: every pixel of the patch, regressed with a squared error.

Labels are not used. The two extra parameters (PARAM_PREFIX names, the task's
`extra_param_prefixes`) sit beside the published layout, which is otherwise unchanged;
vit_jax.checkpoints.finetune.load_pretrained drops them when a supervised model is fine-tuned
from such a run. Models with a ResNet stem are refused: the stem's
receptive fields cross patch borders, so the neighbours of a masked patch would show its pixels.
"""
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import optax

from vit_jax.models import vit
from vit_jax.sharding import with_axes
from vit_jax.tasks import task

TARGETS = ('mean_color_3bit', 'downsampled_3bit', 'patch_l2')
PARAM_PREFIX = 'mpp_'  # Names of the parameters pre-training adds to the published layout.
COLOR_LEVELS = 8  # 3 bits per channel.
COLORS = COLOR_LEVELS**3
DOWNSAMPLED = 4  # Side of the downsampled patch of `downsampled_3bit`.
UNCHOSEN, MASK, RANDOM, KEEP = 0, 1, 2, 3  # What the plan does to a patch.
EVAL_SEED = 0  # Evaluation corrupts every batch by the same plan, whatever the step.


class Plan(NamedTuple):
  """The corruption of a batch: `kinds` (B, N) int32, MASK, RANDOM or KEEP for the corrupted patches
  (those predicted), UNCHOSEN for the others; `sources` (B, N) int32, the index into
  the batch's B * N patches (row-major) whose embedding a RANDOM patch takes (never its own)."""
  kinds: jax.Array
  sources: jax.Array


def corrupted_count(num_patches: int, rate: float) -> int:
  """Patches corrupted per image: round(rate * num_patches), at least 1."""
  return max(1, round(rate * num_patches))


def corruption_plan(rng: jax.Array, batch: int, num_patches: int, rate: float,
                    mask_random_keep: tuple[float, float, float]) -> Plan:
  """Per image, exactly `corrupted_count` patches chosen uniformly, each masked, replaced by a
  random other patch or kept with the probabilities `mask_random_keep`; a function of `rng`."""
  choose_rng, kind_rng, source_rng = jax.random.split(rng, 3)
  ranks = jnp.argsort(jnp.argsort(jax.random.uniform(choose_rng, (batch, num_patches)), axis=1),
                      axis=1)
  chosen = ranks < corrupted_count(num_patches, rate)
  kind = MASK + jax.random.categorical(kind_rng, jnp.log(jnp.asarray(mask_random_keep)),
                                       shape=(batch, num_patches))
  total = batch * num_patches
  offsets = jax.random.randint(source_rng, (batch, num_patches), 1, total)
  sources = (jnp.arange(total).reshape(batch, num_patches) + offsets) % total
  return Plan(jnp.where(chosen, kind, UNCHOSEN).astype(jnp.int32), sources.astype(jnp.int32))


def target_outputs(target: str, patch_pixels: tuple[int, int]) -> int:
  """Values the head predicts per patch: 512 logits, 16 x 512 logits, or the patch's pixels."""
  if target == 'mean_color_3bit':
    return COLORS
  if target == 'downsampled_3bit':
    return DOWNSAMPLED**2 * COLORS
  return patch_pixels[0] * patch_pixels[1] * 3


class MaskedPatchViT(vit.VisionTransformer):
  """A VisionTransformer that also predicts the patches of images corrupted by a Plan.

  Its parameters are the VisionTransformer's and those of masked patch prediction:
  `mpp_mask_embedding` (D,), the [mask] patch embedding, and `mpp_head` (D -> `mpp_outputs`).
  Initialised without a plan (as vit_jax.models.blank does), it declares them all, the
  classifier's `head` included, so that the params keep the published layout.
  """
  mpp_outputs: int = COLORS

  def corrupt(self, patches: jax.Array, plan: Plan) -> jax.Array:
    """(B, N, D) patch embeddings -> the same, corrupted by `plan`: MASK patches replaced by
    `mpp_mask_embedding`, RANDOM ones by the embedding of their source patch."""
    b, n, d = patches.shape
    mask = self.param(PARAM_PREFIX + 'mask_embedding',
                      with_axes(nn.initializers.normal(stddev=0.02), 'embed'), (d,))
    others = patches.reshape(b * n, d)[plan.sources.reshape(-1)].reshape(b, n, d)
    kinds = plan.kinds[..., None]
    patches = jnp.where(kinds == MASK, mask.astype(patches.dtype), patches)
    return jnp.where(kinds == RANDOM, others, patches)

  def predict_patches(self, tokens: jax.Array) -> jax.Array:
    """(B, T, D) encoder outputs -> (B, N, mpp_outputs) float32 predictions of `mpp_head` from
    the patch tokens (the class token left out)."""
    head = nn.Dense(self.mpp_outputs, dtype=self.dtype, name=PARAM_PREFIX + 'head',
                    kernel_init=with_axes(nn.initializers.zeros, 'embed', 'classes'),
                    bias_init=with_axes(nn.initializers.zeros, 'classes'))
    return head(tokens[:, int(self.has_class_token):]).astype(jnp.float32)

  @nn.compact
  def __call__(self, images, *, train, head=True, plan: Plan | None = None):
    """Without `plan`, the VisionTransformer's logits (or with `head=False` its features); with
    it, `predict_patches` of `images` whose patch embeddings `plan` corrupted.

    As BERT does, the corruption comes before the class token and the position embeddings join
    the patches: a corrupted patch keeps its position and loses its content.
    """
    patches, grid = self.embed_patches(images)
    if plan is not None or self.is_initializing():
      blank = Plan(*[jnp.zeros(patches.shape[:2], jnp.int32)] * 2)
      patches = self.corrupt(patches, blank if plan is None else plan)
    tokens = self.encode(self.add_class_token(patches), grid, train=train)
    if plan is not None:
      return self.predict_patches(tokens)
    if self.is_initializing():
      self.predict_patches(tokens)  # Declares mpp_head.
    return self.pool_and_classify(tokens, head=head)


def with_mpp(model: vit.VisionTransformer, target: str) -> MaskedPatchViT:
  """`model` as a MaskedPatchViT predicting `target`."""
  fields = {f: getattr(model, f) for f in vit.VisionTransformer.__dataclass_fields__
            if f not in ('parent', 'name')}
  return MaskedPatchViT(**fields, mpp_outputs=target_outputs(target, model.patch_pixels))


# Targets, from (B, H, W, 3) images in [-1, 1].


def patches_of(images: jax.Array, patch_pixels: tuple[int, int]) -> jax.Array:
  """(B, H, W, C) -> (B, N, ph, pw, C): the patches in the model's row-major token order."""
  b, h, w, c = images.shape
  ph, pw = patch_pixels
  x = images.reshape(b, h // ph, ph, w // pw, pw, c).transpose(0, 1, 3, 2, 4, 5)
  return x.reshape(b, (h // ph) * (w // pw), ph, pw, c)


def color_class(rgb: jax.Array) -> jax.Array:
  """(..., 3) colours in [-1, 1] -> (...) int32 in [0, 512): each channel quantised to 8
  equal-width levels of [-1, 1] (1 is in the top one), as red * 64 + green * 8 + blue."""
  levels = jnp.clip(jnp.floor((rgb + 1) / 2 * COLOR_LEVELS), 0, COLOR_LEVELS - 1).astype(jnp.int32)
  return (levels[..., 0] * COLOR_LEVELS + levels[..., 1]) * COLOR_LEVELS + levels[..., 2]


def area_weights(size: int, cells: int) -> jax.Array:
  """(cells, size) weights that average `size` pixels into `cells` equal cells, each pixel by
  the fraction of it a cell covers (average pooling when `cells` divides `size`)."""
  edges = jnp.arange(cells + 1) * size / cells
  pixels = jnp.arange(size)
  overlap = (jnp.minimum(edges[1:, None], pixels + 1) - jnp.maximum(edges[:-1, None], pixels))
  return jnp.clip(overlap, 0, None) * cells / size


def downsample(patches: jax.Array, cells: int = DOWNSAMPLED) -> jax.Array:
  """(..., ph, pw, C) -> (..., cells, cells, C) by area averaging."""
  rows = area_weights(patches.shape[-3], cells)
  columns = area_weights(patches.shape[-2], cells)
  return jnp.einsum('ih,...hwc,jw->...ijc', rows, patches, columns)


def targets(images: jax.Array, patch_pixels: tuple[int, int], target: str) -> jax.Array:
  """Per patch: (B, N) colour classes, (B, N, 16) colour classes, or (B, N, ph * pw * 3) pixels."""
  patches = patches_of(images, patch_pixels)
  if target == 'mean_color_3bit':
    return color_class(jnp.mean(patches, axis=(2, 3)))
  if target == 'downsampled_3bit':
    return color_class(downsample(patches)).reshape(*patches.shape[:2], DOWNSAMPLED**2)
  return patches.reshape(*patches.shape[:2], -1)


def patch_losses(predictions: jax.Array, images: jax.Array, patch_pixels: tuple[int, int],
                 target: str) -> tuple[jax.Array, jax.Array]:
  """(loss, accuracy) per patch, each (B, N), of (B, N, outputs) `predictions`.

  The loss is the softmax cross-entropy of the colour classes (averaged over the 16 of
  `downsampled_3bit`), or for `patch_l2` the squared error averaged over the pixel values. The
  accuracy is that of the predicted colour class: of the argmax, or for `patch_l2` of the mean
  colour of the predicted pixels against the patch's 3-bit mean colour.
  """
  wanted = targets(images, patch_pixels, target)
  b, n = wanted.shape[:2]
  if target == 'patch_l2':
    loss = jnp.mean((predictions - wanted)**2, axis=-1)
    mean_color = lambda pixels: color_class(jnp.mean(pixels.reshape(b, n, -1, 3), axis=2))
    return loss, (mean_color(predictions) == mean_color(wanted)).astype(jnp.float32)
  wanted = wanted.reshape(b, n, -1)
  logits = predictions.reshape(b, n, wanted.shape[-1], COLORS)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, wanted)
  hits = (jnp.argmax(logits, axis=-1) == wanted).astype(jnp.float32)
  return jnp.mean(loss, axis=-1), jnp.mean(hits, axis=-1)


def image_losses(model: MaskedPatchViT, params: Any, images: jax.Array, plan: Plan,
                 target: str, *, train: bool, rngs=None) -> tuple[jax.Array, jax.Array]:
  """(mpp loss, mpp accuracy) per image, each (B,): the mean over its corrupted patches."""
  predictions = model.apply({'params': params}, images, train=train, rngs=rngs, plan=plan)
  loss, accuracy = patch_losses(predictions, images, model.patch_pixels, target)
  corrupted = (plan.kinds != UNCHOSEN).astype(jnp.float32)
  count = jnp.sum(corrupted, axis=1)
  return jnp.sum(loss * corrupted, axis=1) / count, jnp.sum(accuracy * corrupted, axis=1) / count


def plan_for(rng: jax.Array, model: MaskedPatchViT, images: jax.Array,
             mpp: ml_collections.ConfigDict) -> Plan:
  """The corruption plan of `images` under config.mpp, drawn from `rng`."""
  rows, columns = model.grid(images.shape[1:3])
  return corruption_plan(rng, images.shape[0], rows * columns, mpp.corruption_rate,
                         tuple(mpp.mask_random_keep))


def train_loss(model: MaskedPatchViT, config: ml_collections.ConfigDict):
  """loss_fn(params, batch, rng) -> (mean mpp loss, {'mpp_accuracy': mean accuracy}) of the
  batch's images (its labels unused), the corruption drawn from `rng` (and dropout from a key
  split off it)."""

  def loss_fn(params, batch, rng):
    plan_rng, dropout_rng = jax.random.split(rng)
    images = batch['image']
    loss, accuracy = image_losses(model, params, images,
                                  plan_for(plan_rng, model, images, config.mpp),
                                  config.mpp.target, train=True, rngs={'dropout': dropout_rng})
    return jnp.mean(loss), {'mpp_accuracy': jnp.mean(accuracy)}

  return loss_fn


def make_eval_step(model: MaskedPatchViT, config: ml_collections.ConfigDict):
  """eval(params, batch) -> sums over the unmasked examples of mpp_loss and mpp_accuracy (each
  image's mean over its corrupted patches), and count; every batch corrupted by the plan of
  EVAL_SEED, so that evaluations of different steps compare."""

  def eval_step(params, batch):
    images = batch['image']
    plan = plan_for(jax.random.key(EVAL_SEED), model, images, config.mpp)
    loss, accuracy = image_losses(model, params, images, plan, config.mpp.target, train=False)
    mask = batch['mask'].astype(jnp.float32)
    return {'mpp_loss': jnp.sum(loss * mask), 'mpp_accuracy': jnp.sum(accuracy * mask),
            'count': jnp.sum(mask)}

  return eval_step


def config_error(config: ml_collections.ConfigDict) -> str | None:
  """Why config.mpp, or the model, cannot pre-train by masked patch prediction, or None where
  they can; one line."""
  mpp = config.mpp
  if mpp.target not in TARGETS:
    return f'config.mpp.target={mpp.target!r} is not one of {TARGETS}.'
  split = tuple(mpp.mask_random_keep)
  if len(split) != 3 or min(split) < 0 or not math.isclose(sum(split), 1):
    return (f'config.mpp.mask_random_keep={split!r} must be 3 shares (mask, random, keep) of 0 or '
            'more summing to 1, e.g. (0.8, 0.1, 0.1) (the paper).')
  if config.model.get('resnet') is not None:
    return (f'config.objective={config.objective!r} needs a model without a ResNet stem: '
            f'{config.model_name} has one, whose receptive fields would show the masked patches '
            'to their neighbours; use a plain ViT.')
  return None


TASK = task.Task(model=lambda model, config: with_mpp(model, config.mpp.target),
                 train_loss=train_loss, eval_step=make_eval_step, evaluator='mpp',
                 needs_labels=False, extra_param_prefixes=(PARAM_PREFIX,),
                 config_error=config_error, config_section='mpp')

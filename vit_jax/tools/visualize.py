"""Figures of what a Vision Transformer learned, as PNG files (paper Section 4.5, Figure 7).

    python -m vit_jax.visualize --checkpoint WORKDIR  # Writes WORKDIR/figures/*.png.
    python -m vit_jax.visualize --checkpoint ViT-B_16.npz --model ViT-B_16 \\
        --images cat.jpg dog.png --output figures/

`--checkpoint` is an `.npz` or a training workdir (its `model.npz` and TensorBoard events). Files
that vit_jax wrote carry their model's spec; a published `.npz` needs `--model`, its registry
name. The image size follows from the position embeddings. Without `--images`, the figures
are drawn on `--num_images` test images of the run's own image folder (a workdir of a run on
one), else on the first test images of the embedded Fashion-MNIST; image files are framed as
`predict` frames them. Each figure written is printed as its path:

- attention_rollout: attention rollout from the class token (or the token mean of `gap` models)
  to the patches, over each image.
- attention_layers: each layer's head-averaged attention from the class token (or token mean).
- attention_heads: the same for each head of the last layer.
- position_similarity: cosine similarity between the position embeddings of the patches.
- mean_attention_distance: per layer and head, the mean distance attention reaches, in pixels.
- embedding_filters: the first 28 principal components of the RGB patch-embedding filters
  (of their channel sums, in grey, for a workdir trained on the grey embedded Fashion-MNIST).
- training_curves: loss, accuracy and learning rate against step (workdirs only).

A figure file already in the output folder is drawn again only where this command drew it from
the same checkpoint (the PNG file records which); any other file there is kept, and the command
stops first with a line that names it.

The numbers come from `vit_jax.analysis`; the `plot_*` functions return matplotlib Figures
(made without pyplot, so no display is needed) for reuse in notebooks.
"""
import argparse
import math
import os
import sys
import textwrap
from typing import Optional, Sequence

import matplotlib
import matplotlib.cm
import matplotlib.colors
import matplotlib.ticker
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
import numpy as np
from PIL import Image

from vit_jax import console
from vit_jax import errors
from vit_jax.checkpoints import published
from vit_jax.checkpoints import runs
from vit_jax.data import embedded
from vit_jax.data import image_files
from vit_jax.models import analysis
from vit_jax.models import positions

FIGURES = ('attention_rollout', 'attention_layers', 'attention_heads', 'position_similarity',
           'mean_attention_distance', 'embedding_filters', 'training_curves')
SOFTWARE = 'vit_jax.visualize'  # The PNG files' Software text, beside the Source they show.
MAP_COLORMAP = 'inferno'
BATCH_SIZE = 8  # Images per forward pass; bounds the memory of the attention stacks.
NUM_FILTER_COMPONENTS = 28
# Tags logged by training, per panel of the training curves.
CURVE_PANELS = (('Loss', ('train_loss', 'test_loss')), ('Accuracy', ('test_accuracy',)),
                ('Learning rate', ('learning_rate',)))

# Loading a model, its parameters and images.


def trained_on_grey(checkpoint_path: str) -> bool:
  """Whether `checkpoint_path` is a workdir of a run on the grey embedded Fashion-MNIST."""
  return runs.saved_run_config(checkpoint_path).get('dataset') == embedded.DATASET


def load_model(checkpoint_path: str, model_name: Optional[str] = None):
  """(model, params, image size) of an `.npz` checkpoint or a training workdir, as
  `runs.load_model` builds them (from the saved spec, or the registry's `model_name`); the
  image size is the one of the position embeddings."""
  model, params = runs.load_model(checkpoint_path, model_name)
  return model, params, runs.native_image_size(params, model)


def run_images(checkpoint_path: str, num_images: int) -> list[str]:
  """Up to `num_images` test images of the image folder that the run in the workdir
  `checkpoint_path` trained on (`image_files.folder_images`); none for other checkpoints, for runs
  on other data, and where the folder is not there (relative to the current one)."""
  folder = os.path.expanduser(runs.saved_run_config(checkpoint_path).get('dataset') or '')
  return image_files.folder_images(folder, num_images) if os.path.isdir(folder) else []


def embedded_images(num_images: int, size: int) -> np.ndarray:
  """The first test images of the embedded Fashion-MNIST set: (B, size, size, 3) in [-1, 1]."""
  with np.load(embedded.PATH) as data:
    grey = data['test_images'][:num_images]
  rgb = [Image.fromarray(x).convert('RGB').resize((size, size), Image.Resampling.BILINEAR)
         for x in grey]
  return np.stack(rgb).astype(np.float32) / 127.5 - 1


# The figures.


def _to_display(image: np.ndarray) -> np.ndarray:
  return np.clip((image + 1) / 2, 0, 1)


def set_title(fig: Figure, title: str) -> None:
  """`title` above the whole figure, wrapped at spaces into as few lines as fit its width."""
  renderer = FigureCanvasAgg(fig).get_renderer()
  text = fig.suptitle(title)
  for width in range(len(title), 0, -1):
    text.set_text(textwrap.fill(title, width))
    if text.get_window_extent(renderer).width <= fig.bbox.width:
      return


def plot_maps_over_images(images: np.ndarray, maps: np.ndarray, column_titles: Sequence[str],
                          title: str) -> Figure:
  """Each image, then its K maps overlaid: images (B, H, W, 3) in [-1, 1], maps (B, K, g_h, g_w).

  Each map is scaled to its own maximum, so colours compare patches within a map only.
  """
  num_images, num_maps = maps.shape[:2]
  h, w = images.shape[1:3]
  panel = float(np.clip(28 / (num_maps + 1), 0.9, 1.8))  # Inches; deep models get narrower ones.
  fig = Figure(figsize=(panel * (num_maps + 1) + 0.8, panel * num_images + 0.6),
               layout='constrained')
  axes = fig.subplots(num_images, num_maps + 1, squeeze=False)
  peaks = maps.max(axis=(-2, -1), keepdims=True)
  relative = np.divide(maps, peaks, out=np.zeros_like(maps), where=peaks > 0)
  for b in range(num_images):
    axes[b, 0].imshow(_to_display(images[b]))
    for k in range(num_maps):
      image = axes[b, k + 1].imshow(_to_display(images[b]))
      axes[b, k + 1].imshow(relative[b, k], cmap=MAP_COLORMAP, alpha=0.6, vmin=0, vmax=1,
                            extent=image.get_extent(), interpolation='bilinear')
  for ax in axes.ravel():
    ax.set_xticks([])
    ax.set_yticks([])
  for ax, column_title in zip(axes[0], ['Input'] + list(column_titles)):
    ax.set_title(column_title, fontsize=9)
  scale = matplotlib.cm.ScalarMappable(matplotlib.colors.Normalize(0, 1), MAP_COLORMAP)
  fig.colorbar(scale, ax=axes, shrink=0.8, label='Attention / its maximum')
  set_title(fig, title)
  return fig


def plot_position_similarity(similarity: np.ndarray, title: str) -> Figure:
  """(g_h, g_w, g_h, g_w) similarities as a g_h x g_w grid of small heat maps (Figure 7, centre)."""
  gh, gw = similarity.shape[:2]
  mosaic = np.full((gh * (gh + 1) - 1, gw * (gw + 1) - 1), np.nan)
  for i in range(gh):
    for j in range(gw):
      mosaic[i * (gh + 1):i * (gh + 1) + gh, j * (gw + 1):j * (gw + 1) + gw] = similarity[i, j]
  fig = Figure(figsize=(7, 6), layout='constrained')
  ax = fig.subplots()
  shown = ax.imshow(mosaic, cmap='viridis', vmin=-1, vmax=1, interpolation='nearest')
  tick_step = max(1, math.ceil(max(gh, gw) / 16))
  ax.set_xticks(np.arange(0, gw, tick_step) * (gw + 1) + (gw - 1) / 2,
                np.arange(1, gw + 1, tick_step))
  ax.set_yticks(np.arange(0, gh, tick_step) * (gh + 1) + (gh - 1) / 2,
                np.arange(1, gh + 1, tick_step))
  ax.set_xlabel('Input patch column')
  ax.set_ylabel('Input patch row')
  fig.colorbar(shown, ax=ax, label='Cosine similarity')
  set_title(fig, title)
  return fig


def plot_mean_attention_distance(distances: np.ndarray, image_size: int, title: str) -> Figure:
  """(L, N) distances in pixels as a scatter of heads against depth (Figure 7, right)."""
  num_layers, num_heads = distances.shape
  fig = Figure(figsize=(6, 4.5), layout='constrained')
  ax = fig.subplots()
  layers = np.arange(1, num_layers + 1)
  colors = matplotlib.colormaps['turbo'](np.linspace(0.05, 0.95, num_heads))
  for n in range(num_heads):
    ax.scatter(layers, distances[:, n], s=14, color=colors[n], label=f'Head {n + 1}')
  if num_heads <= 16:
    ax.legend(fontsize=7, ncol=2, loc='lower right')
  ax.set_xlabel('Network depth (layer)')
  ax.set_ylabel('Mean attention distance (pixels)')
  ax.set_xlim(0.5, num_layers + 0.5)
  ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  ax.set_ylim(0, max(image_size, 1.05 * distances.max()))
  set_title(fig, title)
  return fig


def plot_embedding_filters(components: np.ndarray, variance_ratio: np.ndarray,
                           title: str) -> Figure:
  """(K, P, P, C) principal components as RGB (C = 3) or grey (C = 1) images, each scaled to
  [0, 1] (Figure 7, left)."""
  num_columns = 7
  num_rows = math.ceil(len(components) / num_columns)
  fig = Figure(figsize=(1.3 * num_columns, 1.4 * num_rows + 0.5), layout='constrained')
  axes = fig.subplots(num_rows, num_columns, squeeze=False)
  for ax in axes.ravel():
    ax.axis('off')
  for ax, component, ratio in zip(axes.ravel(), components, variance_ratio):
    low, high = component.min(), component.max()
    scaled = (component - low) / max(high - low, 1e-12)
    ax.imshow(scaled[..., 0] if scaled.shape[-1] == 1 else scaled, cmap='gray', vmin=0, vmax=1,
              interpolation='nearest')  # The colour map applies to grey (C = 1) only.
    ax.set_title(f'{100 * ratio:.1f}%', fontsize=8)
  set_title(fig, title)
  return fig


def plot_training_curves(curves: dict[str, tuple[np.ndarray, np.ndarray]], title: str) -> Figure:
  """Loss, accuracy and learning rate against step, from `analysis.read_scalars`."""
  fig = Figure(figsize=(13, 3.8), layout='constrained')
  axes = fig.subplots(1, len(CURVE_PANELS))
  for ax, (label, tags) in zip(axes, CURVE_PANELS):
    logged = [tag for tag in tags if tag in curves]
    for tag in logged:
      steps, values = curves[tag]
      ax.plot(steps, values, marker='.' if len(steps) < 30 else None, label=tag)
    if logged:
      ax.legend(fontsize=8)
    else:
      ax.text(0.5, 0.5, f'{", ".join(tags)} not logged', ha='center', transform=ax.transAxes)
    ax.set_xlabel('Step')
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
  set_title(fig, title)
  return fig


# The command line.


def attention_statistics(model, params, images: np.ndarray, grid: tuple[int, int]):
  """Per-image maps and the mean attention distance, computed BATCH_SIZE images at a time.

  Returns rollout maps (B, 1, g_h, g_w), per-layer maps (B, L, g_h, g_w), the last layer's
  per-head maps (B, N, g_h, g_w) and the distances (L, N) averaged over all B images.
  """
  class_token = model.has_class_token
  to_map = lambda matrix: analysis.token_to_patch_map(matrix, grid, class_token)
  rollouts, layers, heads, distance_sum = [], [], [], 0
  for start in range(0, len(images), BATCH_SIZE):
    batch = images[start:start + BATCH_SIZE]
    attention = analysis.attention_weights(model, params, batch)
    rollouts.append(to_map(analysis.attention_rollout(attention))[:, None])
    layers.append(to_map(attention.mean(axis=2)).transpose(1, 0, 2, 3))
    heads.append(to_map(attention[-1]))
    distance_sum += len(batch) * analysis.mean_attention_distance(
        attention, grid, model.patch_pixels, class_token)
  return (np.concatenate(rollouts), np.concatenate(layers), np.concatenate(heads),
          distance_sum / len(images))


def model_figures(model, params, image_size: int, images: np.ndarray, name: str,
                  wanted: Sequence[str], grey_input: bool = False) -> dict[str, Figure]:
  """The figures in `wanted` that need the model and its parameters; `grey_input`: the model
  was trained on grey images (repeated into RGB)."""
  grid = model.grid(image_size)
  class_token = model.has_class_token
  source = 'class token' if class_token else 'token mean'
  figures = {}
  if {'attention_rollout', 'attention_layers', 'attention_heads',
      'mean_attention_distance'} & set(wanted):
    rollout, layers, heads, distances = attention_statistics(model, params, images, grid)
    figures['attention_rollout'] = plot_maps_over_images(
        images, rollout, ['Rollout'], f'{name}: attention rollout from the {source}')
    figures['attention_layers'] = plot_maps_over_images(
        images, layers, [f'Layer {i + 1}' for i in range(layers.shape[1])],
        f'{name}: attention from the {source}, per layer (mean of heads)')
    figures['attention_heads'] = plot_maps_over_images(
        images, heads, [f'Head {i + 1}' for i in range(heads.shape[1])],
        f'{name}: attention from the {source}, last layer, per head')
    figures['mean_attention_distance'] = plot_mean_attention_distance(
        distances, image_size, f'{name}: mean attention distance over {len(images)} images')
  if 'position_similarity' in wanted and model.posemb in ('none', 'relative'):
    print(f'Skipped position_similarity: {name} has posemb={model.posemb!r}, no embedding per '
          'position to compare.', file=sys.stderr)
  elif 'position_similarity' in wanted:
    similarity = analysis.position_similarity(
        positions.patch_embeddings(params, model.posemb, grid), grid, class_token=False)
    figures['position_similarity'] = plot_position_similarity(
        similarity, f'{name}: position embedding similarity')
  kernel = params['embedding']['kernel']
  if 'embedding_filters' in wanted and kernel.shape[2] == 3:
    components, ratio = analysis.embedding_filter_components(kernel, NUM_FILTER_COMPONENTS,
                                                             grey_input)
    filters = ('embedding filters, channels summed (grey input)' if grey_input else
               'RGB embedding filters')
    figures['embedding_filters'] = plot_embedding_filters(
        components, ratio, f'{name}: principal components of the {filters} (% of variance)')
  elif 'embedding_filters' in wanted:
    print(f'Skipped embedding_filters: the embedding of {name} sees {kernel.shape[2]} ResNet '
          'channels, not RGB pixels.', file=sys.stderr)
  return {k: v for k, v in figures.items() if k in wanted}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = console.command_parser('visualize', description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoint', required=True,
                      help='A .npz checkpoint, a training workdir, or a published name '
                      '(augreg:B/16-384; python -m vit_jax.checkpoint --list).')
  parser.add_argument('--model', help='Registry model name; needed for files without a saved '
                      'model spec (the published ones).')
  parser.add_argument('--output', help='Folder the PNG files are written to; default: '
                      'WORKDIR/figures for a training workdir as --checkpoint.')
  parser.add_argument('--images', nargs='+', default=[], help='Image files to draw attention on.')
  parser.add_argument('--num_images', type=int, default=4,
                      help="Test images (of the run's image folder, else embedded) to draw on "
                      'when --images is not given.')
  parser.add_argument('--figures', nargs='+', choices=FIGURES, default=list(FIGURES),
                      metavar='FIGURE', help=f'Figures to draw, of {", ".join(FIGURES)} '
                      '(default: all that apply).')
  return parser.parse_args(argv)


def is_local(checkpoint: str) -> bool:
  """Whether --checkpoint is a local path, not a published name or a URL."""
  return not (published.is_name(checkpoint) or '://' in checkpoint)


def check_checkpoint_exists(checkpoint: str) -> None:
  """A FileNotFoundError where --checkpoint is a local path that does not exist (published
  names and URLs are checked as they load)."""
  if is_local(checkpoint) and not os.path.exists(checkpoint):
    raise FileNotFoundError(f'--checkpoint {checkpoint} does not exist: give a training workdir '
                            'or an .npz checkpoint.')


def draw_figures(args: argparse.Namespace) -> dict[str, Figure]:
  """The figures that `args` ask for and that apply to the checkpoint, by name."""
  name = args.model or (args.checkpoint if published.is_name(args.checkpoint) else
                        os.path.basename(os.path.normpath(args.checkpoint)))
  figures = {}
  if set(args.figures) - {'training_curves'}:
    model, params, image_size = load_model(args.checkpoint, args.model)
    if args.num_images < 1 and not args.images:
      raise ValueError(f'--num_images={args.num_images}: draw on at least 1 image.')
    paths = args.images or run_images(args.checkpoint, args.num_images)
    if paths:
      resize = runs.saved_framing(args.checkpoint, image_size, image_size)
      images = np.stack([image_files.load_image(path, image_size, resize) for path in paths])
    else:
      images = embedded_images(args.num_images, image_size)
    figures.update(model_figures(model, params, image_size, images, name, args.figures,
                                 trained_on_grey(args.checkpoint)))
  if 'training_curves' in args.figures and os.path.isdir(args.checkpoint):
    curves = analysis.read_scalars(args.checkpoint)
    if not {tag for _, tags in CURVE_PANELS for tag in tags} & set(curves):
      raise ValueError(f'No training scalars in {args.checkpoint}; found tags {sorted(curves)}.')
    figures['training_curves'] = plot_training_curves(curves, f'{name}: training')
  elif 'training_curves' in args.figures:
    print('Skipped training_curves: it needs a training workdir as --checkpoint.',
          file=sys.stderr)
  return figures


def output_folder(args: argparse.Namespace) -> str:
  """--output, or WORKDIR/figures where --checkpoint is a training workdir; a ValueError where
  neither is given."""
  if args.output:
    return args.output
  if os.path.isdir(args.checkpoint):
    return os.path.join(args.checkpoint, 'figures')
  raise ValueError(f'--checkpoint {args.checkpoint} is not a training workdir: give --output '
                   'FOLDER for the figures.')


def drawn_from(checkpoint: str, output: str) -> str:
  """What the figures in `output` are drawn from, as their PNG files record it: a published name
  or URL as given, else the checkpoint's path relative to `output` (which holds for a workdir
  moved with its figures folder)."""
  if not is_local(checkpoint):
    return checkpoint
  return os.path.relpath(os.path.abspath(checkpoint), os.path.abspath(output))


def check_not_overwriting(output: str, names: Sequence[str], source: str) -> None:
  """Raises a ValueError naming the first figure file of `names` in `output` that visualize did
  not draw from `source`: a figure of another checkpoint, or a file of the user's. The figures
  of the same checkpoint are drawn again in their place."""
  for name in names:
    path = os.path.join(output, f'{name}.png')
    if not os.path.lexists(path):
      continue
    try:
      with Image.open(path) as existing:
        text = getattr(existing, 'text', {})
    except (OSError, ValueError):
      text = {}
    if text.get('Software') == SOFTWARE and text.get('Source') == source:
      continue
    holds = (f'is a figure of {text["Source"]}' if text.get('Software') == SOFTWARE else
             'holds no record of visualize drawing it')
    raise ValueError(f'{path} exists and {holds}: move it, or give another --output (visualize '
                     'overwrites only its figures of the same checkpoint).')


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Writes the figures and prints their paths; returns the exit status, 1 for bad input."""
  args = parse_args(argv)
  try:
    check_checkpoint_exists(args.checkpoint)
    output = output_folder(args)
    source = drawn_from(args.checkpoint, output)
    check_not_overwriting(output, [name for name in args.figures if name != 'training_curves'
                                   or os.path.isdir(args.checkpoint)], source)
    errors.make_folder(output, f'--output {output}', '--output')
    figures = draw_figures(args)
  except (ValueError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  for figure_name in FIGURES:
    if figure_name in figures:
      path = os.path.join(output, f'{figure_name}.png')
      figures[figure_name].savefig(path, dpi=100,
                                   metadata={'Software': SOFTWARE, 'Source': source})
      print(path)
  return 0


if __name__ == '__main__':
  console.run(main)

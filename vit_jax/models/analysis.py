"""The numbers behind the figures of `python -m vit_jax.visualize` (paper Section 4.5, Figure 7).

Shapes: L layers, B images, N heads, T tokens (the class token first, if the model has one),
g_h x g_w = n the grid of patches, D hidden size, P patch size, C input channels.
Attention stacks are (L, B, N, T, T): query rows, key columns, each row summing to 1.

- `attention_rollout` and `token_to_patch_map`: where the class token (or, for `gap` models, the
  mean of the tokens) draws its information from (Abnar & Zuidema, 2020).
- `mean_attention_distance`: per layer and head, how far in pixels attention reaches.
- `position_similarity`: cosine similarity between the learned position embeddings.
- `embedding_filter_components`: principal components of the patch-embedding filters.
- `read_scalars`: the scalars a training run logged to TensorBoard.
"""
import collections
from collections.abc import Iterator
import functools
import os

import jax
import numpy as np

from vit_jax.models import vit

ATTENTION_MODULE = 'MultiHeadDotProductAttention_0'


@functools.partial(jax.jit, static_argnums=0)
def _sown_attention(model, params, images):
  _, state = model.apply({'params': params}, images, train=False, mutable=['intermediates'])
  transformer = state['intermediates']['Transformer']
  if 'encoderblock' in transformer:  # scan_layers=True: the layers come stacked, (L, B, N, T, T).
    return list(transformer['encoderblock'][ATTENTION_MODULE]['attention_weights'][0])
  return [transformer[f'encoderblock_{i}'][ATTENTION_MODULE]['attention_weights'][0]
          for i in range(model.num_layers)]


def attention_weights(model: vit.VisionTransformer, params, images) -> np.ndarray:
  """The attention of every layer on (B, H, W, 3) images in [-1, 1]: (L, B, N, T, T) float32."""
  return np.stack([np.asarray(a, np.float32) for a in _sown_attention(model, params, images)])


def attention_rollout(attention: np.ndarray) -> np.ndarray:
  """Attention rollout: (L, B, N, T, T) -> (B, T, T), how much each token draws on each input.

  Each layer's attention is averaged over heads, the identity is added for the residual
  connection, rows are renormalised to sum 1, and the layers are multiplied from the first on.
  """
  mixing = attention.mean(axis=2) + np.eye(attention.shape[-1], dtype=attention.dtype)
  mixing /= mixing.sum(axis=-1, keepdims=True)
  rollout = mixing[0]
  for layer in mixing[1:]:
    rollout = layer @ rollout
  return rollout


def token_to_patch_map(matrix: np.ndarray, grid: tuple[int, int], class_token: bool) -> np.ndarray:
  """The weights of the patches, as a (..., g_h, g_w) map, in a (..., T, T) token matrix.

  Read from the class token's row when there is one, else from the mean of all rows (the pooled
  representation of a `gap` model). The class token's own column is dropped, so a map of a
  model with a class token sums to at most 1.
  """
  if class_token:
    weights = matrix[..., 0, 1:]
  else:
    weights = matrix.mean(axis=-2)
  if weights.shape[-1] != grid[0] * grid[1]:
    raise ValueError(f'{weights.shape[-1]} patch tokens do not fill a {grid[0]}x{grid[1]} grid '
                     f'(class_token={class_token}).')
  return weights.reshape(weights.shape[:-1] + tuple(grid))


def patch_distances(grid: tuple[int, int], pixels: tuple[int, int]) -> np.ndarray:
  """(n, n) Euclidean distances in pixels between the centres of the patches, row-major."""
  rows, cols = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing='ij')
  centres = np.stack([rows.ravel() * pixels[0], cols.ravel() * pixels[1]], axis=-1)
  return np.linalg.norm(centres[:, None] - centres[None], axis=-1)


def mean_attention_distance(attention: np.ndarray, grid: tuple[int, int],
                            pixels: tuple[int, int], class_token: bool) -> np.ndarray:
  """Attention-weighted mean query-key distance in pixels: (L, B, N, T, T) -> (L, N).

  `pixels` is the size of a patch in input pixels (the model's `patch_pixels`). Only patch
  tokens count: the class token's row and column are dropped and each query's weights
  renormalised over the patch keys. The distance is averaged over the queries and the B images.
  """
  if class_token:
    attention = attention[..., 1:, 1:]
  attention = attention / attention.sum(axis=-1, keepdims=True)
  distances = patch_distances(grid, pixels)
  if attention.shape[-1] != len(distances):
    raise ValueError(f'{attention.shape[-1]} patch tokens do not fill a {grid[0]}x{grid[1]} '
                     f'grid (class_token={class_token}).')
  per_query = np.einsum('lbnqk,qk->lbnq', attention, distances)
  return per_query.mean(axis=(1, 3))


def position_similarity(pos_embedding: np.ndarray, grid: tuple[int, int],
                        class_token: bool) -> np.ndarray:
  """Cosine similarity of each patch's position embedding with every other one.

  `pos_embedding` is (1, T, D) as in the parameter tree. Returns (g_h, g_w, g_h, g_w): entry
  [i, j] is the (g_h, g_w) map of similarities of position (i, j) with all positions.
  """
  posemb = np.asarray(pos_embedding, np.float64).reshape(-1, pos_embedding.shape[-1])
  if class_token:
    posemb = posemb[1:]
  if len(posemb) != grid[0] * grid[1]:
    raise ValueError(f'{len(posemb)} patch position embeddings do not fill a '
                     f'{grid[0]}x{grid[1]} grid (class_token={class_token}).')
  unit = posemb / np.linalg.norm(posemb, axis=-1, keepdims=True)
  return (unit @ unit.T).reshape(tuple(grid) * 2)


def embedding_filter_components(kernel: np.ndarray, num_components: int = 28,
                                grey_input: bool = False):
  """Principal components of the D patch-embedding filters of a (P, P, C, D) kernel.

  Returns the components, (K, P, P, C) unit vectors ordered by decreasing variance, and the
  fraction of the filters' variance each explains, (K,); K = min(num_components, D - 1, P*P*C),
  as the D centred filters span at most D - 1 dimensions.
  Each component's sign is arbitrary.
  With `grey_input` (a model trained on grey images repeated into its C channels) a filter acts
  on an image as the sum of its channels: the components are of those sums, (K, P, P, 1).
  """
  kernel = np.asarray(kernel, np.float64)
  if grey_input:
    kernel = kernel.sum(axis=2, keepdims=True)
  filters = kernel.reshape(-1, kernel.shape[-1]).T  # (D, P*P*C)
  centred = filters - filters.mean(axis=0)
  _, singular_values, components = np.linalg.svd(centred, full_matrices=False)
  variance = singular_values**2
  k = min(num_components, len(filters) - 1, len(variance))
  return (components[:k].reshape((k,) + kernel.shape[:-1]),
          variance[:k] / variance.sum())


def _event_records(path: str) -> Iterator[bytes]:
  """The records of a TFRecord file of TensorBoard events, in order. Each record is its length
  (uint64, little-endian), that length's checksum, the data and the data's checksum (4 bytes
  each); reading stops at a record cut short, as a killed writer leaves one."""
  with open(path, 'rb') as f:
    while len(header := f.read(12)) == 12:
      length = int.from_bytes(header[:8], 'little')
      data = f.read(length)
      if len(data) < length or len(f.read(4)) < 4:
        return
      yield data


def _logged_points(path: str, plugins: dict[str, str]) -> Iterator[tuple[str, int, float]]:
  """(tag, step, value) of each scalar in the event file at `path`: tensor summaries whose
  tag the scalars plugin owns (`clu.metric_writers`; a writer names a tag's plugin the first
  time it writes the tag, which `plugins` collects) and legacy scalar summaries."""
  from tensorboard.compat.proto import event_pb2  # TensorBoard's own protos: no TensorFlow.
  from tensorboard.util import tensor_util

  for record in _event_records(path):
    event = event_pb2.Event.FromString(record)
    for value in event.summary.value:
      if value.metadata.plugin_data.plugin_name:
        plugins[value.tag] = value.metadata.plugin_data.plugin_name
      if value.HasField('simple_value'):
        yield value.tag, event.step, value.simple_value
      elif value.HasField('tensor') and plugins.get(value.tag) == 'scalars':
        yield value.tag, event.step, float(tensor_util.make_ndarray(value.tensor))


def read_scalars(workdir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """The scalars logged in `workdir`'s TensorBoard event files: {tag: (steps, values)}.

  Reads both tensor summaries (as `clu.metric_writers` writes them) and legacy scalar
  summaries, from the files in the order of their names (each begins with the time it was
  started). Steps are sorted; a step logged twice (a resumed run) keeps its last value.
  """
  if not os.path.isdir(workdir):
    raise FileNotFoundError(f'No training workdir at {workdir!r}.')
  logged, plugins = collections.defaultdict(dict), {}
  for name in sorted(os.listdir(workdir)):
    if 'tfevents' in name and os.path.isfile(os.path.join(workdir, name)):
      for tag, step, value in _logged_points(os.path.join(workdir, name), plugins):
        logged[tag][step] = value
  curves = {}
  for tag, by_step in logged.items():
    steps = np.array(sorted(by_step))
    curves[tag] = steps, np.array([by_step[s] for s in steps], np.float64)
  return curves

"""Where the Vision Transformer gets position information: the kinds of `posemb`.

Appendix D.4 of the paper (Table 8) compares ways of telling the Transformer where each patch
is; `VisionTransformer.posemb` (and `config.posemb`) chooses one. P = h*w patches on a grid of
h rows and w columns, D hidden size, N heads, K = D/N head size.

- `learned_1d` (the default, the published checkpoints): one learned embedding per token,
  `Transformer/posembed_input/pos_embedding` (1, [1 +] P, D), the class token's first.
- `none`: no position information; the patches are a set.
- `learned_2d`: learned row embeddings `Transformer/posembed_input/row_embedding` (h, D/2) and
  column embeddings `.../column_embedding` (w, D/2); the patch in row r and column c gets
  concat(row[r], column[c]) added.
- `relative`: 1-D relative attention. Each block's attention has a learned embedding per offset
  between a query patch i and a key patch j (raster order), `.../MultiHeadDotProductAttention_0/
  relative_embedding` (2P - 1, N, K), entry P - 1 + i - j. The (scaled) queries attend to them
  as keys, and those logits are added to the content logits before the softmax
  (`relative_logits`). The attention then takes XLA's path, since the padded cuDNN kernel here
  takes no bias.
- `sincos_2d`: fixed sines and cosines of the row and of the column (`sincos_2d`); no
  parameters.

With `dynamic_img_size` (a VisionTransformer field, off in training) the learned tables of
`learned_1d` and `learned_2d` are interpolated at apply time to the grid of each image
(`resize_grid`, `learned_table`): bilinearly with corners aligned, as fine-tuning resizes them
at load (vit_jax.checkpoints.finetune); on the grid they were made for they are used as they
are. `sincos_2d` and `none` fit any grid anyway; `relative`'s offsets are 1-D over the raster
and have no meaning on a grid of another width, so it refuses `dynamic_img_size`.

In every kind but `learned_1d` the class token gets no position: its own learned `cls` vector
already is what a position embedding of it would add, and it has no place on the grid. Under
`relative` its logits get no bias.
"""
import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from vit_jax.sharding import with_axes

POSEMB_KINDS = ('learned_1d', 'none', 'learned_2d', 'relative', 'sincos_2d')
# The parameters of the learned kinds other than learned_1d, by the last name of their paths.
ROW, COLUMN, RELATIVE = 'row_embedding', 'column_embedding', 'relative_embedding'
SINCOS_TEMPERATURE = 10_000.0  # The longest wavelength, in patches, is 2 pi times this.
_INIT = nn.initializers.normal(stddev=0.02)  # As learned_1d's.


def check_posemb(posemb: str, hidden_size: int) -> None:
  """Raises a ValueError for an unknown kind, or a hidden size the kind cannot split."""
  if posemb not in POSEMB_KINDS:
    raise ValueError(f'posemb={posemb!r}; choose one of {POSEMB_KINDS}.')
  parts = {'learned_2d': 2, 'sincos_2d': 4}.get(posemb, 1)
  if hidden_size % parts:
    raise ValueError(f'posemb={posemb!r} splits the hidden size into {parts} equal parts, but '
                     f'hidden_size={hidden_size} is not divisible by {parts}.')


def sincos_2d(grid: tuple[int, int], width: int,
              temperature: float = SINCOS_TEMPERATURE) -> np.ndarray:
  """Fixed embeddings (h*w, width) float32 of the patches of a grid (h, w), row by row.

  With F = width/4 frequencies f_i = temperature**(-i/F), i < F, the patch in row r and column
  c gets [sin(r f_0..F-1), cos(r f), sin(c f), cos(c f)]: the first half tells its row, the
  second its column, as learned_2d's halves do.
  """
  quarter = width // 4
  frequencies = temperature ** (-np.arange(quarter) / quarter)
  rows, columns = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing='ij')
  row_angles = rows.reshape(-1, 1) * frequencies
  column_angles = columns.reshape(-1, 1) * frequencies
  return np.concatenate([np.sin(row_angles), np.cos(row_angles), np.sin(column_angles),
                         np.cos(column_angles)], axis=1).astype(np.float32)


def interpolation_matrix(size: int, new_size: int) -> np.ndarray:
  """(new_size, size) float32: linear interpolation of `size` samples to `new_size`, ends
  aligned (new sample i lies at i * (size - 1) / (new_size - 1) of the old ones), as
  scipy.ndimage.zoom(order=1) interpolates: the first and last samples are kept."""
  source = np.arange(new_size) * (size - 1) / max(new_size - 1, 1)
  low = np.minimum(np.floor(source).astype(int), max(size - 2, 0))
  high = np.minimum(low + 1, size - 1)
  matrix = np.zeros((new_size, size), np.float32)
  np.add.at(matrix, (np.arange(new_size), low), 1 - (source - low))
  np.add.at(matrix, (np.arange(new_size), high), source - low)
  return matrix


def resize_grid(table, grid: tuple[int, int], new_grid: tuple[int, int]):
  """Embeddings (h*w, D) of a grid (h, w), row by row, interpolated bilinearly (corners aligned)
  to a grid (h', w'): (h'*w', D); `table` itself where the grids are the same."""
  if tuple(grid) == tuple(new_grid):
    return table
  rows = interpolation_matrix(grid[0], new_grid[0])
  columns = interpolation_matrix(grid[1], new_grid[1])
  resized = jnp.einsum('ih,jw,hwd->ijd', rows, columns, table.reshape(*grid, -1))
  return resized.reshape(new_grid[0] * new_grid[1], -1).astype(table.dtype)


def learned_table(module: nn.Module, name: str, shape: tuple[int, ...], *axes,
                  dynamic: bool = False) -> jnp.ndarray:
  """`module`'s learned parameter `name` of `shape` (logical `axes`). When an existing one was
  made for another grid (its first axis differs): with `dynamic`, it interpolated along that
  axis to `shape` (`interpolation_matrix`); otherwise a ValueError naming both shapes."""
  if module.has_variable('params', name):
    found = tuple(module.get_variable('params', name).shape)
    if dynamic and found[1:] == tuple(shape[1:]):
      table = module.param(name, with_axes(_INIT, *axes), found)
      return jnp.einsum('in,n...->i...', interpolation_matrix(found[0], shape[0]),
                        table).astype(table.dtype)
    if found != tuple(shape):
      raise ValueError(
          f'The image gives position tables of shape {tuple(shape)} but {name} has shape '
          f'{found}. Resize the images to the resolution the model was built for, resize the '
          'position embeddings (vit_jax.checkpoints.finetune.load_pretrained does it), or apply '
          'the model with dynamic_img_size=True.')
  return module.param(name, with_axes(_INIT, *axes), shape)


def grid_table(rows, columns):
  """learned_2d's embeddings (h*w, D) of the patches, row by row, from the tables of rows
  (h, D/2) and columns (w, D/2): the patch in row r and column c gets concat(rows[r],
  columns[c])."""
  h, w = rows.shape[0], columns.shape[0]
  return jnp.concatenate([jnp.broadcast_to(rows[:, None], (h, w, rows.shape[1])),
                          jnp.broadcast_to(columns[None], (h, w, columns.shape[1]))],
                         axis=-1).reshape(h * w, -1)


def patch_embeddings(params, posemb: str, grid: tuple[int, int]) -> np.ndarray:
  """The embeddings (1, h*w, D) that `params` of a model of kind `posemb` add to the patches
  of a grid (h, w), the class token's left out; a ValueError for the kinds that add none."""
  inputs = params['Transformer'].get('posembed_input', {})
  if posemb == 'learned_1d':
    table = inputs['pos_embedding'][0, -grid[0] * grid[1]:]
  elif posemb == 'learned_2d':
    table = grid_table(inputs[ROW], inputs[COLUMN])
  elif posemb == 'sincos_2d':
    table = sincos_2d(grid, params['embedding']['kernel'].shape[-1])
  else:
    raise ValueError(f'posemb={posemb!r} adds no embedding to each position; only '
                     "'learned_1d', 'learned_2d' and 'sincos_2d' do.")
  return np.asarray(table)[None]


class AddGridPositions(nn.Module):
  """Adds `learned_2d` or `sincos_2d` embeddings to the patch tokens, the last h*w of (B, T, D)
  inputs; `none` and `relative` return the inputs as they are. With `dynamic`, learned_2d's
  tables of another grid are interpolated to this one (`learned_table`)."""
  posemb: str
  dynamic: bool = False

  @nn.compact
  def __call__(self, x, grid: tuple[int, int]):
    h, w = grid
    d = x.shape[-1]
    if self.posemb == 'learned_2d':
      table = grid_table(learned_table(self, ROW, (h, d // 2), 'seq', 'embed',
                                       dynamic=self.dynamic),
                         learned_table(self, COLUMN, (w, d // 2), 'seq', 'embed',
                                       dynamic=self.dynamic))
    elif self.posemb == 'sincos_2d':
      table = jnp.asarray(sincos_2d(grid, d))
    else:
      return x
    return x.at[:, x.shape[1] - h * w:].add(table.astype(x.dtype))


def offset_index(num_patches: int) -> np.ndarray:
  """(P, P) int: entry [i, j] is the row of the relative table of query i and key j,
  P - 1 + i - j."""
  positions = np.arange(num_patches)
  return num_patches - 1 + positions[:, None] - positions[None, :]


def relative_logits(q, table):
  """The relative attention's logits, (B, N, T, T), from queries q (B, N, T, K) whose last P
  tokens are the patches and the table (2P - 1, N, K) of offset embeddings.

  Entry [b, n, i, j] is q[b, n, i] . table[P - 1 + (i - j), n] for patch tokens i and j, and
  0 where either is a token before them (the class token).
  """
  num_patches = (table.shape[0] + 1) // 2
  extra = q.shape[2] - num_patches
  per_offset = jnp.einsum('bnqk,onk->bnqo', q[:, :, extra:], table)  # (B, N, P, 2P - 1).
  bias = per_offset[:, :, np.arange(num_patches)[:, None], offset_index(num_patches)]
  return jnp.pad(bias, ((0, 0), (0, 0), (extra, 0), (extra, 0)))

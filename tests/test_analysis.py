"""Tests of the numbers behind the figures, vit_jax/models/analysis.py."""
import numpy as np
import pytest

from helpers import images_of
from helpers import random_params
from helpers import tiny_vit
from vit_jax.models import analysis


def uniform_attention_params(model, image_size):
  """Random parameters, except zero query projections: every logit is 0, attention is uniform."""
  params = random_params(model, image_size, scale=0.3)
  for i in range(model.num_layers):
    query = params['Transformer'][f'encoderblock_{i}']['MultiHeadDotProductAttention_0']['query']
    query['kernel'], query['bias'] = 0 * query['kernel'], 0 * query['bias']
  return params


def identity_attention(tokens, num_layers=3, batch=2, heads=2):
  """(L, B, N, T, T) attention in which every token only looks at itself."""
  return np.broadcast_to(np.eye(tokens, dtype=np.float32),
                         (num_layers, batch, heads, tokens, tokens))


def mean_uniform_distance(grid, pixels):
  """Mean distance between two patches drawn uniformly from the grid, summed over offsets.

  The offset (dr, dc) occurs for (g_h - |dr|) * (g_w - |dc|) of the n^2 ordered pairs.
  """
  (gh, gw), (ph, pw) = grid, pixels
  dr, dc = np.meshgrid(np.arange(1 - gh, gh), np.arange(1 - gw, gw), indexing='ij')
  pairs = (gh - abs(dr)) * (gw - abs(dc))
  return (pairs * np.hypot(dr * ph, dc * pw)).sum() / (gh * gw)**2


def test_rollout_of_identity_attention_gives_uniform_maps():
  token_maps = analysis.token_to_patch_map(
      analysis.attention_rollout(identity_attention(17)), (4, 4), class_token=True)
  assert token_maps.shape == (2, 4, 4)
  np.testing.assert_array_equal(token_maps, 0)  # The class token only ever saw itself.
  gap_maps = analysis.token_to_patch_map(
      analysis.attention_rollout(identity_attention(16)), (4, 4), class_token=False)
  np.testing.assert_allclose(gap_maps, 1 / 16)  # The token mean draws equally on each patch.


def test_rollout_averages_heads_adds_residual_and_multiplies_from_the_first_layer():
  rng = np.random.default_rng(0)
  attention = rng.dirichlet(np.ones(5), size=(3, 2, 4, 5)).astype(np.float32)  # (L, B, N, T, T)
  mixing = [(a.mean(axis=1) + np.eye(5)) / 2 for a in attention]
  expected = mixing[2] @ mixing[1] @ mixing[0]
  rollout = analysis.attention_rollout(attention)
  np.testing.assert_allclose(rollout, expected, rtol=1e-5)
  np.testing.assert_allclose(rollout.sum(-1), 1, rtol=1e-5)


@pytest.mark.parametrize('classifier', ['token', 'gap'])
def test_model_with_uniform_attention_gives_uniform_maps_and_closed_form_distance(classifier):
  model, images = tiny_vit(classifier=classifier), images_of()
  params = uniform_attention_params(model, image_size=16)
  attention = analysis.attention_weights(model, params, images)
  tokens = 17 if classifier == 'token' else 16
  assert attention.shape == (2, 2, 3, tokens, tokens)
  np.testing.assert_allclose(attention, 1 / tokens, rtol=1e-5)

  class_token = model.has_class_token
  grid, pixels = model.grid(16), model.patch_pixels
  assert grid == (4, 4) and pixels == (4, 4)
  maps = analysis.token_to_patch_map(analysis.attention_rollout(attention), grid, class_token)
  np.testing.assert_allclose(maps, np.broadcast_to(maps[:, :1, :1], maps.shape), rtol=1e-5)
  distances = analysis.mean_attention_distance(attention, grid, pixels, class_token)
  np.testing.assert_allclose(distances, mean_uniform_distance(grid, pixels), rtol=1e-5)


def test_mean_attention_distance_of_self_attention_is_zero():
  distances = analysis.mean_attention_distance(identity_attention(17, heads=4), (4, 4), (16, 16),
                                               class_token=True)
  np.testing.assert_array_equal(distances, np.zeros((3, 4)))


@pytest.mark.parametrize('grid,pixels,expected', [
    # One row of g patches, w px wide: E|i - j| = (g^2 - 1) / (3 g) patches.
    ((1, 7), (16, 8), (7**2 - 1) / (3 * 7) * 8),
    ((5, 3), (4, 6), None),
])
def test_mean_attention_distance_of_uniform_attention_matches_closed_form(grid, pixels, expected):
  tokens = 1 + grid[0] * grid[1]
  uniform = np.full((2, 1, 3, tokens, tokens), 1 / tokens, np.float32)
  distances = analysis.mean_attention_distance(uniform, grid, pixels, class_token=True)
  expected = mean_uniform_distance(grid, pixels) if expected is None else expected
  np.testing.assert_allclose(distances, np.full((2, 3), expected), rtol=1e-5)


def sinusoid_posemb(grid, frequencies):
  """(1, T, D) embeddings [sin, cos](row * f), [sin, cos](col * f): similarity depends on offset."""
  rows, cols = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing='ij')
  angles = [x.reshape(-1, 1) * frequencies for x in (rows, cols)]
  features = np.concatenate([f(a) for a in angles for f in (np.sin, np.cos)], axis=-1)
  return features[None]


def test_position_similarity_of_2d_sinusoid_peaks_on_the_diagonal_and_decays_with_distance():
  grid = (4, 6)
  # Frequencies below pi / 5 keep every cosine decreasing over the grid's offsets.
  frequencies = np.array([0.1, 0.3, 0.6])
  posemb = sinusoid_posemb(grid, frequencies)
  cls = np.random.default_rng(0).normal(size=(1, 1, posemb.shape[-1]))
  similarity = analysis.position_similarity(np.concatenate([cls, posemb], axis=1), grid,
                                            class_token=True)
  assert similarity.shape == (4, 6, 4, 6)
  flat = similarity.reshape(24, 24)
  np.testing.assert_allclose(np.diag(flat), 1)
  np.testing.assert_array_equal(flat.argmax(axis=1), np.arange(24))
  # cos(a - b) = sin a sin b + cos a cos b: each entry is the mean cosine of the offsets.
  dr = np.arange(4)[:, None, None, None] - np.arange(4)[None, None, :, None]
  dc = np.arange(6)[None, :, None, None] - np.arange(6)[None, None, None, :]
  expected = (np.cos(dr[..., None] * frequencies).mean(-1)
              + np.cos(dc[..., None] * frequencies).mean(-1)) / 2
  np.testing.assert_allclose(similarity, expected, atol=1e-12)
  assert similarity[0, 0, 0, 1] > similarity[0, 0, 0, 2] > similarity[0, 0, 0, 5]
  assert similarity[0, 0, 1, 0] > similarity[0, 0, 3, 0]


def test_embedding_filter_components_recover_planted_directions():
  rng = np.random.default_rng(0)
  u, v = np.linalg.qr(rng.normal(size=(4 * 4 * 3, 2)))[0].T  # Orthonormal filter directions.
  # Orthonormal columns, the first constant: the others have zero mean over the D filters.
  q = np.linalg.qr(np.column_stack([np.ones(10), rng.normal(size=(10, 2))]))[0]
  a, b = 3 * q[:, 1], q[:, 2]  # Per-filter weights of u and v: variances 9 : 1.
  mean_filter = rng.normal(size=4 * 4 * 3)
  filters = a[:, None] * u + b[:, None] * v + mean_filter  # (D=10, P*P*C)
  kernel = filters.T.reshape(4, 4, 3, 10)
  components, variance_ratio = analysis.embedding_filter_components(kernel, num_components=28)
  assert components.shape == (9, 4, 4, 3)  # 10 centred filters span at most 9 dimensions.
  np.testing.assert_allclose(abs(components[0].ravel() @ u), 1, atol=1e-6)
  np.testing.assert_allclose(abs(components[1].ravel() @ v), 1, atol=1e-6)
  np.testing.assert_allclose(variance_ratio[:2], [0.9, 0.1], atol=1e-6)


def test_read_scalars_sorts_steps_and_keeps_the_last_value_of_a_resumed_run(tmp_path):
  from clu import metric_writers  # It imports TensorFlow.
  for run, steps in enumerate([(10, 20, 30), (30, 40)]):
    writer = metric_writers.create_default_writer(str(tmp_path))
    for step in steps:
      writer.write_scalars(step, {'train_loss': 1 / step + run, 'learning_rate': 1e-3})
    writer.write_texts(steps[0], {'note': 'not a scalar'})
    writer.close()
  curves = analysis.read_scalars(str(tmp_path))
  assert set(curves) == {'train_loss', 'learning_rate'}
  steps, loss = curves['train_loss']
  np.testing.assert_array_equal(steps, [10, 20, 30, 40])
  np.testing.assert_allclose(loss, [0.1, 0.05, 1 + 1 / 30, 1.025], rtol=1e-6)


def test_read_scalars_reads_what_tensorboard_reads_and_stops_at_a_record_cut_short(tmp_path):
  from clu import metric_writers  # It imports TensorFlow.
  from tensorboard.backend.event_processing import event_accumulator
  from tensorboard.util import tensor_util
  writer = metric_writers.create_default_writer(str(tmp_path))
  writer.write_texts(1, {'note': 'not a scalar'})
  for step in (1, 2, 3):
    writer.write_scalars(step, {'train_loss': 2.5 / step, 'images_per_second': 100.0 * step})
  writer.close()
  events = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={'tensors': 0})
  events.Reload()
  tensorboard = {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                       for e in events.Tensors(tag)] for tag in ('train_loss', 'images_per_second')}
  read = {tag: list(zip(steps.tolist(), values.tolist()))
          for tag, (steps, values) in analysis.read_scalars(str(tmp_path)).items()}
  assert read == tensorboard and len(read['train_loss']) == 3
  # A writer killed mid-record: the points before the cut are read, and nothing fails.
  [path] = tmp_path.glob('*tfevents*')
  path.write_bytes(path.read_bytes()[:-10])
  cut = {tag: list(zip(steps.tolist(), values.tolist()))
         for tag, (steps, values) in analysis.read_scalars(str(tmp_path)).items()}
  assert sum(map(len, cut.values())) == 5
  assert all(cut[tag] == tensorboard[tag][:len(cut[tag])] for tag in tensorboard)


def test_grid_that_does_not_fit_the_tokens_is_a_clear_error():
  with pytest.raises(ValueError, match='16 patch tokens do not fill a 3x5 grid'):
    analysis.token_to_patch_map(np.eye(17), (3, 5), class_token=True)
  with pytest.raises(ValueError, match='16 patch position embeddings do not fill a 4x5 grid'):
    analysis.position_similarity(np.ones((1, 17, 8)), (4, 5), class_token=True)


def test_grey_input_components_are_of_the_channel_sums():
  rng = np.random.default_rng(0)
  u = rng.normal(size=(4, 4))
  u /= np.linalg.norm(u)  # The one direction in which the filters' channel sums vary.
  # Large differences between the channels, which a grey image (equal channels) does not see.
  unseen = 5 * rng.normal(size=(4, 4, 3, 10))
  unseen -= unseen.mean(axis=2, keepdims=True)
  kernel = unseen + u[:, :, None, None] * rng.normal(size=10) / 3
  components, variance_ratio = analysis.embedding_filter_components(kernel, grey_input=True)
  assert components.shape == (9, 4, 4, 1)
  np.testing.assert_allclose(abs(components[0].ravel() @ u.ravel()), 1, atol=1e-6)
  np.testing.assert_allclose(variance_ratio[0], 1, atol=1e-6)

"""What training builds before its first step, free of TensorFlow: the device mesh, the model and
the evaluation step. `trainer` trains with them, and `tools.plan` compiles the same step for
TPU slices that are not there.
"""
from typing import Any, Callable

import jax
from jax.experimental import mesh_utils
import jax.numpy as jnp
from jax.sharding import Mesh
import ml_collections
import numpy as np

from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import npz
from vit_jax.config.checks import data_parallel_size, mesh_error, pretrained_file
from vit_jax.errors import ConfigError
from vit_jax.models import attention
from vit_jax.models import registry
from vit_jax.tasks import mpp
from vit_jax.training.step import Batch, cross_entropy

# Fields of a pretrained file's model spec that fine-tuning keeps: they change what the weights
# compute without changing their shapes. The others are the config's to choose (classes,
# dropout) or must match it (the shapes, which load_pretrained checks).
PRETRAINED_FIELDS = ('approximate_gelu',)
MESH_AXES = ('data', 'model')


def slice_count(devices) -> int:
  """The TPU slices (joined by the data-centre network) that `devices` span; 1 elsewhere."""
  return len({getattr(device, 'slice_index', 0) for device in devices})


def make_mesh(config: ml_collections.ConfigDict, devices=None) -> Mesh:
  """A ('data', 'model') mesh over `devices` (all by default); `mesh.data = -1` takes the rest.

  Laid out for the hardware by jax's mesh_utils: on a TPU slice, neighbours along each mesh axis
  are neighbours on the chips' interconnect (ICI). Over several slices (multi-slice) the mesh is
  hybrid: the slices split 'data' only, so that only the gradients' all-reduce crosses the
  slower data-centre network, while 'model' (tensor parallelism) and each slice's share of
  'data' (and fsdp) stay within a slice.
  """
  devices = list(jax.devices() if devices is None else np.ravel(devices))
  if error := mesh_error(config, len(devices)):
    raise ConfigError(error)
  shape = (data_parallel_size(config, len(devices)), config.mesh.model)
  slices = slice_count(devices)
  if slices == 1:
    return Mesh(mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True),
                MESH_AXES)
  if shape[0] % slices:
    raise ConfigError(f'config.mesh data={shape[0]} does not split over the {slices} slices: '
                      f'make it a multiple of {slices} (data=-1 does).')
  return Mesh(mesh_utils.create_hybrid_device_mesh(
      (shape[0] // slices, shape[1]), (slices, 1), devices, allow_split_physical_axes=True),
              MESH_AXES)


def pretrained_overrides(config: ml_collections.ConfigDict) -> dict:
  """The PRETRAINED_FIELDS of the model spec saved in `config.pretrained_path` (e.g. the exact
  GELU of converted Hugging Face or timm weights); for files without a spec, the fields of a
  FILE.overrides.json next to it (deprecated); {} without either."""
  if not config.pretrained_path:
    return {}
  try:
    spec = npz.read_spec(pretrained_file(config))
    if spec is None:
      return finetune.load_model_overrides(pretrained_file(config))
    return {f: spec['model'][f] for f in PRETRAINED_FIELDS if f in spec.get('model', {})}
  except (npz.CheckpointError, FileNotFoundError) as e:
    raise ConfigError(str(e)) from None


def build_model(config: ml_collections.ConfigDict, num_classes: int, devices=None):
  """The VisionTransformer of `config.model` with the config's dtype, scan, remat and attention
  settings (`auto` resolved for `devices`, by default jax.devices()) and the PRETRAINED_FIELDS
  of the pretrained checkpoint; an mpp.MaskedPatchViT under the masked-patch-prediction
  objective."""
  model = registry.get_model(config.model, num_classes=num_classes, **{
      **pretrained_overrides(config), 'dtype': jnp.dtype(config.dtype),
      'scan_layers': config.scan_layers, 'remat_policy': config.remat_policy,
      'posemb': config.posemb,
      'attention': attention.resolve_attention(config.attention, devices or jax.devices())})
  if config.objective == 'masked_patch_prediction':
    return mpp.with_mpp(model, config.mpp.target)
  return model


TOP_K = 5  # Top-5 accuracy is reported for models of more classes than this only.


def make_eval_step(model) -> Callable[[Any, Batch], dict]:
  """eval(params, batch) -> sums over the unmasked examples: correct (top-1), loss, count, and
  with more than TOP_K classes correct_top5 (label among the TOP_K highest logits; with fewer
  classes it would count every example)."""

  def eval_step(params, batch):
    logits = model.apply({'params': params}, batch['image'], train=False)
    mask = batch['mask'].astype(jnp.float32)
    labels = batch['label']
    sums = {'correct': jnp.sum((jnp.argmax(logits, -1) == labels) * mask),
            'loss': jnp.sum(cross_entropy(logits, labels) * mask),
            'count': jnp.sum(mask)}
    if logits.shape[-1] > TOP_K:
      _, top = jax.lax.top_k(logits, TOP_K)
      sums['correct_top5'] = jnp.sum(jnp.any(top == labels[:, None], axis=-1) * mask)
    return sums

  return eval_step


def objective_eval_step(model, config: ml_collections.ConfigDict) -> Callable[[Any, Batch], dict]:
  """The evaluation step of config.objective: `make_eval_step`, or mpp's under masked patch
  prediction; not yet jitted."""
  if config.objective == 'masked_patch_prediction':
    return mpp.make_eval_step(model, config)
  return make_eval_step(model)

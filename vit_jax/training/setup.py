"""What training builds before its first step, free of TensorFlow: the device mesh and the model,
as config.objective's task wraps it (its loss and evaluation step are the task's,
vit_jax.tasks). `trainer` trains with them, and `tpu_plan` compiles the same step for TPU
slices that are not there.
"""
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
from vit_jax import tasks
from vit_jax.models import attention
from vit_jax.models import registry
# The supervised evaluation step, by its old name here (the notebook's train_setup.make_eval_step).
from vit_jax.tasks.supervised import make_eval_step  # noqa: F401

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
  of the pretrained checkpoint, as config.objective's task wraps it (vit_jax.tasks: e.g. an
  mpp.MaskedPatchViT under masked patch prediction)."""
  model = registry.get_model(config.model, num_classes=num_classes, **{
      **pretrained_overrides(config), 'dtype': jnp.dtype(config.dtype),
      'scan_layers': config.scan_layers, 'remat_policy': config.remat_policy,
      'posemb': config.posemb,
      'attention': attention.resolve_attention(config.attention, devices or jax.devices())})
  return tasks.for_config(config).model(model, config)


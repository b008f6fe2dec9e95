"""The training step of a config compiled for a Cloud TPU slice that is not there: the devices
of the slice made compile-only (vit_jax.tpu_topologies), the step lowered as vit_jax.main would
lower it (vit_jax.training.fit.lower_train_step) and compiled by libtpu's compiler, then its
memory per chip against the chip's HBM, its FLOPs and a roofline bound on its time. No TPU, no
dataset and no TensorFlow. `python -m vit_jax.plan` (vit_jax/tools/plan.py) is its command;
benchmarks/tpu_plans.py runs it over the presets.

    topology = tpu_topologies.parse_topology('v5e-16', slices=1)
    tpu_topologies.use_tpu_compiler_only(topology)
    result = tpu_plan.plan(config, topology, tpu_plan.num_classes_of(config, None))
"""
import importlib.metadata
import logging
import math
import re
import time

import jax
import jax.numpy as jnp
import ml_collections

from vit_jax import tasks
from vit_jax import tpu_topologies
from vit_jax.config import checks
from vit_jax.models import attention
from vit_jax.training import fit
from vit_jax.training import setup as train_setup
from vit_jax.training import step as train_step


# Classes of the datasets the configs name, for the head (a dataset elsewhere: --num_classes).
DATASET_CLASSES = {'fashion_mnist_embedded': 10, 'cifar10': 10, 'cifar100': 100,
                   'imagenet2012': 1000, 'imagenet21k': 21843, 'oxford_iiit_pet': 37,
                   'oxford_flowers102': 102, 'mnist': 10, 'fashion_mnist': 10}


class PlanError(ValueError):
  """An option that cannot be planned (one line)."""


def num_classes_of(config: ml_collections.ConfigDict, given) -> int:
  """--num_classes, or the classes of config.dataset (DATASET_CLASSES)."""
  if given:
    return given
  if config.dataset not in DATASET_CLASSES:
    raise PlanError(f'The classes of config.dataset={config.dataset!r} are not known here: '
                    'give --num_classes.')
  return DATASET_CLASSES[config.dataset]


def shard_bytes(tree) -> int:
  """Bytes of the first device's shard of each ShapeDtypeStruct in `tree`, summed."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    total += jnp.dtype(leaf.dtype).itemsize * math.prod(leaf.sharding.shard_shape(leaf.shape))
  return total


def roofline(flops: float, bytes_accessed: float, generation: tpu_topologies.Generation) -> float:
  """A lower bound on the seconds of a step: its FLOPs at the chip's bf16 peak, or its HBM
  traffic at the chip's bandwidth, whichever takes longer."""
  return max(flops / generation.bf16_flops, bytes_accessed / generation.hbm_bytes_per_second)


def step_cost(compiled, accum_steps: int) -> tuple[float, float]:
  """(FLOPs, bytes accessed) of one training step per chip, from XLA's cost analysis.

  The analysis counts a loop's body once, so a step that accumulates gradients over
  `accum_steps` micro-batches (a scan: vit_jax.training.step) counts as one micro-batch. Its
  FLOPs are taken `accum_steps` times, which counts the optimiser's update that many times too
  (a few FLOPs a parameter, small beside the passes' 6 a parameter and token); its bytes are
  taken once: a lower bound, as the roofline needs."""
  cost = compiled.cost_analysis()
  return cost.get('flops', 0.0) * accum_steps, cost.get('bytes accessed', 0.0)


def topology_mesh(config: ml_collections.ConfigDict, topology: tpu_topologies.Topology):
  """The mesh of `config` over the compile-only devices of `topology`, the config first
  validated for them (checks.ConfigError)."""
  devices = tpu_topologies.compile_only_devices(topology)
  checks.validate_config(config, len(devices), devices[0].platform)
  return train_setup.make_mesh(config, devices)


def train_step_plan(config: ml_collections.ConfigDict, mesh, topology: tpu_topologies.Topology,
                    num_classes: int, multi_label: bool = False) -> tuple[dict, fit.StepMemory]:
  """The training step of `config` lowered and compiled for `mesh` (over `topology`'s devices),
  for multi-hot labels where `multi_label`: (the plan's dict without the evaluation step, the
  step's StepMemory). The dict's `fits` says whether the compiler took the step and its per-chip
  total is within a chip's HBM; where it does, the dict has the FLOPs, the roofline and the TPU
  kernels."""
  start = time.perf_counter()
  compiled, refusal = fit.compile_or_refusal(
      lambda: fit.lower_train_step(config, mesh, num_classes, multi_label))
  compile_seconds = time.perf_counter() - start
  used = fit.StepMemory(refusal=refusal) if compiled is None else fit.memory_of(compiled)
  hbm = topology.generation.hbm_bytes
  result = {'topology': {'name': topology.name, 'generation': topology.generation.name,
                         'chips': topology.chips * topology.slices, 'slices': topology.slices,
                         'chips_per_host': topology.chips_per_host,
                         'hosts': topology.hosts * topology.slices,
                         'chip_grid': 'x'.join(map(str, topology.grid))},
            'mesh': dict(mesh.shape), 'config': {
                'model_name': config.model_name, 'batch': config.batch,
                'accum_steps': config.accum_steps, 'pp.crop': config.pp.crop,
                'dtype': config.dtype, 'sharding': config.sharding,
                'remat_policy': config.remat_policy, 'scan_layers': config.scan_layers,
                'attention': attention.resolve_attention(config.attention,
                                                          list(mesh.devices.flat)),
                'optimizer': config.optimizer, 'num_classes': num_classes,
                'multi_label': multi_label},
            'versions': {'jax': jax.__version__, 'libtpu': libtpu_version()},
            'compile_seconds': compile_seconds,
            'fits': refusal is None and used.total_bytes <= hbm,
            'per_chip': per_chip(used, hbm, state_bytes(config, mesh, num_classes))}
  if result['fits']:
    flops, bytes_accessed = step_cost(compiled, config.accum_steps)
    seconds = roofline(flops, bytes_accessed, topology.generation)
    result.update(
        flops_per_step_per_chip=flops, bytes_accessed_per_step_per_chip=bytes_accessed,
        roofline_step_seconds=seconds,
        roofline_images_per_second_per_chip=config.batch / mesh.size / seconds,
        tpu_custom_calls=custom_calls(compiled.as_text()))
  return result, used


def plan(config: ml_collections.ConfigDict, topology: tpu_topologies.Topology,
         num_classes: int, multi_label: bool = False) -> dict:
  """Compiles the training and evaluation steps of `config` for `topology`, their labels
  multi-hot rows where `multi_label` (as main trains multi-label data); the plan as a dict (the
  JSON of --out). Raises checks.ConfigError, or PlannedError (a fit.FitError naming
  what would fit, as main's check does) where the step does not fit a chip's HBM."""
  mesh = topology_mesh(config, topology)
  slices = f' x {topology.slices} slices' if topology.slices > 1 else ''
  logging.info("Compiling the training and evaluation steps of %s for %s%s with libtpu's "
               'compiler, on this CPU (minutes for large models).', config.model_name,
               topology.name, slices)
  hbm = topology.generation.hbm_bytes
  where = f'a {topology.generation.name} chip\'s HBM'
  memory = lambda c: fit.step_memory(c, mesh, num_classes, multi_label)
  config = fit.fitted_config(config, mesh, num_classes, hbm, where, multi_label)
  result, used = train_step_plan(config, mesh, topology, num_classes, multi_label)
  if not result['fits']:
    try:
      fit.check(config, checks.data_parallel_size(config, mesh.size), memory, hbm, where,
                used)
    except fit.FitError as e:
      result['error'] = str(e)
      raise PlannedError(str(e), result) from None
  result['eval'] = eval_memory(config, mesh, num_classes, hbm, multi_label)
  return result


class PlannedError(fit.FitError):
  """FitError with the plan made so far (for --out)."""

  def __init__(self, message: str, result: dict):
    super().__init__(message)
    self.result = result


def state_bytes(config, mesh, num_classes) -> int:
  """Bytes of the train state (params, optimiser state, EMA) that one chip holds."""
  model = train_setup.build_model(config, num_classes, list(mesh.devices.flat))
  state, _ = train_step.abstract_train_state(config, model, train_step.make_optimizer(config),
                                             mesh, config.pp.crop)
  return shard_bytes(state)


def custom_calls(hlo: str) -> dict:
  """{kernel: count} of the TPU custom calls (Pallas/Mosaic kernels) in the optimised HLO text
  `hlo`, each named as its instruction is, less the '.N' suffix: e.g. splash attention's
  'splash_mha_fwd_residuals' (forward) and 'splash_mha_dq_no_residuals' and
  'splash_mha_dkv_no_residuals' (backward). A kernel in a loop's body counts once."""
  names = re.findall(
      r'^\s*(?:ROOT )?%?([\w.-]+?)(?:\.\d+)? = .*custom_call_target="tpu_custom_call"', hlo,
      re.MULTILINE)
  return {name: names.count(name) for name in sorted(set(names))}


def per_chip(used: fit.StepMemory, hbm: int, state: int | None = None) -> dict:
  """The per-chip bytes of the plan's JSON."""
  return {'state_bytes': state, 'argument_bytes': used.argument_bytes,
          'temp_bytes': used.temp_bytes, 'output_bytes': used.output_bytes,
          'alias_bytes': used.alias_bytes, 'code_bytes': used.code_bytes,
          'total_bytes': used.total_bytes, 'hbm_bytes': hbm, 'compiler_refusal': used.refusal}


def eval_memory(config, mesh, num_classes, hbm: int, multi_label: bool = False) -> dict:
  """The evaluation step of `config` compiled for `mesh` (multi-hot labels where
  `multi_label`): its per-chip total bytes, and whether it fits `hbm`."""
  model = train_setup.build_model(config, num_classes, list(mesh.devices.flat))
  state, _ = train_step.abstract_train_state(config, model, train_step.make_optimizer(config),
                                             mesh, config.pp.crop)
  step = jax.jit(tasks.for_config(config).eval_step(model, config))
  compiled, refusal = fit.compile_or_refusal(
      lambda: step.lower(state.params, train_step.abstract_batch(
          config, mesh, evaluation=True, multi_hot=num_classes * multi_label)))
  used = fit.StepMemory(refusal=refusal) if compiled is None else fit.memory_of(compiled)
  return {'total_bytes': used.total_bytes, 'fits': refusal is None and used.total_bytes <= hbm,
          'compiler_refusal': refusal}


def libtpu_version() -> str | None:
  """The installed libtpu's version."""
  try:
    return importlib.metadata.version('libtpu')
  except importlib.metadata.PackageNotFoundError:
    return None

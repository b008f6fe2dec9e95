"""The old, flat module names still lead to the modules that moved into subpackages."""
import importlib

import pytest

import vit_jax
from vit_jax.checkpoints import finetune
from vit_jax.checkpoints import runs
from vit_jax.config import defaults
from vit_jax.data import image_files
from vit_jax.evaluators import linear_probe
from vit_jax.models import flops
from vit_jax.models import registry
from vit_jax.tools import export
from vit_jax.tools import predict


@pytest.mark.parametrize('old', sorted(vit_jax.MOVED))
def test_an_old_module_name_is_the_new_module_with_a_deprecation_warning(old):
  with pytest.warns(DeprecationWarning, match=vit_jax.MOVED[old]):
    module = getattr(vit_jax, old)
  assert module is importlib.import_module(vit_jax.MOVED[old])


def test_from_vit_jax_import_an_old_name_works():
  with pytest.warns(DeprecationWarning):
    from vit_jax import train  # noqa: PLC0415  (the old spelling, on purpose)
  assert train.train_and_evaluate.__module__ == 'vit_jax.training.trainer'


def test_a_moved_command_imported_by_its_old_name_is_its_module():
  from vit_jax import export as old_export  # noqa: PLC0415
  from vit_jax import fewshot as old_fewshot  # noqa: PLC0415
  assert old_export is export
  assert old_fewshot is linear_probe  # The method it held; the command is tools/fewshot.py.


def test_the_old_predict_module_offers_the_command_and_the_image_loading_it_held():
  from vit_jax import predict as old_predict  # noqa: PLC0415
  assert old_predict.top_k is predict.top_k
  assert old_predict.load_image is image_files.load_image
  assert old_predict.load_labels is image_files.load_labels


def test_the_old_checkpoint_module_offers_the_functions_of_its_parts():
  from vit_jax import checkpoint  # noqa: PLC0415
  assert checkpoint.load_model is runs.load_model
  assert checkpoint.load_pretrained is finetune.load_pretrained


def test_models_and_config_packages_forward_their_old_names_and_keep_their_submodules():
  import vit_jax.config  # noqa: PLC0415
  import vit_jax.models  # noqa: PLC0415
  with pytest.warns(DeprecationWarning, match='vit_jax.models.registry.get_model'):
    assert vit_jax.models.get_model is registry.get_model
  with pytest.warns(DeprecationWarning):
    assert vit_jax.models.gflops_per_image is flops.gflops_per_image
  with pytest.warns(DeprecationWarning):
    assert vit_jax.config.get_config is defaults.get_config
  # A submodule's name is the submodule, even where an old module had a function of that name
  # (the registry's `vit`).
  from vit_jax.models import vit  # noqa: PLC0415
  assert vit.__name__ == 'vit_jax.models.vit'
  with pytest.raises(AttributeError):
    vit_jax.models.no_such_name  # noqa: B018

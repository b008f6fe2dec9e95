"""Tests of the configs/ files as `--config=configs/FILE.py:ARG` loads them: by path."""
import os
import subprocess
import sys

from absl import flags
from ml_collections import config_flags
import pytest

from vit_jax.models import registry

# The short names configs/vit.py took when it wrote them out itself: each still means the same.
SHORT_NAMES = {
    'ti16': 'ViT-Ti_16', 's16': 'ViT-S_16', 's32': 'ViT-S_32', 'b8': 'ViT-B_8',
    'b16': 'ViT-B_16', 'b32': 'ViT-B_32', 'l16': 'ViT-L_16', 'l32': 'ViT-L_32',
    'h14': 'ViT-H_14', 's16_gap': 'ViT-S_16-gap', 's32_gap': 'ViT-S_32-gap',
    'b16_gap': 'ViT-B_16-gap', 'b32_gap': 'ViT-B_32-gap', 'r_ti16': 'R+ViT-Ti_16',
    'r26_s32': 'R26+ViT-S_32', 'r26_b32': 'R26+ViT-B_32', 'r50_b16': 'R50+ViT-B_16',
    'r50_l32': 'R50+ViT-L_32',
}


def load(argument: str):
  """The config of `--config=ARGUMENT`, read as vit_jax.main's flag reads it."""
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file('config', flag_values=flag_values)
  flag_values(['main', f'--config={argument}'])
  return flag_values.config


# A config file of each kind, with the model it names.
CONFIG_FILES = [
    ('configs/vit.py:b16,cifar10', 'ViT-B_16'),
    ('configs/vit.py:ViT-L_16,imagenet2012', 'ViT-L_16'),
    ('configs/vit.py:r50_b16,/data/my_images', 'R50+ViT-B_16'),
    ('configs/mpp.py:b16,imagenet2012', 'ViT-B_16'),
    ('configs/mpp.py:ti16,imagenet2012', 'ViT-Ti_16'),  # mpp.py knew only 4 short names.
    ('configs/mpp.py:fashion_mnist', 'ViT-mini_7'),
    ('configs/augreg.py:B/16,i1k,medium2', 'ViT-B_16'),
    ('configs/default.py', 'ViT-mini_7'),
    ('configs/scratch_small.py:/no/such/folder', 'ViT-Ti_8-6'),
    ('configs/finetune.py:56', 'ViT-mini_7'),
    ('configs/segmentation.py', 'ViT-mini_7'),
]


@pytest.mark.parametrize('argument, model_name', CONFIG_FILES)
def test_each_config_file_loads_by_path_with_its_model(argument, model_name):
  config = load(argument)
  assert config.model_name == model_name
  assert config.model.name == model_name


def test_every_short_name_means_the_same_model_in_vit_and_mpp():
  assert registry.SHORT_NAMES == SHORT_NAMES
  for short_name, name in SHORT_NAMES.items():
    assert load(f'configs/vit.py:{short_name},cifar10').model.name == name
    assert load(f'configs/mpp.py:{short_name},imagenet2012').model.name == name


def test_no_config_file_imports_tensorflow():
  # vit_jax.main reads --config before it sets its console up: a config file that imported
  # TensorFlow would print TensorFlow's native start-up lines first (and spend its seconds
  # importing it before a config error). In a fresh Python: this one has imported it.
  code = ('import sys; from absl import flags; from ml_collections import config_flags\n'
          'for argument in sys.argv[1:]:\n'
          '  values = flags.FlagValues(); config_flags.DEFINE_config_file("config", '
          'flag_values=values)\n'
          '  values(["main", f"--config={argument}"]); values.config\n'
          'print(sorted(name for name in sys.modules if name.startswith("tensorflow")))')
  result = subprocess.run([sys.executable, '-c', code, *(a for a, _ in CONFIG_FILES)],
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert result.stdout == '[]\n', result.stderr[-2000:]

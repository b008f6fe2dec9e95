"""Tests of the installed package (setup.py): vit_jax stands alone, without the repository.

The package is installed, not editable, into a fresh virtual environment that sees the
installed dependencies (nothing is downloaded), and used from a folder that holds a decoy
`configs` package, as many projects have one.
"""
import os
import shutil
import site
import subprocess
import sys

import pytest

pytestmark = pytest.mark.xdist_group('install')  # Its module fixtures are built once.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 300  # Seconds any one command may run.
DECOY = 'raise ImportError("the decoy configs package was imported")\n'


def run(command, cwd, env=None):
  """Runs `command` in `cwd` without the checkout on PYTHONPATH; fails with its output."""
  env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'} | (env or {})
  result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
  assert result.returncode == 0, f'{command} failed:\n{result.stdout}\n{result.stderr}'
  return result.stdout


@pytest.fixture(name='installed', scope='module')
def fixture_installed(tmp_path_factory):
  """(python of a venv with vit_jax installed from a copy of the sources, a folder whose
  `configs` package is a decoy, that venv's site-packages)."""
  tmp = tmp_path_factory.mktemp('install')
  source = tmp / 'source'  # A copy, so that the build leaves nothing in the checkout.
  shutil.copytree(os.path.join(ROOT, 'vit_jax'), source / 'vit_jax',
                  ignore=shutil.ignore_patterns('__pycache__'))
  shutil.copy(os.path.join(ROOT, 'setup.py'), source)
  # Without a pip of its own (installing one takes most of the venv's time): the venv's python
  # runs the installed pip, which installs into the venv.
  run([sys.executable, '-m', 'venv', '--system-site-packages', '--without-pip', str(tmp / 'venv')],
      tmp)
  python = str(tmp / 'venv' / 'bin' / 'python')
  site_packages = run([python, '-c', 'import sysconfig; print(sysconfig.get_path("purelib"))'],
                      tmp).strip()
  # The dependencies as installed for this test run (a venv's too, which --system-site-packages
  # alone would not reach); a path line in a .pth adds the folder, not the editable vit_jax.
  with open(os.path.join(site_packages, 'test_dependencies.pth'), 'w') as f:
    f.write('\n'.join(site.getsitepackages()) + '\n')
  run([python, '-m', 'pip', 'install', '-q', '--no-deps', '--no-build-isolation', str(source)],
      tmp)
  (tmp / 'elsewhere' / 'configs').mkdir(parents=True)
  (tmp / 'elsewhere' / 'configs' / '__init__.py').write_text(DECOY)
  return python, tmp / 'elsewhere', site_packages


def test_install_holds_vit_jax_and_no_top_level_configs(installed):
  _, _, site_packages = installed
  assert os.path.isfile(os.path.join(site_packages, 'vit_jax', 'models', 'registry.py'))
  # The embedded dataset of the quick start, package data of the data subpackage.
  assert os.path.isfile(
      os.path.join(site_packages, 'vit_jax', 'data', 'fashion_mnist_embedded.npz'))
  assert not os.path.exists(os.path.join(site_packages, 'configs'))


def test_models_import_with_a_decoy_configs_package_ahead_on_the_path(installed):
  python, elsewhere, site_packages = installed
  out = run([python, '-c', 'import vit_jax.models as m; print(m.__file__); '
             'print(m.MODEL_CONFIGS["ViT-B_16"].hidden_size)'], elsewhere,
            env={'PYTHONPATH': str(elsewhere)})
  module_file, hidden_size = out.split()
  assert module_file.startswith(site_packages)
  assert hidden_size == '768'  # Table 1 of the paper.


def test_main_finds_its_default_config_in_the_package_from_another_folder(installed):
  python, elsewhere, site_packages = installed
  out = run([python, '-c', 'from absl import flags; from vit_jax.config import command_line; '
             'command_line.parse_flags(["main"]); '
             'print(command_line.DEFAULT_CONFIG, flags.FLAGS.config.model_name)'],
            elsewhere, env={'PYTHONPATH': str(elsewhere)})
  assert out.split() == [os.path.join(site_packages, 'vit_jax', 'config', 'defaults.py'),
                         'ViT-mini_7']

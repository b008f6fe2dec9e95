"""Tests of the tour notebook, notebooks/vit_jax.ipynb, executed top to bottom in a Jupyter kernel.

The kernel inherits this process's environment (4 simulated CPU devices, from conftest.py) and
VIT_JAX_NOTEBOOK_QUICK=1, which cuts training to a few steps; it runs in a temporary directory.
"""
import base64
import io
import os
import re

import nbclient
import nbformat
import numpy as np
from PIL import Image
import pytest

pytestmark = pytest.mark.xdist_group('notebook')  # Its module fixtures are built once.

NOTEBOOK = os.path.join(os.path.dirname(__file__), os.pardir, 'notebooks', 'vit_jax.ipynb')
CELL_TIMEOUT_S = 300
NUM_FIGURES = 8  # Predictions, rollout, per-layer maps, distance, positions, filters, 2 curves.


def read_notebook():
  return nbformat.read(NOTEBOOK, as_version=4)


@pytest.fixture(name='executed', scope='module')
def fixture_executed(tmp_path_factory):
  """The notebook after a quick run; CellExecutionError (naming the cell) if any cell fails."""
  notebook = read_notebook()
  folder = tmp_path_factory.mktemp('notebook')
  with pytest.MonkeyPatch.context() as env:
    env.setenv('VIT_JAX_NOTEBOOK_QUICK', '1')
    env.setenv('TMPDIR', str(folder))  # The notebook's WORKDIR goes here.
    env.delenv('TF_CPP_MIN_LOG_LEVEL', raising=False)  # As for a user: the console sets it.
    # ipykernel forwards what C++ code writes to file descriptors 1 and 2 to the notebook, as a
    # user sees it, only where this variable of pytest's is not set.
    env.delenv('PYTEST_CURRENT_TEST', raising=False)
    nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name='python3',
                            resources={'metadata': {'path': str(folder)}}).execute()
  return notebook


def printed_text(notebook) -> str:
  """Everything the code cells printed to stdout, in order."""
  return ''.join(output.text for cell in notebook.cells if cell.cell_type == 'code'
                 for output in cell.outputs if output.get('name') == 'stdout')


def displayed_pngs(notebook) -> list[Image.Image]:
  """The images the code cells displayed, decoded."""
  return [Image.open(io.BytesIO(base64.b64decode(output.data['image/png'])))
          for cell in notebook.cells if cell.cell_type == 'code'
          for output in cell.outputs if 'image/png' in output.get('data', {})]


def accuracy(text: str, pattern: str) -> float:
  found = re.findall(pattern + r'(\d\.\d+)', text)
  assert len(found) == 1, f'expected one line matching {pattern!r} in:\n{text}'
  return float(found[0])


def test_committed_without_outputs():
  notebook = read_notebook()
  nbformat.validate(notebook)
  code_cells = [cell for cell in notebook.cells if cell.cell_type == 'code']
  assert code_cells
  for cell in code_cells:
    assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
  assert notebook.metadata.kernelspec.name == 'python3'


def test_trains_evaluates_and_fine_tunes(executed):
  text = printed_text(executed)
  assert 'step 30/30' in text and 'step 10/10' in text  # The quick runs' progress lines.
  at_28 = accuracy(text, r'test accuracy at 28 px: ')
  assert at_28 > 0.3  # Chance is 0.1.
  # The patches grow with the images (kernel resized), so the model starts as it was.
  assert abs(accuracy(text, r'test accuracy at 56 px, .*, before fine-tuning: ') - at_28) < 0.02
  assert accuracy(text, r'test accuracy at 56 px after 10 fine-tuning steps: ') > 0.3
  assert re.search(r'patch-embedding kernel \(7, 7, 3, 64\) -> \(14, 14, 3, 64\)', text), text


def test_classifies_image_files(executed):
  text = printed_text(executed)
  predictions = re.findall(r'test_(\d)\.png \(truly [^)]+\):\n((?:  .*%  .* \(\d\)\n){2})', text)
  assert [int(index) for index, _ in predictions] == list(range(8)), text
  for _, lines in predictions:
    probabilities = [float(p) for p in re.findall(r'(\d+\.\d+)%', lines)]
    assert probabilities[0] >= probabilities[1] > 0


def test_displays_figures(executed):
  images = displayed_pngs(executed)
  assert len(images) == NUM_FIGURES
  for image in images:
    width, height = image.size
    assert width >= 300 and height >= 150, image.size
    assert (np.asarray(image.convert('L')) < 250).mean() > 0.02, 'an almost blank figure'


def test_shows_no_native_info_lines(executed):
  errors = ''.join(output.text for cell in executed.cells if cell.cell_type == 'code'
                   for output in cell.outputs if output.get('name') == 'stderr')
  assert not re.search(r'^I\d{4} |oneDNN|absl::InitializeLog', errors, re.MULTILINE), errors

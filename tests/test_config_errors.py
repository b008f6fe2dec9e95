"""Tests of the one-line errors of bad input: config ranges (vit_jax.config.defaults.FIELD_RANGES),
config files, workdirs, image folders, and the exit statuses the commands share
(docs/reliability.md).

The command lines run in subprocesses as users type them, with the device count each command
picks for itself (no --xla_force_host_platform_device_count from conftest.py) and TensorFlow's
native logging on (no TF_CPP_MIN_LOG_LEVEL).
"""
import json
import os
import shutil
import stat
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from PIL import Image

from helpers import PHOTOS
from helpers import TINY_CONFIG
from helpers import tiny_config
from helpers import xla_flags
from vit_jax import errors
from vit_jax.checkpoints import convert
from vit_jax.checkpoints import runs
from vit_jax.config import checks
from vit_jax.config import fields
from vit_jax.config import defaults
from vit_jax.distributed import heartbeats
from vit_jax.tools import fewshot as fewshot_command
from vit_jax.models import registry
from vit_jax.tools import export
from vit_jax.tools import predict
from vit_jax.tools import visualize
from vit_jax.training import resume
from vit_jax.training import trainer
from vit_jax.training import workdirs

TIMEOUT = 300  # Seconds any one process may run.


def run(module, *args, cwd=None):
  """(exit status, stdout and stderr) of `python -m module args` (in the folder `cwd`), as a
  user runs it: with the device count it picks and TensorFlow's native logging as it is by
  default."""
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}
  result = subprocess.run([sys.executable, '-m', module, *map(str, args)], capture_output=True,
                          text=True, timeout=TIMEOUT, check=False, cwd=cwd,
                          env={**env, 'XLA_FLAGS': xla_flags(None)})
  return result.returncode, result.stdout + result.stderr


def last_line(output: str) -> str:
  return output.strip().splitlines()[-1]


# Config ranges.


def fields_of(config: ml_collections.ConfigDict, types=None, prefix: str = '') -> set[str]:
  """The dotted names of the fields of `config` (that hold a value of one of `types`, or None
  where their type is one of them)."""
  names = set()
  for key in config:
    if isinstance(config[key], ml_collections.ConfigDict):
      names |= fields_of(config[key], types, f'{prefix}{key}.')
    elif types is None or config.get_type(key) in types:  # A bool's type is bool, not int.
      names.add(prefix + key)
  return names


def test_every_numeric_config_field_has_a_range():
  configs = [defaults.training_defaults(), defaults.get_config()] + [
      defaults.with_model(defaults.training_defaults(), name) for name in registry.MODEL_CONFIGS]
  numeric = set().union(*(fields_of(config, (int, float)) for config in configs))
  assert {'keep_checkpoints', 'pp.resize', 'model.transformer.num_heads'} <= numeric
  assert numeric - set(fields.FIELD_RANGES) == set()  # A new numeric field needs its range.
  # And the table names no other fields ('model.representation_size' is a plain None in most).
  assert set(fields.FIELD_RANGES) - set().union(*map(fields_of, configs)) == set()


@pytest.mark.parametrize('field, value, message', [
    ('keep_checkpoints', -1, 'config.keep_checkpoints=-1 must be 0 or more (0: all of them).'),
    ('seed', -1, 'config.seed=-1 must be 0 or more.'),
    ('momentum', 1.0, 'config.momentum=1.0 must be in [0, 1).'),
    ('label_smoothing', -0.1, 'config.label_smoothing=-0.1 must be in [0, 1).'),
    ('grad_clip_norm', 0.0, 'config.grad_clip_norm=0.0 must be greater than 0.'),
    ('pp.area_min', 0.0, 'config.pp.area_min=0.0 must be in (0, 1].'),
    ('pp.resize', 0, "config.pp.resize=0 must be None (resize to pp.crop) or greater than 0."),
    ('evals.fewshot.seeds', 0, 'config.evals.fewshot.seeds=0 must be greater than 0.'),
    ('base_lr', float('nan'), 'config.base_lr=nan must be greater than 0.'),
    ('model.transformer.num_heads', 0,
     'config.model.transformer.num_heads=0 must be greater than 0.'),
    ('model.transformer.dropout_rate', 1.0,
     'config.model.transformer.dropout_rate=1.0 must be in [0, 1).'),
])
def test_a_value_out_of_its_range_is_a_one_line_config_error(field, value, message):
  config = tiny_config()
  parent, _, name = field.rpartition('.')
  (checks.field_at(config, parent) if parent else config)[name] = value
  with pytest.raises(checks.ConfigError) as error:
    checks.validate_config(config, 8)
  assert str(error.value) == message


def test_a_value_of_another_type_is_refused_naming_the_type():
  # A config file may build its ConfigDict without the defaults' field types.
  assert checks.range_error('batch', 512.0, fields.FIELD_RANGES['batch']) == (
      'config.batch=512.0 must be an integer greater than 0.')
  assert checks.range_error('base_lr', '0.1', fields.FIELD_RANGES['base_lr']) == (
      "config.base_lr='0.1' must be a number greater than 0.")
  assert checks.range_error('base_lr', True, fields.FIELD_RANGES['base_lr']) is not None
  # The values that the ranges take, their special ones included.
  for field, value in (('mesh.data', -1), ('val_every', None), ('keep_checkpoints', 0),
                       ('base_lr', 3), ('ema_decay', 0.0), ('pp.area_min', 1.0)):
    assert checks.range_error(field, value, fields.FIELD_RANGES[field]) is None


def test_config_error_lives_in_errors_which_imports_nothing_of_vit_jax():
  # Any module may raise it without importing validation's nine siblings; callers that catch
  # checks.ConfigError catch the same class.
  code = ('import sys; from vit_jax import errors; '
          'print(sorted(m for m in sys.modules if m.startswith("vit_jax")))')
  loaded = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                          check=True).stdout.split('\n')[0]
  # The package's own import brings vit_jax.interrupts only, which imports the standard library.
  assert loaded == "['vit_jax', 'vit_jax.errors', 'vit_jax.interrupts']"
  assert checks.ConfigError is errors.ConfigError
  assert issubclass(errors.ConfigError, ValueError)


def test_a_config_file_that_does_not_exist_is_one_line(tmp_path):
  status, output = run('vit_jax.main', f'--config={tmp_path}/nope.py:b16',
                       '--config.total_steps=3')
  assert status == 1
  assert output.strip().splitlines() == [
      f'Config error: --config={tmp_path}/nope.py:b16: no such file {tmp_path}/nope.py. Give a '
      'config file, e.g. --config=configs/vit.py:b16,cifar10 (the configs/ folder of the '
      'repository), or leave out --config for the default run.']


def test_a_config_of_the_repository_given_from_another_folder_is_named_with_its_path(tmp_path):
  status, output = run('vit_jax.main', '--config=configs/vit.py:ti16,cifar10', cwd=tmp_path)
  assert status == 1
  config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs',
                        'vit.py')
  assert output.strip().splitlines() == [
      f'Config error: --config=configs/vit.py:ti16,cifar10: no such file configs/vit.py in '
      f"{tmp_path}; the repository's is {config}: give --config={config}:ti16,cifar10."]


def test_a_peer_timeout_that_jax_or_the_heartbeats_would_overrule_is_one_line():
  status, output = run('vit_jax.main', f'--config={TINY_CONFIG}', '--peer_timeout=120')
  assert status == 1
  assert output.strip().splitlines() == [
      '--peer_timeout=120: give more than 4 seconds (two heartbeats) and less than 100 (JAX\'s '
      'own timeout, after which it aborts every process with a stack dump); the default is 30.']
  assert heartbeats.gone_after_error(4) is not None and heartbeats.gone_after_error(5) is None


# Workdirs.


def test_a_dataset_folder_that_does_not_exist_is_one_line_and_makes_no_workdir(tmp_path):
  # A mistyped path made workdirs/default_no_such_folder/, holding a lock and nothing else.
  status, output = run('vit_jax.main', '--config.dataset=/no/such/folder', cwd=tmp_path)
  assert status == 1 and 'Traceback' not in output
  assert last_line(output) == (
      "Config error: config.dataset='/no/such/folder' is a path, and no folder exists there "
      f'(relative paths start at {tmp_path}): give an image folder DIR with DIR/train/<class>/ '
      'and DIR/test/<class>/, or DIR/<class>/.')
  assert os.listdir(tmp_path) == []


def test_a_workdir_that_is_a_file_or_read_only_is_one_line(tmp_path):
  (tmp_path / 'file').write_text('mine')
  status, output = run('vit_jax.main', f'--config={TINY_CONFIG}', f'--workdir={tmp_path}/file')
  assert status == 1 and 'Traceback' not in output
  assert last_line(output) == (f'--workdir={tmp_path}/file is a file, not a folder: give a '
                               'folder that can be written (it is made if missing).')
  assert (tmp_path / 'file').read_text() == 'mine'
  read_only = tmp_path / 'read_only'
  read_only.mkdir()
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'ro,size=1m', 'tmpfs', str(read_only)],
                    capture_output=True, check=False).returncode:
    pytest.skip('mounting a read-only tmpfs is not permitted here (it needs root)')
  try:  # The line of the same error as above, here without the process.
    with pytest.raises(workdirs.WorkdirError) as refused:
      workdirs.lock_workdir(f'{read_only}/run')
  finally:
    subprocess.run(['umount', str(read_only)], check=True)
  assert str(refused.value) == (
      f'--workdir={read_only}/run cannot be written (Read-only file system: {read_only}/run): '
      'give a folder that can be written (it is made if missing).')


def test_an_output_under_a_file_is_one_line_before_the_model_loads(tmp_path, capsys):
  (tmp_path / 'notes').write_text('mine')
  out = tmp_path / 'notes' / 'run' / 'predictions.csv'
  assert predict.main(['--checkpoint', str(tmp_path / 'none'), '--out', str(out), PHOTOS[0]]) == 1
  assert capsys.readouterr().err == (
      f'error: The folder of --out {out} cannot be made ({tmp_path}/notes is a file, not a '
      'folder): give another --out.\n')
  assert (tmp_path / 'notes').read_text() == 'mine'


def test_a_folder_with_a_users_own_model_or_config_is_no_workdir(tmp_path):
  """A run writes model.npz and config.json: in a folder that holds them but no run, it stops
  before it trains, and the files stay as they were."""
  (tmp_path / 'model.npz').write_bytes(b'pretrained weights I downloaded')
  (tmp_path / 'config.json').write_text('{"project": "mine"}')
  with pytest.raises(errors.WorkdirError) as refused:
    trainer.train_and_evaluate(tiny_config(), str(tmp_path))
  assert str(refused.value) == (
      f'{tmp_path} holds config.json, model.npz but no checkpoint or config of a vit_jax run, '
      'and a run there would overwrite them: give another --workdir, or move config.json, '
      'model.npz away.')
  assert (tmp_path / 'model.npz').read_bytes() == b'pretrained weights I downloaded'
  assert (tmp_path / 'config.json').read_text() == '{"project": "mine"}'
  # What a run leaves: an empty checkpoints folder (stopped before its first checkpoint), a
  # step of its checkpoints, its config.json, even damaged (its own line reports that).
  (tmp_path / 'config.json').unlink()
  (tmp_path / 'model.npz').unlink()
  (tmp_path / 'checkpoints').mkdir()
  resume.check_holds_no_other_files(str(tmp_path))
  (tmp_path / 'checkpoints' / '40').mkdir()
  (tmp_path / 'model.npz').write_bytes(b'the run\'s own')
  resume.check_holds_no_other_files(str(tmp_path))
  shutil.rmtree(tmp_path / 'checkpoints')
  for saved in (tiny_config().to_json_best_effort(), '{"model": '):
    (tmp_path / 'config.json').write_text(saved)
    resume.check_holds_no_other_files(str(tmp_path))


@pytest.fixture(name='finished_copy')
def fixture_finished_copy(trained_run, tmp_path):
  """A copy of the session's finished tiny run (60 steps, model.npz)."""
  return shutil.copytree(trained_run[0], tmp_path / 'workdir')


def test_a_damaged_config_json_is_one_line_and_deleting_it_lets_the_run_resume_quietly(
    finished_copy, capsys):
  """The rerun of the finished run restores its last checkpoint and evaluates it, showing no
  library warning (Orbax's 'Metadata file does not exist: .../_CHECKPOINT_METADATA')."""
  (finished_copy / 'config.json').write_text('{"model": ')  # Hand-edited, cut short.
  (finished_copy / 'model.npz.tmp').write_bytes(b'PK half')  # Left by a killed final write.
  command = ('vit_jax.main', f'--config={TINY_CONFIG}', f'--workdir={finished_copy}')
  status, output = run(*command)
  assert status == 1 and 'Traceback' not in output
  message = (f'{finished_copy}/config.json, the saved config of the run in {finished_copy}, is '
             'not valid JSON (Expecting value: line 1 column 11 (char 10)): repair it, or delete '
             "it (the run's checkpoints stay; a rerun then saves its own config).")
  assert last_line(output) == f'Config error: {message}'
  assert visualize.main(['--checkpoint', str(finished_copy), '--figures',
                         'embedding_filters']) == 1
  assert capsys.readouterr().err == f'error: {message}\n'
  os.remove(finished_copy / 'config.json')  # As the line says.
  status, output = run(*command)
  assert status == 0, output
  assert f'Resuming from step 60 of {finished_copy}/checkpoints.' in output
  assert 'Already trained to step 60 of 60: evaluating it.' in output
  assert 'WARNING' not in output
  assert not os.path.exists(finished_copy / 'model.npz.tmp')
  assert json.loads((finished_copy / 'config.json').read_text())['total_steps'] == 60


def test_an_unfinished_workdir_says_so_and_how_to_finish_it(tmp_path):
  workdir = tmp_path / 'run'
  os.makedirs(workdir / 'checkpoints' / '20')
  os.makedirs(workdir / 'checkpoints' / '40')
  (workdir / 'config.json').write_text('{}')
  status, output = run('vit_jax.predict', '--checkpoint', workdir, PHOTOS[0])
  assert status == 1
  assert output.strip().splitlines() == [
      f'error: {workdir} holds a training run that has not finished: it has no model.npz yet. '
      f'Finish it by running its training command again with --workdir={workdir} (it resumes '
      'from its checkpoint of step 40), then try again.']
  with pytest.raises(checks.ConfigError, match=r'^config.pretrained_path: .* has not finished'):
    checks.validate_config(tiny_config(pretrained_path=str(workdir)), 8)


# Image folders.


def image_folder(path, num_per_class=3) -> str:
  """DIR/{train,test}/{shirt,shoe}/*.png of embedded Fashion-MNIST-like grey squares."""
  rng = np.random.default_rng(0)
  for split in ('train', 'test'):
    for name in ('shirt', 'shoe'):
      os.makedirs(path / split / name)
      for i in range(num_per_class):
        pixels = rng.integers(0, 255, (28, 28), dtype=np.uint8)
        Image.fromarray(pixels).save(path / split / name / f'{i}.png')
  return str(path)


def test_a_file_name_that_is_not_utf8_is_named_in_one_line(tmp_path):
  from vit_jax.training import dataset_checks
  folder = image_folder(tmp_path / 'photos')
  with open(os.path.join(os.fsencode(folder), b'train', b'shoe', b'caf\xe9.png'), 'wb') as f:
    f.write((tmp_path / 'photos' / 'train' / 'shoe' / '0.png').read_bytes())
  with pytest.raises(checks.ConfigError) as error:
    dataset_checks.check_data(tiny_config(dataset=folder, test_split='test'), '')
  assert str(error.value) == (
      f'The file name {folder}/train/shoe/caf\\xe9.png is not valid UTF-8, which TensorFlow '
      'needs: rename it, e.g. to ASCII letters and digits.')


def test_a_bad_training_image_stops_the_run_in_one_line_naming_it(tmp_path):
  folder = image_folder(tmp_path / 'photos', num_per_class=8)
  (tmp_path / 'photos' / 'train' / 'shirt' / 'broken.png').write_bytes(b'not an image')
  status, output = run('vit_jax.main', f'--config={TINY_CONFIG}', f'--workdir={tmp_path}/run',
                       f'--config.dataset={folder}', '--config.test_split=test',
                       '--config.batch=16', '--config.batch_eval=16', '--config.total_steps=4')
  assert status == 1 and 'Traceback' not in output
  assert last_line(output).startswith(
      f"Data error: Cannot decode 1 image(s) of {folder} split 'train': "
      f'{folder}/train/shirt/broken.png (')
  assert last_line(output).endswith('or set config.skip_bad_images=True to skip (and count) them.')


# Exports and conversions.


def test_exported_safetensors_get_the_usual_file_mode(trained_run, tmp_path):
  umask = os.umask(0)
  os.umask(umask)
  for format_name, out, weights in (('timm', 'vit.safetensors', 'vit.safetensors'),
                                    ('hf', 'vit_hf', 'vit_hf/model.safetensors')):
    assert export.main(['--checkpoint', trained_run[0], '--format', format_name,
                        '--out', str(tmp_path / out)]) == 0
    assert stat.S_IMODE(os.stat(tmp_path / weights).st_mode) == 0o666 & ~umask


def test_convert_reads_the_heads_of_its_own_exports_and_never_overwrites(trained_run, tmp_path,
                                                                          capsys):
  timm_file, hf_dir = tmp_path / 'vit.safetensors', tmp_path / 'vit_hf'
  for format_name, out in (('timm', timm_file), ('hf', hf_dir)):
    assert export.main(['--checkpoint', trained_run[0], '--format', format_name,
                        '--out', str(out)]) == 0
  assert convert.main([str(timm_file), str(tmp_path / 'timm.npz')]) == 0  # No --num_heads.
  assert ', 2 heads) to ' in capsys.readouterr().out  # tests/tiny_config.py's model has 2.
  # The Hugging Face folder itself, as from_pretrained takes it.
  assert convert.main([str(hf_dir), str(tmp_path / 'hf.npz')]) == 0
  assert f'state dict {hf_dir}/model.safetensors (' in capsys.readouterr().out
  for converted in ('timm.npz', 'hf.npz'):
    assert runs.load_model(tmp_path / converted)[0].num_heads == 2
  # The run's class names go into Hugging Face's config, and come back from it (timm's file has
  # no place for them).
  names = runs.saved_label_names(trained_run[0])
  assert names[1] == 'Trouser'
  assert json.loads((hf_dir / 'config.json').read_text())['id2label']['1'] == 'Trouser'
  assert runs.saved_label_names(tmp_path / 'hf.npz') == names
  assert runs.saved_label_names(tmp_path / 'timm.npz') is None
  # An existing output is refused, as export refuses one, and left as it was: the command's
  # one line (its successful conversion runs in tests/test_commands.py).
  before = (tmp_path / 'timm.npz').read_bytes()
  status, output = run('vit_jax.convert', hf_dir / 'model.safetensors', tmp_path / 'timm.npz')
  assert status == 1
  assert last_line(output) == (f'error: {tmp_path}/timm.npz exists: give another output, or '
                               'move it away first (nothing is overwritten).')
  assert (tmp_path / 'timm.npz').read_bytes() == before
  assert convert.main([str(timm_file), str(hf_dir)]) == 1  # A folder: one line, not a traceback.
  capsys.readouterr()
  assert convert.main([str(tmp_path), str(tmp_path / 'other.npz')]) == 1  # A folder of no model.
  assert capsys.readouterr().err == (f'error: {tmp_path} is a folder without a model.safetensors: '
                                     'give a .safetensors file, or a Hugging Face model folder.\n')


def test_convert_without_recorded_heads_asks_for_them(tmp_path, capsys):
  import safetensors.numpy
  safetensors.numpy.save_file({'blocks.0.attn.qkv.weight': np.zeros((6, 2), np.float32)},
                              tmp_path / 'bare.safetensors')
  assert convert.main([str(tmp_path / 'bare.safetensors'), str(tmp_path / 'out.npz')]) == 1
  assert capsys.readouterr().err == (
      f'error: {tmp_path}/bare.safetensors does not record its number of attention heads (neither '
      'in its timm metadata nor in a Hugging Face config.json beside it): give --num_heads N, or '
      '--model NAME.\n')


# The other commands.


def test_visualize_of_a_workdir_writes_to_its_figures_folder(finished_copy, capsys):
  assert visualize.main(['--checkpoint', str(finished_copy), '--figures',
                         'position_similarity']) == 0
  assert capsys.readouterr().out == f'{finished_copy}/figures/position_similarity.png\n'
  assert visualize.main(['--checkpoint', str(finished_copy / 'model.npz')]) == 1
  assert capsys.readouterr().err == (f'error: --checkpoint {finished_copy}/model.npz is not a '
                                     'training workdir: give --output FOLDER for the figures.\n')


def test_bad_input_exits_1_and_a_command_line_that_does_not_parse_2(tmp_path, capsys):
  missing = str(tmp_path / 'missing.npz')
  assert predict.main(['--checkpoint', missing, PHOTOS[0]]) == 1
  assert fewshot_command.main(['--checkpoint', missing]) == 1
  assert export.main(['--checkpoint', missing, '--format', 'timm']) == 1
  assert convert.main([str(tmp_path / 'missing.safetensors'), str(tmp_path / 'out.npz')]) == 1
  assert visualize.main(['--checkpoint', missing, '--output', str(tmp_path)]) == 1
  capsys.readouterr()
  for command in (predict.main, fewshot_command.main, export.main, visualize.main):
    with pytest.raises(SystemExit) as exit_status:
      command(['--no_such_option'])
    assert exit_status.value.code == 2
  status, output = run('vit_jax.main', f'--config={TINY_CONFIG}', '--config.batch=many')
  assert status == 2
  assert "flag --config.batch=many: invalid literal for int() with base 10: 'many'" in output


def test_the_notebook_says_how_to_run_it_headless():
  with open(os.path.join(os.path.dirname(__file__), os.pardir, 'notebooks',
                         'vit_jax.ipynb')) as f:
    cells = json.load(f)['cells']
  text = ''.join(cells[0]['source'])
  assert 'jupyter execute notebooks/vit_jax.ipynb' in text
  assert 'VIT_JAX_NOTEBOOK_QUICK=1 jupyter execute' in text
  # The variable named there is the one its code reads.
  assert any("os.environ.get('VIT_JAX_NOTEBOOK_QUICK') == '1'" in ''.join(cell['source'])
             for cell in cells if cell['cell_type'] == 'code')

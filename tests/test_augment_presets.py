"""Tests of the AugReg presets (configs/augreg.py), the small-data preset
(configs/scratch_small.py) and the higher-resolution continuation (configs/finetune.py): they
load as `--config=FILE:ARG` does and validate."""
import pytest

from helpers import write_image_folder
from vit_jax.config import checks
from vit_jax.config import command_line
from vit_jax.training import dataset_checks


def load(spec):
  return command_line.load_config([f'--config={spec}'])


@pytest.mark.parametrize('arg, randaug, mixup, dropout', [
    ('B/16,i1k,medium2', (2, 15), 0.5, 0.1),
    ('Ti/16,i21k,light1', (2, 0), 0.0, 0.0),
    ('L/16,i21k,heavy2,0.1', (2, 20), 0.8, 0.1),
    ('S/32,i1k,none,0.0', None, 0.0, 0.0),
])
def test_augreg_levels_set_the_papers_values_and_validate(arg, randaug, mixup, dropout):
  config = load(f'configs/augreg.py:{arg}')
  assert config.pp.randaug == randaug and config.mixup.p == mixup
  # The published files' names carry both rates, equal: `do_0.1-sd_0.1`, `do_0.0-sd_0.0`.
  assert config.model.transformer.dropout_rate == dropout
  assert config.model.transformer.stochastic_depth == dropout
  assert (config.batch, config.base_lr, config.weight_decay, config.warmup_steps) == (
      4096, 1e-3, 0.1, 10_000)
  checks.validate_config(config, 8)


def test_augreg_i1k_trains_300_epochs_of_imagenet():
  config = load('configs/augreg.py:B/16,i1k')
  assert config.model_name == 'ViT-B_16' and config.dataset == 'imagenet2012'
  assert config.total_steps == 93_835  # 300 x 1,281,167 / 4096.


@pytest.mark.parametrize('arg', ['B/16', 'B/16,i2k', 'X/16,i1k', 'B/16,i1k,strong'])
def test_augreg_bad_argument_names_the_choices(arg):
  with pytest.raises(ValueError, match='MODEL,DATA'):
    load(f'configs/augreg.py:{arg}')


def test_scratch_small_counts_the_folder_for_its_schedule_and_validates(tmp_path):
  for split, count in (('train', 300), ('test', 2)):
    for label in ('a', 'b'):
      (tmp_path / split / label).mkdir(parents=True)
      for i in range(count // 2):
        (tmp_path / split / label / f'{i}.png').write_bytes(b'')  # Counted, not decoded.
  (tmp_path / 'train' / 'a' / 'notes.txt').write_text('not an image')
  config = load(f'configs/scratch_small.py:{tmp_path},32')
  assert (config.dataset, config.pp.crop) == (str(tmp_path), 32)
  assert config.total_steps == 100 * (300 // 128)  # 100 epochs of 2 steps.
  assert config.pp.randaug == (2, 10) and config.mixup.p == 0.2
  checks.validate_config(config, 8)


def test_scratch_small_trains_a_folder_of_fewer_images_than_a_batch_100_times_over(tmp_path):
  write_image_folder(tmp_path, {'train': 15, 'test': 5})  # 30 training images.
  config = load(f'configs/scratch_small.py:{tmp_path},16')
  # 100 epochs, each one batch of 16 of the 30 images: each seen 53 times, not 100 x 128 / 30.
  assert (config.batch, config.total_steps) == (16, 100)
  assert config.total_steps * config.batch / 30 < dataset_checks.MAX_PASSES  # So no warning.
  checks.validate_config(config, 2)


def test_scratch_small_counts_the_training_share_of_a_flat_folder(tmp_path):
  for label in ('a', 'b'):  # DIR/<class>/ with no split folders: 300 images, 30 held out.
    (tmp_path / label).mkdir()
    for i in range(150):
      (tmp_path / label / f'{i}.png').write_bytes(b'')  # Counted, not decoded.
    (tmp_path / label / '._0.png').write_bytes(b'')  # Hidden: macOS's metadata of 0.png.
  (tmp_path / '.ipynb_checkpoints').mkdir()
  config = load(f'configs/scratch_small.py:{tmp_path},32')
  assert (config.batch, config.total_steps) == (128, 100 * (270 // 128))  # 100 epochs of 2 steps.


def test_scratch_small_needs_a_folder():
  with pytest.raises(ValueError, match='give the image folder DIR'):
    load('configs/scratch_small.py')


def test_finetune_continues_the_default_run_with_the_papers_transfer_recipe():
  config = load('configs/finetune.py:56')
  default = load('configs/default.py')
  assert config.dataset == default.dataset
  assert (config.pretrained_path, config.pretrained_keep_head, config.pp.crop) == (
      'workdirs/default', True, 56)
  # Twice the pixels, so patches of twice the side: the same 4 x 4 grid of tokens.
  assert tuple(config.model.patches.size) == (14, 14)
  default.model.patches.size = (14, 14)
  assert config.model == default.model
  # Appendix B.1.1: momentum SGD, no weight decay, cosine decay, clipping at global norm 1.
  assert (config.optimizer, config.momentum, config.weight_decay, config.decay_type,
          config.grad_clip_norm, config.label_smoothing) == ('sgd', 0.9, 0.0, 'cosine', 1.0, 0.0)
  assert config.total_steps < default.total_steps
  assert checks.values_error(config) is None


def test_finetune_needs_a_resolution():
  with pytest.raises(ValueError, match='give the resolution in pixels'):
    load('configs/finetune.py:big')
  with pytest.raises(ValueError, match='grows the 7-pixel patches to 10.5 px, not a whole '
                                       'number: choose a size that is a multiple of 4 px'):
    load('configs/finetune.py:42')

"""Tests of the input pipeline on its three kinds of source: embedded, image folder and tfds.

The tfds dataset is written from the embedded data into a temporary `data_dir` and read back by
name, the way users read `cifar10`; the image folder is written as PNG/JPEG files.
"""
import collections
import json
import logging
import os
import re
import shutil

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import ml_collections
import numpy as np
from PIL import Image
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from helpers import PHOTOS
from helpers import write_image_folder
from vit_jax.data import embedded
from vit_jax.data import image_files
from vit_jax.data import image_ops
from vit_jax.data import pipeline as ip
from vit_jax.data import sources
import tiny_tfds

pytestmark = pytest.mark.xdist_group('input_pipeline')  # Its module fixtures are built once.

with np.load(embedded.PATH) as data:
  EMBEDDED = {name: data[name] for name in data.files}  # Decompressed once.
FOLDER_CLASSES = ('bag', 'coat', 'sandal')  # Fashion-MNIST classes 8, 4, 5.
FOLDER_CLASS_IDS = (8, 4, 5)


def make_config(pp=None, **overrides) -> ml_collections.ConfigDict:
  """A small config: 28 px images, batches of 8."""
  config = dict(
      dataset=embedded.DATASET, tfds_data_dir=None, tfds_manual_dir=None,
      train_split='train', test_split='test',
      pp={'crop': 28, 'resize': None, 'flip': True, 'inception_crop': True, **(pp or {})},
      batch=8, batch_eval=8, seed=0, skip_bad_images=False, shuffle_buffer=64, prefetch=1)
  config.update(overrides)
  return ml_collections.ConfigDict(config)


def take(batches, n):
  return [next(batches) for _ in range(n)]


def image_counts(batches) -> collections.Counter:
  """How often each image (by its bytes) appears in `batches`, not counting padding."""
  return collections.Counter(
      image.tobytes() for b in batches
      for image, real in zip(b['image'], b.get('mask', np.ones(len(b['image'])))) if real)


def embedded_rgb(images: np.ndarray) -> np.ndarray:
  """uint8 (n, 28, 28) grey -> float32 (n, 28, 28, 3) in [-1, 1], as the pipeline makes them."""
  return np.repeat(images[..., None], 3, axis=-1).astype(np.float32) / 127.5 - 1


# Sources for the tests.


@pytest.fixture(scope='module')
def tfds_config_factory(tmp_path_factory):
  data_dir = str(tmp_path_factory.mktemp('tfds'))
  tiny_tfds.TinyFashionMnist(data_dir=data_dir).download_and_prepare(
      download_config=tfds.download.DownloadConfig(try_download_gcs=False))
  return lambda **kw: make_config(dataset='tiny_fashion_mnist', tfds_data_dir=data_dir, **kw)


def write_folder(root, split, per_class, ext='png'):
  """Writes `per_class` embedded images of each of FOLDER_CLASSES to root/split/<class>/, in a
  lossless format."""
  for name, class_id in zip(FOLDER_CLASSES, FOLDER_CLASS_IDS):
    os.makedirs(root / split / name, exist_ok=True)
    images = EMBEDDED[f'{split}_images'][EMBEDDED[f'{split}_labels'] == class_id][:per_class]
    for i, image in enumerate(images):
      Image.fromarray(image).save(root / split / name / f'{i}.{ext}', lossless=True)


@pytest.fixture(scope='module')
def folder(tmp_path_factory):
  """15 training images (PNG and JPEG) and 6 test images (PNG) of 3 classes."""
  root = tmp_path_factory.mktemp('folder')
  write_folder(root, 'train', 4)
  write_folder(root, 'train', 1, ext='JPEG')
  write_folder(root, 'test', 2)
  return root


def source_config_factory(kind, request):
  """Builds configs for the source `kind` ('embedded', 'folder' or 'tfds')."""
  if kind == 'embedded':
    return make_config
  if kind == 'folder':
    folder = request.getfixturevalue('folder')
    return lambda **kw: make_config(dataset=str(folder), **kw)
  return request.getfixturevalue('tfds_config_factory')


@pytest.fixture(params=['embedded', 'folder', 'tfds'])
def config_factory(request):
  """Builds configs for each kind of source."""
  return source_config_factory(request.param, request)


@pytest.fixture(params=['embedded', 'folder'])
def random_access_config_factory(request):
  """Builds configs for the sources with random access, whose global order is process-free."""
  return source_config_factory(request.param, request)


# Each source yields correct shapes, value ranges and labels.


def test_embedded_dataset_info():
  info = ip.get_dataset_info(make_config(train_split='train[:98%]', test_split='test'))
  assert info.num_classes == 10
  assert info.label_names[0] == 'T-shirt/top' and info.label_names[9] == 'Ankle boot'
  assert (info.num_train, info.num_test) == (19_600, 10_000)


def test_train_batches_have_shapes_ranges_and_labels(config_factory):
  config = config_factory(pp=dict(crop=40))
  for batch in take(ip.train_batches(config), 3):
    assert batch['image'].shape == (8, 40, 40, 3) and batch['image'].dtype == np.float32
    assert -1 <= batch['image'].min() < batch['image'].max() <= 1
    assert batch['label'].dtype == np.int32
    assert set(batch['label']) <= set(range(ip.get_dataset_info(config).num_classes))


def test_a_flat_folder_of_class_folders_holds_out_a_tenth_of_its_images_to_test(tmp_path,
                                                                                caplog):
  """DIR/<class>/*.png with no split folders, as torchvision's ImageFolder reads one."""
  caplog.set_level(logging.INFO)
  # The folder of its split `train`: DIR/train/{Bag,Trouser}/*.png, 20 images each.
  flat = os.path.join(write_image_folder(tmp_path, {'train': 20}), 'train')
  config = make_config(dataset=flat, test_split='test')
  info = ip.get_dataset_info(config)
  assert info.label_names == ['Bag', 'Trouser']
  assert (info.num_train, info.num_test) == (36, 4)
  assert f'{flat} has no train/ and test/ folders: 10% of the images' in caplog.text
  source = sources.get_source(config)
  (train, train_labels), (test, test_labels) = source.select('train'), source.select('test')
  on_disk = {os.path.join(flat, name, file) for name in ('Bag', 'Trouser')
             for file in os.listdir(os.path.join(flat, name))}
  assert len(on_disk) == 40 and set(train) | set(test) == on_disk
  assert not set(train) & set(test)
  for path, label in [*zip(train, train_labels), *zip(test, test_labels)]:
    assert os.path.basename(os.path.dirname(path)) == info.label_names[label]
  assert len(source.select('train[:50%]')[0]) == 18
  with pytest.raises(ValueError, match=r"its splits are train and test .* not 'val'"):
    source.select('val')


def test_a_flat_folder_holds_out_a_tenth_of_each_class_and_one_image_of_a_small_class(tmp_path):
  flat = os.path.join(write_image_folder(tmp_path, {'train': 20}), 'train')
  for i in range(3, 20):  # 20 bags, 3 trousers, and a class of a single image.
    os.remove(os.path.join(flat, 'Trouser', f'{i}.png'))
  os.makedirs(os.path.join(flat, 'Single'))
  shutil.copy(os.path.join(flat, 'Bag', '0.png'), os.path.join(flat, 'Single', '0.png'))
  source = sources.get_source(make_config(dataset=flat))
  assert source.label_names == ['Bag', 'Single', 'Trouser']
  # Each class of two images or more is tested; the single image trains.
  assert np.bincount(source.select('test')[1], minlength=3).tolist() == [2, 0, 1]
  assert np.bincount(source.select('train')[1], minlength=3).tolist() == [18, 1, 2]


# What a notebook or a Mac leaves in a folder: Jupyter's checkpoints, Finder's .DS_Store, and an
# AppleDouble ._NAME.png beside each file copied to a drive that lacks macOS's metadata.
HIDDEN = {'.ipynb_checkpoints/notes-checkpoint.ipynb': b'{}', 'Bag/.DS_Store': b'\0\0\0\1Bud1',
          'Bag/._0.png': b'\0\5\26\7' + bytes(78)}


@pytest.mark.parametrize('flat', [False, True], ids=['split', 'flat'])
def test_hidden_files_and_folders_of_an_image_folder_are_left_out(tmp_path, flat):
  folder = write_image_folder(tmp_path, {'train': 10, 'test': 2})
  folder = os.path.join(folder, 'train') if flat else folder
  for split in [''] if flat else ['train', 'test']:
    for path, content in HIDDEN.items():
      os.makedirs(os.path.dirname(os.path.join(folder, split, path)), exist_ok=True)
      with open(os.path.join(folder, split, path), 'wb') as f:
        f.write(content)
  source = sources.get_source(make_config(dataset=folder))
  assert source.label_names == ['Bag', 'Trouser']
  images = [*source.select('train')[0], *source.select('test')[0]]
  assert len(images) == (20 if flat else 24)
  assert not [path for path in images
              if any(part.startswith('.') for part in os.path.relpath(path, folder).split('/'))]


@pytest.mark.parametrize('flat', [False, True], ids=['split', 'flat'])
def test_the_images_in_a_class_folders_subfolders_are_of_that_class(tmp_path, flat):
  folder = write_image_folder(tmp_path, {'train': 10, 'test': 2})
  folder = os.path.join(folder, 'train') if flat else folder
  train = os.path.join(folder, '' if flat else 'train')
  for i in range(5, 10):  # Half the bags one folder down, every trouser two.
    os.renames(os.path.join(train, 'Bag', f'{i}.png'),
               os.path.join(train, 'Bag', 'more', f'{i}.png'))
  for i in range(10):
    os.renames(os.path.join(train, 'Trouser', f'{i}.png'),
               os.path.join(train, 'Trouser', '2019', 'june', f'{i}.png'))
  source = sources.get_source(make_config(dataset=folder))
  assert source.label_names == ['Bag', 'Trouser']
  paths, labels = (np.concatenate(pair) for pair in zip(source.select('train'),
                                                         source.select('test')))
  assert len(paths) == (20 if flat else 24)
  for path, label in zip(paths, labels):
    assert os.path.relpath(path, folder).split('/')[0 if flat else 1] == source.label_names[label]


def test_randaugment_runs_on_the_images_of_every_source(config_factory):
  # Its ops need the channel count in the static shape, which decoding files left unknown.
  batch = next(ip.train_batches(config_factory(pp=dict(crop=16, randaug=(2, 10)))))
  assert batch['image'].shape == (8, 16, 16, 3)


def test_embedded_eval_yields_the_stored_test_images_and_labels():
  batches = list(ip.eval_batches(make_config(test_split='test[:20]')))
  images = np.concatenate([b['image'] for b in batches])[:20]
  labels = np.concatenate([b['label'] for b in batches])[:20]
  np.testing.assert_allclose(images, embedded_rgb(EMBEDDED['test_images'][:20]), atol=1e-6)
  np.testing.assert_array_equal(labels, EMBEDDED['test_labels'][:20])


def test_eval_resizes_the_short_side_then_crops_the_centre():
  batch = next(ip.eval_batches(make_config(pp=dict(resize=36, crop=32))))
  assert batch['image'].shape == (8, 32, 32, 3)


def large_photo(path, ext='jpg') -> str:
  """A real photo at 1600 x 1200 px (width x height), written to `path`.EXT."""
  path = f'{path}.{ext}'
  Image.open(PHOTOS[0]).convert('RGB').resize((1600, 1200), Image.BICUBIC).save(path)
  return path


def test_a_large_jpeg_decodes_scaled_down_to_the_side_its_preprocessing_needs(tmp_path):
  encoded = tf.io.read_file(large_photo(tmp_path / 'photo'))
  # libjpeg's scale-downs divide each side by 8, 4 or 2: the largest that keeps the short side.
  assert image_ops.decode_image(encoded, 64).shape == (150, 200, 3)
  assert image_ops.decode_image(encoded, 200).shape == (300, 400, 3)
  whole = image_ops.decode_image(encoded)
  assert whole.shape == (1200, 1600, 3)
  np.testing.assert_array_equal(image_ops.decode_image(encoded, 1000), whole)
  png = tf.io.read_file(large_photo(tmp_path / 'photo', 'png'))
  assert image_ops.decode_image(png, 64).shape == (1200, 1600, 3)  # Other formats: whole.


def test_a_large_photo_is_evaluated_as_predict_reads_it(tmp_path):
  for split, name in (('train', 'cat'), ('train', 'dog'), ('test', 'cat')):
    os.makedirs(tmp_path / split / name)
    photo = large_photo(tmp_path / split / name / 'photo')
  config = make_config(dataset=str(tmp_path), pp=dict(crop=64), batch_eval=1)
  evaluated = next(ip.eval_batches(config))['image'][0]
  # PIL's resize, which predict uses, averages the pixels it shrinks; so does evaluation.
  assert np.abs(evaluated - image_files.load_image(photo, 64)).mean() < 0.02


def test_a_photo_taken_sideways_is_evaluated_upright_as_predict_reads_it(tmp_path):
  """A phone's portrait: pixels stored as the sensor read them (1600 x 1200), turned a quarter
  counter-clockwise from the scene, and EXIF orientation 6 (show them turned clockwise)."""
  scene = np.asarray(Image.open(PHOTOS[0]).convert('RGB').resize((1200, 1600), Image.BICUBIC))
  exif = Image.Exif()
  exif[image_files.EXIF_ORIENTATION] = 6
  for split in ('train', 'test'):
    for name in ('cat', 'dog'):
      os.makedirs(tmp_path / split / name)
      Image.fromarray(np.rot90(scene)).save(tmp_path / split / name / 'photo.jpg',
                                            exif=exif.tobytes())
  photo = str(tmp_path / 'test' / 'cat' / 'photo.jpg')
  config = make_config(dataset=str(tmp_path), pp=dict(crop=(64, 48)), batch_eval=1)
  evaluated = next(ip.eval_batches(config))['image'][0]
  scene_64x48 = np.asarray(Image.fromarray(scene).resize((48, 64), Image.BILINEAR)) / 127.5 - 1
  assert np.abs(evaluated - scene_64x48).mean() < 0.01
  assert np.abs(evaluated - image_files.load_image(photo, (64, 48))).mean() < 0.01
  sideways = np.asarray(Image.fromarray(np.rot90(scene)).resize((48, 64), Image.BILINEAR))
  assert np.abs(evaluated - (sideways / 127.5 - 1)).mean() > 0.2  # As stored it differs.


def test_a_photo_cut_short_is_found_before_training_by_the_quick_decode(tmp_path):
  """The check before training decodes a JPEG at an eighth of each side, which still reads all
  of its data: a large photo that ends half way is found, as training's decode would find it."""
  write_folder(tmp_path, 'train', 1)
  write_folder(tmp_path, 'test', 1)
  photo = large_photo(tmp_path / 'test' / 'bag' / 'photo')
  with open(photo, 'rb') as f:
    data = f.read()
  with open(photo, 'wb') as f:
    f.write(data[:len(data) // 2])
  with pytest.raises(ValueError, match=f"split 'test': {photo} "):
    ip.get_dataset_info(make_config(dataset=str(tmp_path)))
  with pytest.raises(tf.errors.InvalidArgumentError):
    image_ops.decode_image(tf.constant(data[:len(data) // 2]))  # Decoded whole it fails too.


def test_the_side_needed_for_training_keeps_every_inception_crop_at_least_the_crops_size():
  pp = ml_collections.ConfigDict(dict(crop=64, inception_crop=True, area_min=0.25))
  side = image_ops.shorter_side_needed(pp, train=True)

  def smallest_crop_side(height, width):
    return min(min(image_ops.inception_crop(tf.zeros((height, width, 3)), tf.constant(
        [seed, 0], tf.int64), pp.area_min).shape[:2]) for seed in range(200))

  assert smallest_crop_side(side, side) >= 64 and smallest_crop_side(side, 2 * side) >= 64
  assert smallest_crop_side(side // 2, side // 2) < 64  # Less would not do.


def test_folder_labels_follow_sorted_class_folders(folder):
  config = make_config(dataset=str(folder), batch_eval=4)
  info = ip.get_dataset_info(config)
  assert info.label_names == list(FOLDER_CLASSES)
  assert (info.num_train, info.num_test) == (15, 6)
  stored = {embedded_rgb(image[None])[0].tobytes(): FOLDER_CLASS_IDS.index(label)
            for image, label in zip(EMBEDDED['test_images'], EMBEDDED['test_labels'])
            if label in FOLDER_CLASS_IDS}
  seen = [(image.tobytes(), label) for b in ip.eval_batches(config)
          for image, label, real in zip(b['image'], b['label'], b['mask']) if real]
  assert len(seen) == 6
  assert all(stored[image] == label for image, label in seen)


def test_folder_reads_bmp_gif_and_webp_and_counts_the_files_it_ignores(tmp_path, caplog):
  write_folder(tmp_path, 'train', 1)
  for ext in ('bmp', 'gif', 'webp'):
    write_folder(tmp_path, 'test', 1, ext=ext)
  (tmp_path / 'test' / 'bag' / 'notes.txt').write_text('not an image')
  (tmp_path / 'test' / 'coat' / '0.tiff').write_bytes(b'')
  config = make_config(dataset=str(tmp_path), batch_eval=3)
  with caplog.at_level(logging.WARNING):
    assert ip.get_dataset_info(config).num_test == 9
  assert f'Ignoring 2 file(s) in {tmp_path}/test' in caplog.text
  assert '1 .txt, 1 .tiff' in caplog.text or '1 .tiff, 1 .txt' in caplog.text
  first_of_each_class = [EMBEDDED['test_images'][EMBEDDED['test_labels'] == c][0]
                         for c in FOLDER_CLASS_IDS]
  stored = collections.Counter(image.tobytes() for image in embedded_rgb(
      np.array(first_of_each_class * 3)))
  assert image_counts(ip.eval_batches(config)) == stored


def test_tfds_reads_label_names_and_split_strings(tfds_config_factory):
  config = tfds_config_factory(train_split='train[:25%]', test_split='test[10:]')
  info = ip.get_dataset_info(config)
  assert info.label_names == [str(n) for n in EMBEDDED['label_names']]
  assert (info.num_classes, info.num_train, info.num_test) == (10, 30, 30)
  def test_images(split):
    return image_counts(ip.eval_batches(tfds_config_factory(test_split=split)))

  stored = collections.Counter(
      image.tobytes() for image in embedded_rgb(EMBEDDED['test_images'][:40]))
  assert test_images('test') == stored
  assert test_images('test[:10]') + test_images('test[10:]') == stored


def test_embedded_and_folder_read_split_strings(folder):
  assert ip.get_dataset_info(make_config(test_split='test[:10%]+train[-5:]')).num_test == 1005
  assert ip.get_dataset_info(make_config(dataset=str(folder), train_split='train[:50%]')
                             ).num_train == 8


def test_labels_are_those_of_the_records_in_their_order_read_without_the_images(config_factory):
  """What few-shot draws its shots from: the labels of the records that the images are read
  with, in the same order."""
  source = sources.get_source(config_factory())
  records = source.shard('train[2:12]', 0, 1).epoch(None).as_numpy_iterator()
  labels = source.labels('train[2:12]')
  assert labels.dtype == np.int64
  np.testing.assert_array_equal(labels, [record['label'] for record in records])
  assert len(np.unique(source.labels('train'))) == len(source.label_names)


def test_embedded_labels_are_the_stored_arrays():
  labels = sources.get_source(make_config()).labels('test[:10%]+train[-5:]')
  np.testing.assert_array_equal(labels, np.concatenate([EMBEDDED['test_labels'][:1000],
                                                        EMBEDDED['train_labels'][-5:]]))


# Per-process splitting, order and resuming.


def test_two_processes_cover_every_example_once(config_factory):
  config = config_factory(train_split='train[:12]', test_split='test[:6]', batch=4, batch_eval=4,
                          pp=dict(flip=False, inception_crop=False))
  one_epoch = 12 // 4  # Steps for each process to see its 6 training examples.
  train = sum((image_counts(take(ip.train_batches(config, process_index=p, process_count=2),
                                 one_epoch)) for p in range(2)), collections.Counter())
  assert train == image_counts(ip.eval_batches(config_factory(
      test_split='train[:12]', pp=dict(flip=False, inception_crop=False))))
  test = sum((image_counts(ip.eval_batches(config, process_index=p, process_count=2))
              for p in range(2)), collections.Counter())
  assert test == image_counts(ip.eval_batches(config))
  assert sum(test.values()) == 6


def global_batches(config, process_count, steps, start_step=0):
  """The local batches of `process_count` processes at each step, concatenated in process order."""
  local = [take(ip.train_batches(config, process_index=p, process_count=process_count,
                                 start_step=start_step), steps) for p in range(process_count)]
  return [{name: np.concatenate([batches[step][name] for batches in local])
           for name in ('image', 'label')} for step in range(steps)]


def test_random_access_global_batches_do_not_depend_on_the_process_count(
    random_access_config_factory):
  config = random_access_config_factory(train_split='train[:12]')  # Steps 1, 4 cross epochs.
  one_process = global_batches(config, 1, 5)
  two_processes = global_batches(config, 2, 5)
  resumed_on_four = global_batches(config, 4, 2, start_step=3)
  for expected, two in zip(one_process, two_processes):
    np.testing.assert_array_equal(expected['image'], two['image'])
    np.testing.assert_array_equal(expected['label'], two['label'])
  for expected, four in zip(one_process[3:], resumed_on_four):
    np.testing.assert_array_equal(expected['image'], four['image'])
    np.testing.assert_array_equal(expected['label'], four['label'])
  assert not np.array_equal(one_process[0]['image'][:4], one_process[0]['image'][4:])


def test_same_seed_same_batches_and_resume_continues_identically(config_factory):
  config = config_factory(train_split='train[:12]')  # Steps 1 and 4 cross epoch boundaries.
  run = take(ip.train_batches(config), 6)
  again = take(ip.train_batches(config), 6)
  resumed = take(ip.train_batches(config, start_step=3), 3)
  other_seed = next(ip.train_batches(config_factory(train_split='train[:12]', seed=1)))
  for a, b in zip(run, again):
    np.testing.assert_array_equal(a['image'], b['image'])
  for a, b in zip(run[3:], resumed):
    np.testing.assert_array_equal(a['image'], b['image'])
    np.testing.assert_array_equal(a['label'], b['label'])
  assert not np.array_equal(run[0]['image'], other_seed['image'])


def test_eval_padding_counts_every_example_once_with_equal_batch_counts():
  config = make_config(test_split='test[:45]', batch_eval=16)
  per_process = [list(ip.eval_batches(config, process_index=p, process_count=2))
                 for p in range(2)]  # Shares of 22 and 23 examples, batches of 8.
  assert [len(batches) for batches in per_process] == [3, 3]
  assert sum(b['mask'].sum() for batches in per_process for b in batches) == 45
  assert per_process[0][-1]['mask'].tolist() == [1] * 6 + [0] * 2


# Global arrays on a mesh.


@pytest.fixture(scope='module')
def mesh():
  return jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 1), ('data', 'model'))


def test_train_iterator_shards_batches_and_resumes_from_its_json_state(mesh):
  config = make_config(batch=16, train_split='train[:40]')
  iterator = ip.get_train_iterator(config, mesh)
  first = next(iterator)
  assert first['image'].shape == (16, 28, 28, 3) and first['label'].shape == (16,)
  assert first['image'].sharding == NamedSharding(mesh, P('data'))
  next(iterator)
  state = json.loads(json.dumps(iterator.get_state()))
  assert {k: v for k, v in state.items() if k != 'data'} == {
      'step': 2, 'dataset': embedded.DATASET, 'train_split': 'train[:40]', 'seed': 0,
      'batch': 16}  # No process count: any number of processes resumes.
  assert state['data']['examples'] == 40
  expected = take(iterator, 2)
  resumed = take(ip.restore_train_iterator(config, mesh, state), 2)
  for a, b in zip(expected, resumed):
    np.testing.assert_array_equal(a['image'], b['image'])
  with pytest.raises(ValueError, match=r'seed: saved 0, now 1\. Run with the saved values, or '
                     'use another --workdir'):
    ip.restore_train_iterator(make_config(batch=16, train_split='train[:40]', seed=1), mesh, state)


def test_tfds_iterator_state_records_the_process_count(mesh, tfds_config_factory):
  config = tfds_config_factory(batch=16)
  state = ip.get_train_iterator(config, mesh).get_state()
  assert state['process_count'] == 1
  with pytest.raises(ValueError, match='process_count: saved 2, now 1'):
    ip.restore_train_iterator(config, mesh, {**state, 'process_count': 2})


def test_a_resume_with_other_data_is_refused_unless_asked_for_and_old_states_resume(
    mesh, tmp_path, caplog):
  write_folder(tmp_path, 'train', 4)
  config = make_config(dataset=str(tmp_path), batch=8)
  state = ip.get_train_iterator(config, mesh).get_state()
  assert state['data']['examples'] == 12
  (tmp_path / 'train' / 'coat' / '0.png').write_bytes(b'not an image')
  skipping = make_config(dataset=str(tmp_path), batch=8, skip_bad_images=True)
  with pytest.raises(ValueError, match=re.escape(
      f"{tmp_path} split 'train' now has 11 examples (12 examples when saved) "
      '(config.skip_bad_images drops the files that do not decode), so its order would not be '
      'the one trained on. Restore the data as it was, set --config.resume_changed_data=True')):
    ip.restore_train_iterator(skipping, mesh, state)

  skipping.resume_changed_data = True
  with caplog.at_level(logging.WARNING):
    next(ip.restore_train_iterator(skipping, mesh, state))
  assert 'resuming in a new order, no longer exact (config.resume_changed_data)' in caplog.text
  old = {k: v for k, v in state.items() if k != 'data'}  # Saved before fingerprints.
  next(ip.restore_train_iterator(skipping.copy_and_resolve_references(), mesh, old))


def test_a_resume_on_another_version_of_a_tfds_dataset_names_it(mesh, tfds_config_factory):
  config = tfds_config_factory(batch=16)
  state = ip.get_train_iterator(config, mesh).get_state()
  assert state['data'] == {'version': '1.0.0', 'examples': {'train': 120}}
  older = {**state, 'data': {'version': '0.9.0', 'examples': {'train': 200}}}
  with pytest.raises(ValueError, match=re.escape(
      "now has split sizes {'train': 120} (split sizes {'train': 200} when saved), tfds "
      'version 1.0.0 (tfds version 0.9.0 when saved), so its order')):
    ip.restore_train_iterator(config, mesh, older)


def test_eval_iterator_yields_every_test_example_once(mesh):
  config = make_config(test_split='test[:50]', batch_eval=16)
  batches = list(ip.get_eval_iterator(config, mesh))
  assert len(batches) == 4
  assert batches[0]['mask'].sharding == NamedSharding(mesh, P('data'))
  assert sum(float(b['mask'].sum()) for b in batches) == 50
  labels = np.concatenate([b['label'] for b in batches])[:50]
  np.testing.assert_array_equal(labels, EMBEDDED['test_labels'][:50])


def test_an_evaluation_batch_fits_a_smaller_split_rounded_up_to_the_devices(mesh):
  config = make_config(test_split='test[:10]', batch_eval=64)
  # 10 images on 4 devices: one batch of 12, 2 of them padding; not 64 with 54.
  assert ip.eval_batch_size(config, mesh) == 12
  assert ip.eval_batch_size(config, mesh, examples=30) == 32
  assert ip.eval_batch_size(make_config(test_split='test[:100]', batch_eval=64), mesh) == 64


# Bad input gets a clear message.


def test_missing_split_folder_is_named(tmp_path):
  write_folder(tmp_path, 'train', 1)
  with pytest.raises(FileNotFoundError, match=f'{tmp_path}/test does not exist'):
    ip.get_dataset_info(make_config(dataset=str(tmp_path)))


@pytest.mark.parametrize('split', ['train', 'test'])
def test_empty_class_folder_is_named(tmp_path, split):
  write_folder(tmp_path, 'train', 1)
  write_folder(tmp_path, 'test', 1)
  shutil.rmtree(tmp_path / split / 'bag')
  os.makedirs(tmp_path / split / 'bag')
  with pytest.raises(ValueError, match=f'Class folder {tmp_path}/{split}/bag holds no .jpg/'):
    ip.get_dataset_info(make_config(dataset=str(tmp_path)))


def test_split_folder_without_class_folders_is_named(tmp_path):
  write_folder(tmp_path, 'train', 1)
  os.makedirs(tmp_path / 'test')
  with pytest.raises(ValueError, match=f'{tmp_path}/test has no class subfolders'):
    ip.get_dataset_info(make_config(dataset=str(tmp_path)))


def test_test_class_missing_from_train_is_named(tmp_path):
  write_folder(tmp_path, 'train', 1)
  write_folder(tmp_path, 'test', 1)
  os.rename(tmp_path / 'train' / 'coat', tmp_path / 'train' / 'jacket')
  with pytest.raises(ValueError, match=f'{tmp_path}/test/coat has no counterpart in the train'):
    ip.get_dataset_info(make_config(dataset=str(tmp_path)))


@pytest.fixture
def folder_with_bad_image(tmp_path):
  write_folder(tmp_path, 'train', 3)
  write_folder(tmp_path, 'test', 1)
  bad = tmp_path / 'train' / 'coat' / 'broken.jpg'
  bad.write_bytes(b'\xff\xd8\xff not really a JPEG')
  return tmp_path, str(bad)


def test_undecodable_images_are_named_each_with_its_own_error(folder_with_bad_image):
  root, bad_jpeg = folder_with_bad_image
  empty_png = root / 'train' / 'sandal' / 'empty.png'
  empty_png.write_bytes(b'')
  with pytest.raises(ValueError, match='Cannot decode 2 image') as error:
    take(ip.train_batches(make_config(dataset=str(root))), 3)
  message = str(error.value)
  assert f'{bad_jpeg} (Invalid JPEG data' in message
  assert f'{empty_png} (Input is empty' in message
  assert message.endswith('or set config.skip_bad_images=True to skip (and count) them.')


def test_undecodable_test_image_is_found_before_training(tmp_path):
  write_folder(tmp_path, 'train', 1)
  write_folder(tmp_path, 'test', 1)
  bad = tmp_path / 'test' / 'bag' / 'cut.png'
  bad.write_bytes((tmp_path / 'test' / 'bag' / '0.png').read_bytes()[:40])
  with pytest.raises(ValueError, match=f"split 'test': {bad} "):
    ip.get_dataset_info(make_config(dataset=str(tmp_path)))
  assert ip.get_dataset_info(make_config(dataset=str(tmp_path), skip_bad_images=True)
                             ).num_test == 3


def test_undecodable_image_is_skipped_and_counted(folder_with_bad_image, caplog):
  root, bad = folder_with_bad_image
  config = make_config(dataset=str(root), skip_bad_images=True)
  with caplog.at_level(logging.WARNING):
    info = ip.get_dataset_info(config)
  assert info.num_train == 9
  assert f"Skipping 1 undecodable image(s) of 10 in {root} split 'train'" in caplog.text
  assert bad in caplog.text
  assert len(take(ip.train_batches(config), 3)) == 3


def test_unknown_dataset_name_is_explained():
  with pytest.raises(ValueError, match="'no_such_dataset' is neither 'fashion_mnist_embedded'"):
    ip.get_dataset_info(make_config(dataset='no_such_dataset'))


def test_a_name_tfds_cannot_parse_is_explained_in_one_line():
  # As from --config.fewshot.datasets=fashion_mnist_embedded, (a string, not a tuple).
  with pytest.raises(ValueError) as raised:
    ip.get_dataset_info(make_config(dataset='fashion_mnist_embedded,'))
  message = str(raised.value)
  assert '\n' not in message
  assert message.startswith("config.dataset='fashion_mnist_embedded,' is neither "), message
  assert message.endswith('failed). Fix the name or the path.'), message


@pytest.mark.parametrize('path', ['./my_images', '/no/such/folder', 'my_images/', 'data/images'])
def test_missing_folder_is_a_path_that_does_not_exist(path):
  with pytest.raises(FileNotFoundError, match=f"config.dataset='{path}' is a path, and no folder "
                                              'exists there'):
    ip.get_dataset_info(make_config(dataset=path))


def test_bad_split_is_explained(tfds_config_factory):
  with pytest.raises(ValueError, match="splits train and test, not 'validation'"):
    ip.get_dataset_info(make_config(test_split='validation'))
  with pytest.raises(ValueError, match=r"Bad split 'test\[:20000\]' for 'fashion_mnist_embedded'"):
    ip.get_dataset_info(make_config(test_split='test[:20000]'))
  with pytest.raises(ValueError, match="Bad split 'validation' for tfds dataset"):
    ip.get_dataset_info(tfds_config_factory(test_split='validation'))


def test_batch_sizes_that_do_not_divide_are_explained(mesh):
  with pytest.raises(ValueError, match='config.batch=9 is not divisible by the number of proc'):
    next(ip.train_batches(make_config(batch=9), process_count=2))
  with pytest.raises(ValueError, match="config.batch_eval=10 is not divisible by the 4 devices"):
    ip.get_eval_iterator(make_config(batch_eval=10), mesh)
  with pytest.raises(ValueError, match='config.pp.resize=20 is smaller than config.pp.crop=28'):
    next(ip.eval_batches(make_config(pp=dict(resize=20))))


def test_shuffle_buffer_comes_from_the_config_alone():
  config = make_config()
  del config['shuffle_buffer']  # No second default (the config's is vit_jax/config/defaults.py's).
  with pytest.raises(AttributeError, match='shuffle_buffer'):
    sources.get_source(config)

"""Can the input pipeline keep up with training? Images per second of both, on this machine.

Measures, one after the other in one run:
  1. training images per second out of `get_train_iterator` (decoded, Inception-cropped, resized,
     flipped, on the device) at `--crop` px, from the embedded dataset and from an image folder of
     JPEGs written for the benchmark;
  2. images per second of one jitted ViT-S_16 training step (forward, backward, SGD update) at
     batch `--step_batch`,
and prints the ratio; above 1 the accelerator does not wait on the host. Also times the check a
run makes before it compiles, that each image of the folder's test split decodes
(`pipeline.get_dataset_info`).

  python benchmarks/input_pipeline.py
  python benchmarks/input_pipeline.py --crop 64 --folder_image_size 3000 --model ViT-Ti_16 \\
      --step_batch 128  # Photos of 9 megapixels for a small model.
"""
import argparse
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from PIL import Image

from vit_jax import hardware
from vit_jax.data import pipeline
from vit_jax.data import embedded
from vit_jax.data import image_files
from vit_jax.models import registry


def pipeline_config(dataset: str, crop: int, batch: int) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      dataset=dataset, tfds_data_dir=None, tfds_manual_dir=None, train_split='train',
      test_split='test', pp=dict(crop=crop, resize=None, flip=True, inception_crop=True),
      batch=batch, batch_eval=batch, seed=0, skip_bad_images=False, shuffle_buffer=1000,
      prefetch=2))


def write_image_folder(root: str, images_per_class: int, size: int, orientation: int = 1):
  """Writes embedded Fashion-MNIST images, upscaled to size x size RGB JPEGs, as an image folder;
  with an `orientation` other than 1, each JPEG carries that EXIF orientation tag."""
  tags = Image.Exif()
  tags[image_files.EXIF_ORIENTATION] = orientation
  exif = tags.tobytes() if orientation != 1 else b''
  with np.load(embedded.PATH) as data:
    images, labels, names = data['train_images'], data['train_labels'], data['label_names']
  for split in ('train', 'test'):
    for label, name in enumerate(names):
      class_dir = os.path.join(root, split, name.replace('/', '_'))
      os.makedirs(class_dir)
      for i, image in enumerate(images[labels == label][:images_per_class]):
        rgb = Image.fromarray(image).convert('RGB').resize((size, size), Image.BILINEAR)
        rgb.save(os.path.join(class_dir, f'{i}.jpg'), quality=90, exif=exif)


def pipeline_images_per_second(config, mesh, num_batches: int) -> float:
  """Training images per second out of the iterator, after a warm-up batch."""
  batches = pipeline.get_train_iterator(config, mesh)
  jax.block_until_ready(next(batches))
  start = time.perf_counter()
  for _ in range(num_batches):
    batch = next(batches)
  jax.block_until_ready(batch)
  return num_batches * config.batch / (time.perf_counter() - start)


def train_step_images_per_second(model_name: str, crop: int, batch: int, steps: int) -> float:
  """Images per second of a jitted forward + backward + SGD update, after a warm-up step."""
  model = registry.get_model(model_name, num_classes=10)
  images = jnp.zeros((batch, crop, crop, 3), jnp.float32)
  labels = jnp.zeros((batch,), jnp.int32)
  params = jax.jit(model.init, static_argnames='train')(
      jax.random.key(0), images, train=False)['params']
  optimizer = optax.sgd(0.01)

  def loss_fn(params, images, labels):
    logits = model.apply({'params': params}, images, train=True,
                         rngs={'dropout': jax.random.key(1)})
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  @jax.jit
  def step(params, opt_state, images, labels):
    loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  state = (params, optimizer.init(params))
  jax.block_until_ready(step(*state, images, labels))
  start = time.perf_counter()
  for _ in range(steps):
    *state, loss = step(*state, images, labels)
  jax.block_until_ready(loss)
  return steps * batch / (time.perf_counter() - start)


def main():
  hardware.skip_absent_tpu()  # No libtpu start-up (and its warnings) on a host without TPUs.
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--crop', type=int, default=224)
  parser.add_argument('--batch', type=int, default=32, help='Pipeline batch.')
  parser.add_argument('--batches', type=int, default=30, help='Pipeline batches timed.')
  parser.add_argument('--folder_image_size', type=int, default=384)
  parser.add_argument('--orientation', type=int, default=1,
                      help="The EXIF orientation tag of the folder's JPEGs (1: none; 6: a phone "
                      'held upright, turned as it is read).')
  parser.add_argument('--model', default='ViT-S_16')
  parser.add_argument('--step_batch', type=int, default=16)
  parser.add_argument('--steps', type=int, default=3)
  args = parser.parse_args()

  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(-1, 1), ('data', 'model'))
  print(f'{os.cpu_count()} CPU cores, devices: {jax.devices()}')
  arrays = pipeline_images_per_second(
      pipeline_config(embedded.DATASET, args.crop, args.batch), mesh, args.batches)
  print(f'pipeline, embedded 28 px -> {args.crop} px: {arrays:8.1f} img/s')
  with tempfile.TemporaryDirectory() as root:
    write_image_folder(root, images_per_class=32, size=args.folder_image_size,
                       orientation=args.orientation)
    config = pipeline_config(root, args.crop, args.batch)
    start, cpu = time.perf_counter(), time.process_time()
    num_test = pipeline.get_dataset_info(config).num_test
    print(f'start-up check that the {num_test} test images decode: '
          f'{time.perf_counter() - start:.2f} s ({time.process_time() - cpu:.2f} CPU-s)')
    folder = pipeline_images_per_second(config, mesh, args.batches)
  print(f'pipeline, folder JPEG {args.folder_image_size} px (EXIF orientation '
        f'{args.orientation}) -> {args.crop} px: {folder:8.1f} img/s')
  step = train_step_images_per_second(args.model, args.crop, args.step_batch, args.steps)
  print(f'{args.model} train step, batch {args.step_batch}: {step:8.1f} img/s')
  print(f'ratio pipeline / train step: embedded {arrays / step:.1f}x, '
        f'folder {folder / step:.1f}x')


if __name__ == '__main__':
  main()

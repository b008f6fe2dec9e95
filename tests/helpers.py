"""What many tests share: tiny models, random parameters and images, the tiny training run.

Import it from a test file (`import helpers`; pytest puts tests/ on the path). The trained
run itself is the session fixture `trained_run` of conftest.py.
"""
import os

import jax
import numpy as np
from PIL import Image

from vit_jax.models import analysis
from vit_jax.models import blank
from vit_jax.models import vit
import tiny_config as tiny_config_file

TESTS = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(TESTS, 'data')
TINY_CONFIG = os.path.join(TESTS, 'tiny_config.py')  # A --config= file.
# Real photos: two ImageNet validation images (classes 243 and 438), one of class 129, and a
# 32x32 CIFAR-10 test image (class 3).
PHOTOS = [os.path.join(DATA, name) for name in
          ('imagenet_00_243.jpg', 'imagenet_02_438.jpg', 'imagenet_14_129.jpg', 'cifar10_00_3.png')]
# A ViT of 4x4 patches, 16 px images in 16 tokens (+ class token), 2 layers of 3 heads.
TINY_VIT = dict(patch_size=(4, 4), hidden_size=12, mlp_dim=20, num_heads=3, num_layers=2)


def tiny_vit(num_classes=5, **overrides) -> vit.VisionTransformer:
  """The TINY_VIT model with `overrides` of its fields."""
  return vit.VisionTransformer(num_classes=num_classes, **{**TINY_VIT, **overrides})


def random_params(model, image_size, seed=0, scale=1.0):
  """Random nonzero float32 parameters (head and cls included) of `model` for square images of
  `image_size` pixels, or (height, width); normal with standard deviation `scale`.

  Only the shapes come from the model (jax.eval_shape): nothing is compiled.
  """
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda x: scale * rng.normal(size=x.shape).astype(np.float32),
                      blank.param_shapes(model, image_size))


def images_of(size=16, batch=2, seed=0) -> np.ndarray:
  """(batch, size, size, 3) float32 images, uniform in [-1, 1] as the input pipeline scales."""
  return np.random.default_rng(seed).uniform(-1, 1, (batch, size, size, 3)).astype(np.float32)


def tiny_config(**overrides):
  """The config of tests/tiny_config.py (the tiny model on the embedded Fashion-MNIST), updated."""
  config = tiny_config_file.get_config()
  config.update(overrides)
  return config


def write_image_folder(root, per_class: dict[str, int], class_ids=(1, 8)) -> str:
  """Writes an image folder of the embedded data, `root/<split>/<class name>/<i>.png`, with
  `per_class[split]` images of each of the classes `class_ids` (default Trouser and Bag), each
  folder named after its class; returns `root` as a string."""
  from vit_jax.data import embedded
  with np.load(embedded.PATH) as data:
    for split, count in per_class.items():
      for class_id in class_ids:
        folder = os.path.join(root, split, str(data['label_names'][class_id]))
        os.makedirs(folder)
        images = data[f'{split}_images'][data[f'{split}_labels'] == class_id][:count]
        for i, image in enumerate(images):
          Image.fromarray(image).save(os.path.join(folder, f'{i}.png'))
  return str(root)


def xla_flags(devices: int | None) -> str:
  """This session's XLA_FLAGS (conftest.py's) for a process with `devices` simulated CPU devices,
  or with JAX's own count if None."""
  count = '--xla_force_host_platform_device_count'
  flags = [flag for flag in os.environ.get('XLA_FLAGS', '').split() if not flag.startswith(count)]
  return ' '.join(flags + ([f'{count}={devices}'] if devices else []))


# The harness's settings (tests/conftest.py), none of which a user has.
HARNESS_VARIABLES = ('XLA_FLAGS', 'JAX_PLATFORMS', 'JAX_COMPILATION_CACHE_DIR',
                     'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS',
                     'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', 'JAX_NUM_CPU_DEVICES',
                     'TF_CPP_MIN_LOG_LEVEL')


def user_env() -> dict[str, str]:
  """The environment of a user's shell: this one without HARNESS_VARIABLES."""
  return {name: value for name, value in os.environ.items() if name not in HARNESS_VARIABLES}


def read_scalars(workdir) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} of the TensorBoard scalars in `workdir`."""
  return {tag: dict(zip(steps.tolist(), values.tolist()))
          for tag, (steps, values) in analysis.read_scalars(str(workdir)).items()}


def noting_tensorflow(module: str) -> list[str]:
  """Python's arguments that run `python -m module` and print at its exit whether it imported
  TensorFlow (`tensorflow imported: False`), which takes several CPU-s to import."""
  code = ('import atexit, runpy, sys; atexit.register(lambda: print("tensorflow imported:", '
          f'"tensorflow" in sys.modules)); sys.argv[0] = {module.split(".")[-1]!r}; '
          f'runpy.run_module({module!r}, run_name="__main__")')
  return ['-c', code]


def wide_image(path) -> str:
  """A 40 x 80 px PNG: its middle 40 columns green, 20 red ones each side."""
  pixels = np.zeros((40, 80, 3), np.uint8)
  pixels[:, :20, 0] = pixels[:, 60:, 0] = 255
  pixels[:, 20:60, 1] = 255
  Image.fromarray(pixels).save(path)
  return str(path)

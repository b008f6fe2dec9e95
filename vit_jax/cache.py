"""What vit_jax keeps between runs, in one folder: `$VIT_JAX_CACHE`, default ~/.cache/vit_jax.

It holds the published checkpoints once downloaded (`published.fetch`) and, under `xla/`, the
programs XLA compiled (`hardware.use_compilation_cache`).
"""
import os

CACHE_ENV = 'VIT_JAX_CACHE'
DEFAULT_CACHE = os.path.join('~', '.cache', 'vit_jax')


def cache_dir() -> str:
  """The cache folder: $VIT_JAX_CACHE, else ~/.cache/vit_jax."""
  return os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)

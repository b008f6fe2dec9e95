"""A tiny model on the embedded Fashion-MNIST that trains in seconds: for tests.

Importable by the tests, and usable on the command line:
`python -m vit_jax.main --config=tests/tiny_config.py --workdir=DIR`.
"""
from vit_jax.config import defaults
from vit_jax.models import registry


def get_config():
  config = defaults.get_config()
  config.model = registry.vit('tiny', patch=7, hidden=32, mlp=64, heads=2, layers=1)
  config.model_name = 'tiny'
  config.pp.crop = 28
  config.pp.inception_crop = False
  config.test_split = 'test[:2000]'
  config.evals.fewshot.datasets = ()  # The default run's few-shot evaluation: tests turn it on.
  config.update(dict(batch=64, batch_eval=1000, total_steps=60, warmup_steps=5, base_lr=1e-2,
                     label_smoothing=0.0, progress_every=20, eval_every=60, checkpoint_every=20))
  return config

"""`--config=configs/finetune.py:CROP`: the default run continued at CROP pixels (default 56).

Starts from the default run's model (`workdirs/default`, which `python -m vit_jax.main` trains;
`--config.pretrained_path=...` for another) on the same data and classes, keeps its head,
interpolates the position embeddings, and fine-tunes with the paper's transfer recipe
(`vit_jax.config.continued_at`: momentum SGD at 0.03, no weight decay, cosine decay, gradient
clipping at 1) for STEPS updates. docs/finetuning.md has what it reaches.
"""
import ml_collections

from vit_jax import config as defaults

STEPS = 300


def get_config(arg: str = '56') -> ml_collections.ConfigDict:
  if not arg.isdigit():
    raise ValueError(f'--config=configs/finetune.py:{arg}: give the resolution in pixels, e.g. 56.')
  return defaults.continued_at(defaults.get_config(), int(arg), 'workdirs/default', STEPS)

"""`--config=configs/finetune.py:CROP`: the default run continued at CROP pixels (default 56).

Starts from the default run's model (`workdirs/default`, which `python -m vit_jax.main` trains;
`--config.pretrained_path=...` for another) on the same data and classes, keeps its head, grows
the patches with the images (7 to 14 px at 56 px, the patch-embedding kernel resized, so the
model starts as accurate as it was), and fine-tunes with the paper's transfer recipe
(`vit_jax.config.defaults.continued_at`: momentum SGD at 0.03, no weight decay, cosine decay,
gradient clipping at 1) for STEPS updates. `"--config.model.patches.size=(7,7)"` keeps the patch
size instead (4 times the tokens; the first layer relearns). docs/finetuning.md has what each
reaches.
"""
import ml_collections

from vit_jax.config import defaults

STEPS = 300


def get_config(arg: str = '56') -> ml_collections.ConfigDict:
  if not arg.isdigit():
    raise ValueError(f'--config=configs/finetune.py:{arg}: give the resolution in pixels, e.g. 56.')
  return defaults.continued_at(defaults.get_config(), int(arg), 'workdirs/default', STEPS)

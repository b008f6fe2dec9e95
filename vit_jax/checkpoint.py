"""`python -m vit_jax.checkpoint --list`: the published checkpoints
(`vit_jax.checkpoints.published`).

Imported, this module offers the public names of the modules that were once this one:
`vit_jax.checkpoints.npz`, `.finetune` and `.runs`.
"""
import runpy

if __name__ == '__main__':
  runpy.run_module('vit_jax.checkpoints.published', run_name='__main__', alter_sys=True)
else:
  from vit_jax.checkpoints.finetune import *  # noqa: F403
  from vit_jax.checkpoints.npz import *  # noqa: F403
  from vit_jax.checkpoints.runs import *  # noqa: F403

"""`python -m vit_jax.convert`, the command of
`vit_jax.checkpoints.convert`, where its code lives.

Imported, this module is that module itself (its name before the subpackages).
"""
import runpy
import sys

if __name__ == '__main__':
  runpy.run_module('vit_jax.checkpoints.convert', run_name='__main__', alter_sys=True)
else:
  from vit_jax.checkpoints import convert
  sys.modules[__name__] = convert

"""`python -m vit_jax.plan`, the command of
`vit_jax.tools.plan`, where its code lives.

Imported, this module is that module itself (its name before the subpackages).
"""
import runpy
import sys

if __name__ == '__main__':
  runpy.run_module('vit_jax.tools.plan', run_name='__main__', alter_sys=True)
else:
  from vit_jax.tools import plan
  sys.modules[__name__] = plan

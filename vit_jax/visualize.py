"""`python -m vit_jax.visualize`, the command of
`vit_jax.tools.visualize`, where its code lives.

Imported, this module is that module itself (its name before the subpackages).
"""
import runpy
import sys

if __name__ == '__main__':
  runpy.run_module('vit_jax.tools.visualize', run_name='__main__', alter_sys=True)
else:
  from vit_jax.tools import visualize
  sys.modules[__name__] = visualize

"""`python -m vit_jax.export`, the command of
`vit_jax.tools.export`, where its code lives.

Imported, this module is that module itself (its name before the subpackages).
"""
import runpy
import sys

if __name__ == '__main__':
  runpy.run_module('vit_jax.tools.export', run_name='__main__', alter_sys=True)
else:
  from vit_jax.tools import export
  sys.modules[__name__] = export

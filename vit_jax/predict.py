"""`python -m vit_jax.predict`, the command of
`vit_jax.tools.predict`, where its code lives.

Imported, this module is that module itself (its name before the subpackages).
"""
import runpy
import sys

if __name__ == '__main__':
  runpy.run_module('vit_jax.tools.predict', run_name='__main__', alter_sys=True)
else:
  from vit_jax.tools import predict
  sys.modules[__name__] = predict

"""`python -m vit_jax.fewshot`, the command of `vit_jax.tools.fewshot`, where its code lives.

Imported, this module is `vit_jax.evaluators.linear_probe`, the few-shot method that it held
before the subpackages.
"""
import runpy
import sys

if __name__ == '__main__':
  runpy.run_module('vit_jax.tools.fewshot', run_name='__main__', alter_sys=True)
else:
  from vit_jax.evaluators import linear_probe
  sys.modules[__name__] = linear_probe

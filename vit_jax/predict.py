"""`python -m vit_jax.predict`: the command of `vit_jax.tools.predict`, where its code lives.

Imported, this module offers the public names of the two modules that were once this one:
`vit_jax.tools.predict` (the command) and `vit_jax.data.image_files` (`load_image`,
`load_labels`, which `export` and `visualize` use).
"""
import runpy

if __name__ == '__main__':
  runpy.run_module('vit_jax.tools.predict', run_name='__main__', alter_sys=True)
else:
  from vit_jax.data.image_files import *  # noqa: F403
  from vit_jax.tools.predict import *  # noqa: F403

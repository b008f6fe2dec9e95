"""`python -m vit_jax.export`: the command of `vit_jax.tools.export`,
where its code lives. Imported, this module is that module (`vit_jax.command_moved`)."""
import vit_jax

vit_jax.command_moved(__name__, 'vit_jax.tools.export')

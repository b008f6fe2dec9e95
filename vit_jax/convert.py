"""`python -m vit_jax.convert`: the command of `vit_jax.checkpoints.convert`,
where its code lives. Imported, this module is that module (`vit_jax.command_moved`)."""
import vit_jax

vit_jax.command_moved(__name__, 'vit_jax.checkpoints.convert')

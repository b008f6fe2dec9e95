"""`python -m vit_jax.fewshot`: the command of `vit_jax.tools.fewshot`, where its code lives.
Imported, this module is `vit_jax.evaluators.linear_probe`, the few-shot method it held before
the subpackages (`vit_jax.command_moved`)."""
import vit_jax

vit_jax.command_moved(__name__, 'vit_jax.tools.fewshot', library='vit_jax.evaluators.linear_probe')

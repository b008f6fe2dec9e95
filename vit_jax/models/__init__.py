"""The Vision Transformer and its hybrid stem as Flax modules, the registry of models, their
FLOPs, what the attention looks at; `python -m vit_jax.models` lists them."""
import vit_jax

# The names that `vit_jax.models` offered when it was a module.
__getattr__ = vit_jax.forward_old_names(__name__,
                                        ('vit_jax.models.registry', 'vit_jax.models.flops'))

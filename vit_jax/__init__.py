"""vit_jax: the Vision Transformer in JAX/Flax."""

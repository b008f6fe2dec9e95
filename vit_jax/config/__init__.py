"""The default run, the help and ranges of config fields, the checks run before compiling, and
the --config flag of the commands."""
import vit_jax

# The names that `vit_jax.config` offered when it was a module.
__getattr__ = vit_jax.forward_old_names(__name__, ('vit_jax.config.defaults',))

"""The default run, as a config file: `--config=configs/default.py` is what no `--config` gives.

It is defined in the package (`vit_jax.config.get_config`), so that an installed vit_jax trains
it from any directory; copy that function here to make a run of your own.
"""
from vit_jax.config.defaults import get_config  # noqa: F401 (re-exported)

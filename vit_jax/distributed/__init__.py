"""Runs of several processes: their start, their heartbeats, the one line that names a gone one.

This package's modules import nothing of it here: `python -m vit_jax.distributed.gone_process`
starts in a fraction of a second, with the standard library only.
"""

"""The library modules that moved into subpackages: {old name: new dotted name}.

`from vit_jax import train` and the like still work: `vit_jax.__getattr__` imports the new
module on first use, with a DeprecationWarning that names it. The commands that moved keep a
module of their old name, so that `python -m vit_jax.NAME` runs as before (vit_jax/predict.py
and its like); `vit_jax.models` and `vit_jax.config` are now packages that forward their old
names (`vit_jax.models.get_model`, `vit_jax.config.get_config`).
"""
MOVED = {
    'analysis': 'vit_jax.models.analysis',
    'fit': 'vit_jax.training.fit',
    'input_pipeline': 'vit_jax.data.pipeline',
    'input_pipeline_sources': 'vit_jax.data.sources',
    'model_init': 'vit_jax.models.blank',
    'models_resnet': 'vit_jax.models.resnet',
    'models_vit': 'vit_jax.models.vit',
    'mpp': 'vit_jax.tasks.mpp',
    'positions': 'vit_jax.models.positions',
    'published': 'vit_jax.checkpoints.published',
    'randaugment': 'vit_jax.data.randaugment',
    'registry': 'vit_jax.models.registry',
    'summaries': 'vit_jax.training.summaries',
    'torch_layout': 'vit_jax.checkpoints.torch_layout',
    'train': 'vit_jax.training.trainer',
    'train_checkpoints': 'vit_jax.training.state_checkpoints',
    'train_setup': 'vit_jax.training.setup',
    'train_step': 'vit_jax.training.step',
    'validation': 'vit_jax.config.checks',
}

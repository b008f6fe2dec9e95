"""Installs vit_jax (its registry and default config included).

The tested versions are pinned in requirements.txt.
"""
import setuptools

setuptools.setup(
    name='vit_jax',
    version='0.1.0',
    description='Vision Transformer (ViT) in JAX/Flax: models, checkpoints, training.',
    python_requires='>=3.10',
    packages=setuptools.find_packages(include=['vit_jax', 'vit_jax.*']),
    package_data={'vit_jax': ['data/*']},
    install_requires=[
        'jax>=0.10',
        'flax>=0.12',
        'optax>=0.2.8',
        'orbax-checkpoint>=0.12',
        'clu>=0.0.12',
        'ml-collections>=1.1',
        'tensorflow-datasets>=4.9',
        'importlib_resources>=5',  # tfds prepares datasets with it; declares it for Python < 3.9.
        'tensorflow-cpu>=2.21',
        'tensorboard>=2.21',
        'numpy>=2.0',
        'scipy>=1.13',
        'safetensors>=0.7',
        'pillow>=11',
        'matplotlib>=3.10',
        'tqdm>=4.60',
        'filelock>=3.0',  # JAX bounds its compilation cache with it.
    ],
)

"""`--config=configs/segmentation.py[:FROM]`: segmentation of the embedded Fashion-MNIST canvases
(`fashion_mnist_segmentation`: 2 to 4 items on 56 x 56 px, 11 classes with the background;
vit_jax/data/segmentation.py) by the default run's ViT with a linear head per patch, upsampled
bilinearly to the pixels (vit_jax/tasks/segmentation.py).

The encoder sees each canvas as 2 x 2 tiles of 28 px (`config.seg.window`), the images the default
run learned from: each tile is encoded apart, with that run's class token and 4 x 4 position
embeddings as they are, and the tiles' patch maps are joined for the head (docs/segmentation.md:
encoded whole, the canvas loses what pre-training gave).

FROM is the checkpoint to start from: by default `workdirs/default`, the model that
`python -m vit_jax.main` trains (its classifier's head dropped, a fresh `seg_head`); any workdir
or .npz of the same model; or `scratch` for the same model untrained. Either way the same STEPS
steps of AdamW on batches of BATCH canvases with random flips of image and mask together; the
test split is evaluated at the end (pixel accuracy and mIoU). docs/segmentation.md compares the
two starts.
"""
import ml_collections

from vit_jax.config import defaults

STEPS = 300
BATCH = 32
SCRATCH = 'scratch'


def get_config(arg: str = 'workdirs/default') -> ml_collections.ConfigDict:
  config = defaults.get_config()
  config.objective = 'segmentation'
  config.dataset = 'fashion_mnist_segmentation'
  config.pp.crop = 56
  config.seg.window = 28
  config.label_smoothing = 0.0
  config.evals.fewshot.datasets = ()  # Few-shot evaluation classifies images; these are canvases.
  config.pretrained_path = None if arg == SCRATCH else arg
  config.batch = BATCH
  config.batch_eval = 500
  config.total_steps = STEPS
  config.warmup_steps = STEPS // 10
  config.base_lr = 1e-3
  config.progress_every = 50
  config.eval_every = config.checkpoint_every = STEPS
  return config

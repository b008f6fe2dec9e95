"""The 'segmentation' evaluator: pixel accuracy, mean IoU and per-pixel loss of a segmentation
model on a split (vit_jax/tasks/segmentation.py), as NAME_pixel_accuracy, NAME_miou and
NAME_loss. Runs of config.objective='segmentation' only; its entry takes the fields of the
'classification' evaluator's.

The confusion matrix of the labelled pixels is summed over the whole split before the scores are
taken, so that mIoU is that of the split, not a mean over batches.
"""
import ml_collections

from vit_jax.evaluators import classification
from vit_jax.tasks import segmentation


class SegmentationEvaluator(classification.ClassificationEvaluator):
  """A ClassificationEvaluator whose step is segmentation's (segmentation.make_eval_step) and
  whose metrics come from the summed confusion matrix (segmentation.scores)."""

  @staticmethod
  def make_eval_step(model, config: ml_collections.ConfigDict):
    """eval(params, batch) -> sums of confusion, loss, pixels, count."""
    return segmentation.make_eval_step(model, config)

  @staticmethod
  def config_error(where: str, entry: ml_collections.ConfigDict,
                   config: ml_collections.ConfigDict) -> str | None:
    del entry
    return classification.objective_error(where, 'segmentation', 'segmentation', config)

  def run(self, params) -> dict[str, float]:
    totals, _ = classification.summed(self.eval_step, params, self.data, self.mesh)
    accuracy, miou = segmentation.scores(totals['confusion'])
    return {f'{self.name}_pixel_accuracy': accuracy, f'{self.name}_miou': miou,
            f'{self.name}_loss': float(totals['loss'] / max(totals['pixels'], 1))}

  def line(self, metrics: dict[str, float], seconds: float) -> str:
    """'NAME pixel accuracy A, mIoU M, loss L', and the EMA's pixel accuracy and mIoU where the
    run keeps one."""
    del seconds
    name = self.name
    ema = ''.join(f', EMA {what} {metrics[f"{name}_{key}_ema"]:.4f}'
                  for key, what in (('pixel_accuracy', 'pixel accuracy'), ('miou', 'mIoU'))
                  if f'{name}_{key}_ema' in metrics)
    return (f'{name} pixel accuracy {metrics[f"{name}_pixel_accuracy"]:.4f}, mIoU '
            f'{metrics[f"{name}_miou"]:.4f}, loss {metrics[f"{name}_loss"]:.4f}{ema}')

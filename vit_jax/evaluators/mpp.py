"""The 'mpp' evaluator: masked patch prediction's loss and accuracy on a split
(vit_jax/tasks/mpp.py), as NAME_mpp_loss and NAME_mpp_accuracy, every image corrupted by the
same fixed plan so that evaluations of different steps compare. Runs of
config.objective='masked_patch_prediction' only; its entry takes the fields of the
'classification' evaluator's."""
import ml_collections

from vit_jax.evaluators import classification
from vit_jax.tasks import mpp


class MppEvaluator(classification.ClassificationEvaluator):
  """A ClassificationEvaluator whose step is masked patch prediction's (mpp.make_eval_step)."""

  @staticmethod
  def make_eval_step(model, config: ml_collections.ConfigDict):
    """eval(params, batch) -> sums of mpp_loss, mpp_accuracy, count."""
    return mpp.make_eval_step(model, config)

  @staticmethod
  def config_error(where: str, entry: ml_collections.ConfigDict,
                   config: ml_collections.ConfigDict) -> str | None:
    del entry
    return classification.objective_error(where, 'mpp', 'masked_patch_prediction', config)

"""Tests of per-parameter learning rates and freezing (vit_jax/training/param_groups.py):
config.lr_mults, config.layer_decay and config.frozen, on the tiny models and their real
optimisers."""
import os
import runpy

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
import numpy as np
import pytest

import helpers
import preloaded
from vit_jax.config import checks
from vit_jax.models import blank
from vit_jax.models import registry
from vit_jax.training import param_groups
from vit_jax.training import resume
from vit_jax.training import step as train_step
from vit_jax.training import trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK_0 = 'Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel'


def flat(tree) -> dict:
  return {param_groups.path_name(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def train(config, steps=5):
  """(initial params, final state) after `steps` steps of the tiny config's model on random
  28 px images, on one device."""
  model = registry.get_model(config.model, num_classes=10)
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  optimizer = train_step.make_optimizer(config)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh, 28)
  initial = jax.tree.map(np.array, state.params)
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  batch = {'image': jax.random.uniform(jax.random.key(1), (8, 28, 28, 3), minval=-1, maxval=1),
           'label': jnp.arange(8) % 10}
  for _ in range(steps):
    state, metrics = step(state, batch)
    assert bool(metrics['finite'])
  return initial, state


@pytest.mark.parametrize('optimizer, scan', [('adamw', False), ('sgd', True)])
def test_frozen_params_stay_bit_identical_and_have_no_optimiser_state(optimizer, scan):
  config = helpers.tiny_config(
      optimizer=optimizer, weight_decay=0.1, base_lr=0.1, warmup_steps=1, accum_steps=2,
      ema_decay=0.9, scan_layers=scan, frozen='^embedding|^Transformer/encoderblock_0/',
      lr_mults=(('^head/bias', 0.0),))
  initial, state = train(config)
  final = flat(state.params)
  for name, before in flat(initial).items():
    if name.startswith(('embedding/', 'Transformer/encoderblock', 'head/bias')):
      np.testing.assert_array_equal(final[name], before, err_msg=name)  # Bit-identical.
    else:
      assert not np.array_equal(final[name], before), name
  # The optimiser state holds arrays of the trainable params only (Adam's mu and nu, SGD's
  # momentum): none shaped like the frozen kernels.
  state_shapes = [leaf.shape for leaf in jax.tree.leaves(state.opt_state)]
  assert (32, 64) not in state_shapes and (1, 32, 64) not in state_shapes  # The MLP kernel.
  assert final['head/kernel'].shape in state_shapes
  moments = 2 if optimizer == 'adamw' else 1
  trainable = [name for name in final if not name.startswith(('embedding/', 'Transformer/enc'))
               or name.startswith('Transformer/encoder_norm')]
  assert sum(leaf.size for leaf in jax.tree.leaves(state.opt_state) if leaf.ndim) == (
      moments * sum(final[name].size for name in trainable))


def step_flops(config) -> float:
  """XLA's count of the FLOPs of the tiny model's compiled training step, batch 8 at 28 px."""
  model = registry.get_model(config.model, num_classes=10)
  mesh = Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ('data', 'model'))
  optimizer = train_step.make_optimizer(config)
  state, shardings = train_step.create_train_state(config, model, optimizer, mesh, 28)
  step = train_step.jit_train_step(model, optimizer, config, mesh, shardings)
  batch = {'image': jax.ShapeDtypeStruct((8, 28, 28, 3), jnp.float32),
           'label': jax.ShapeDtypeStruct((8,), jnp.int32)}
  return step.lower(state, batch).compile().cost_analysis()['flops']


def test_a_frozen_backbone_is_left_out_of_backpropagation():
  # Backpropagation costs about twice the forward pass: a linear probe's step, which only
  # differentiates the head, needs about a third of the full step's FLOPs.
  full = step_flops(helpers.tiny_config())
  probe = step_flops(helpers.tiny_config(frozen='^(?!head/)'))
  assert probe < 0.45 * full, (probe, full)


def test_layer_decay_multipliers_match_hand_computed_ones():
  # d = 0.5, L = 2: embeddings d^3, block 0 d^2, block 1 d, final norm and head 1.
  expected = {'embeddings': 0.125, 'Transformer/encoderblock_0': 0.25,
              'Transformer/encoderblock_1': 0.5, 'Transformer/encoder_norm': 1.0, 'head': 1.0}
  for scan in (False, True):
    params = blank.param_shapes(helpers.tiny_vit(num_layers=2, scan_layers=scan), 16)
    assert {group: mult for group, _, mult in param_groups.table(params, decay=0.5)} == expected
    # The transformation scales real updates so: a scanned leaf layer by layer.
    ones = jax.tree.map(lambda x: jnp.ones(x.shape), params)
    scaled = flat(param_groups.scale_updates(ones, None, 0.5, 2))
    for name, mult in (('cls', 0.125), ('embedding/kernel', 0.125),
                       ('Transformer/posembed_input/pos_embedding', 0.125),
                       ('Transformer/encoder_norm/scale', 1.0), ('head/kernel', 1.0)):
      np.testing.assert_array_equal(scaled[name], mult)
    if scan:
      kernel = scaled['Transformer/encoderblock/MlpBlock_0/Dense_0/kernel']
      np.testing.assert_array_equal(kernel[0], 0.25)
      np.testing.assert_array_equal(kernel[1], 0.5)
    else:
      np.testing.assert_array_equal(scaled[BLOCK_0], 0.25)
      np.testing.assert_array_equal(scaled['Transformer/encoderblock_1/LayerNorm_0/bias'], 0.5)


def test_hybrid_stem_counts_as_embeddings_and_lr_mults_multiply_the_layer_decay():
  params = blank.param_shapes(helpers.tiny_vit(num_layers=2, resnet_layers=()), 16)
  assert param_groups.leaf_multipliers('conv_root/kernel', 2, None, 0.5) == 0.125
  assert param_groups.leaf_multipliers('gn_root/scale', 2, None, 0.5) == 0.125
  assert 'conv_root/kernel' in flat(params)
  assert param_groups.leaf_multipliers(BLOCK_0, 2, [('Dense_0', 4.0)], 0.5) == 1.0


def test_lr_mults_first_match_wins():
  mults = [('^head', 10.0), ('kernel', 0.5), ('encoderblock_0', 2.0)]
  assert param_groups.lr_mult('head/kernel', mults) == 10.0
  assert param_groups.lr_mult(BLOCK_0, mults) == 0.5
  assert param_groups.lr_mult('Transformer/encoderblock_0/LayerNorm_0/bias', mults) == 2.0
  assert param_groups.lr_mult('cls', mults) == 1.0  # Unmatched.
  # Scanned blocks: layer i answers to the unscanned name of block i.
  scanned = param_groups.leaf_multipliers('Transformer/encoderblock/LayerNorm_0/bias', 3,
                                          [('encoderblock_1/', 3.0)], None)
  np.testing.assert_array_equal(scanned, [1.0, 3.0, 1.0])


@pytest.mark.parametrize('overrides, message', [
    ({'frozen': '(head'}, "config.frozen='(head' is not a valid regex (missing ), unterminated "
                          'subpattern at position 0).'),
    ({'frozen': '^nothing'}, "config.frozen='^nothing' matches no parameter: parameters are named "
                             "like 'Transformer/encoder_norm/bias' (blocks "
                             "'Transformer/encoderblock_{i}/...', scanned or not)."),
    ({'frozen': '.'}, "config.frozen='.' freezes every parameter: leave some trainable, e.g. "
                      "'^(?!head)' trains the head only."),
    ({'layer_decay': 1.5}, 'config.layer_decay=1.5 must be None (off) or 0 (off) or in (0, 1].'),
    ({'layer_decay': -0.5}, 'config.layer_decay=-0.5 must be None (off) or 0 (off) or in (0, 1].'),
    ({'lr_mults': (('^head', -1.0),)}, "config.lr_mults entry ('^head', -1.0): the multiplier "
                                       'must be a finite number >= 0.'),
    ({'lr_mults': (('^head[', 2.0),)}, "config.lr_mults entry ('^head[', 2.0) is not a valid "
                                       'regex (unterminated character set at position 5).'),
    ({'scan_layers': True, 'frozen': 'encoderblock_0/'},
     "config.frozen='encoderblock_0/' freezes some layers of the scanned "
     'Transformer/encoderblock/LayerNorm_0/bias only: freeze whole layers of all blocks, or set '
     '--config.scan_layers=False.'),
])
def test_config_errors_are_one_line(overrides, message):
  config = helpers.tiny_config(**overrides)
  config.model.transformer.num_layers = 2
  with pytest.raises(checks.ConfigError) as error:
    checks.validate_config(config, 1)
  assert str(error.value) == message


def test_a_resume_keeps_frozen_but_may_change_the_multipliers(tmp_path):
  import json
  config = helpers.tiny_config()
  resume.write_config(config, str(tmp_path))
  saved = json.loads((tmp_path / 'config.json').read_text())
  for field in ('lr_mults', 'layer_decay', 'frozen'):
    del saved[field]  # As a version without them wrote it.
  (tmp_path / 'config.json').write_text(json.dumps(saved))
  assert resume.resume_mismatches(config, str(tmp_path)) == []
  config.layer_decay, config.lr_mults = 0.75, (('^head', 10.0),)
  assert resume.resume_mismatches(config, str(tmp_path)) == []
  config.frozen = '^(?!head)'
  assert resume.resume_mismatches(config, str(tmp_path)) == [
      "frozen (saved 'None', now '^(?!head)')"]


def test_a_linear_probe_from_the_command_line(tmp_path, caplog):
  # Frozen but the head: trained 4 steps here with a checkpoint at 2 and 4, then resumed to 6
  # from the command line with another layer decay (the optimiser state does not depend on the
  # multipliers) and the frozen regex as a flag.
  settings = dict(frozen='^(?!head)', test_split='test[:200]', checkpoint_every=2, eval_every=4,
                  progress_every=2)
  groups = ('Parameter groups: 13,920 parameters frozen, 330 trainable, learning-rate '
            'multipliers from 1 to 1.')
  with caplog.at_level('INFO'):
    trainer.train_and_evaluate(helpers.tiny_config(**settings, total_steps=4, layer_decay=0.5),
                               str(tmp_path))
  assert groups in caplog.text
  flags = [f'--config.{name}={value}' for name, value in settings.items()]
  result = preloaded.run(
      ['-m', 'vit_jax.main', f'--config={helpers.TINY_CONFIG}', f'--workdir={tmp_path}', *flags,
       '--config.total_steps=6', '--config.layer_decay=0.75'],
      env={**os.environ, 'XLA_FLAGS': helpers.xla_flags(1)})
  output = result.stdout + result.stderr
  assert result.returncode == 0, output
  assert groups in output and 'Resuming from step 4' in output, output


def test_a_linear_probe_of_the_trained_run_reaches_its_25_shot_accuracy(trained_run, tmp_path):
  # The head alone trained on the frozen features of the tiny run, at a linear probe's larger
  # learning rate over a quarter of its training set (15,040 of its 60,000 images), against the
  # 25-shot regression vit_jax.fewshot fits on the same features (those of the probe's final
  # params: its backbone is frozen); both scored on the same 2,000 test images.
  config = helpers.tiny_config(
      pretrained_path=os.path.join(trained_run[0], 'model.npz'), frozen='^(?!head)',
      base_lr=0.1, total_steps=235, warmup_steps=25, eval_every=235, checkpoint_every=235,
      progress_every=235)
  config.pp.flip = False
  config.evals.fewshot.update(datasets=('config.dataset',), shots=(25,), num_test=2000)
  metrics = trainer.train_and_evaluate(config, str(tmp_path))
  few_shot = metrics['fewshot/fashion_mnist_embedded_25shot']
  assert metrics['test_accuracy'] >= few_shot, (metrics['test_accuracy'], few_shot)



def test_the_continuation_preset_keeps_the_types_that_command_line_overrides_need():
  # configs/finetune.py continues a copy of the default run; a field whose value is None is
  # overridden from the command line (the README's --config.layer_decay=0.75) only where the copy
  # kept its type, as absl's config flags read it.
  config = runpy.run_path(os.path.join(ROOT, 'configs', 'finetune.py'))['get_config']('56')
  assert config.layer_decay is None and config.get_type('layer_decay') is float
  assert config.frozen is None and config.get_type('frozen') is str

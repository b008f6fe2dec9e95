"""Exports a vit_jax model for timm, Hugging Face `transformers` or TensorFlow serving.

    python -m vit_jax.export --checkpoint WORKDIR --format timm --out vit.safetensors
    python -m vit_jax.export --checkpoint ViT-B_16.npz --model ViT-B_16 --format hf --out vit_hf
    python -m vit_jax.export --checkpoint WORKDIR --format saved_model --out vit_saved_model

`--checkpoint` is a training workdir or an `.npz`; files vit_jax wrote carry their model spec,
a published `.npz` needs `--model` (its registry name). The image size is the one the model was
trained at (its run's record, else the resolution of its position embeddings), square or (height,
width), which every format keeps. Formats:
- timm: one .safetensors with the state dict of timm's VisionTransformer (or, for hybrids, its
  `vit_*_r*` models); the arguments that build the matching timm model are printed and kept in
  the file's metadata (`timm_model`, `timm_model_args`).
- hf: a directory that `ViTForImageClassification.from_pretrained` and the `image-classification`
  pipeline read: `model.safetensors`, `config.json` (sizes, labels, `hidden_act` of the model's
  GELU, LayerNorm epsilon 1e-6) and `preprocessor_config.json` (bilinear resize, [-1, 1]).
- saved_model: a TensorFlow SavedModel made with jax2tf, serving `serving_default` (uint8
  images) and `serving_float` (float32 pixel values in [0, 255]), both (B, H, W, 3) of any B, H,
  W: resized bilinearly to the model's resolution (antialiased where it shrinks), scaled to
  [-1, 1], giving {'logits': (B, classes)}. The batch dimension is polymorphic, so one export
  serves any batch size; the model is lowered for CPU, CUDA GPUs and TPUs.
- tflite: the uint8 function, converted by TFLite's converter with its built-in ops only, at a
  fixed (1, height, width, 3): TFLite's converter cannot convert the polymorphic batch (taking the
  class token becomes a `dynamic_gather`, which it does not support).
A model a format cannot represent (a GAP or pre-logits model for Hugging Face, per-token logits
for timm...) is refused in one line that says why, before anything is written. An existing
--out is never overwritten.
"""
import argparse
import json
import os
import re
import sys
import tempfile
from typing import Optional

import numpy as np
import safetensors.numpy

from vit_jax import console
from vit_jax import errors
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import published
from vit_jax.checkpoints import runs
from vit_jax.checkpoints import torch_layout
from vit_jax.data import image_files
from vit_jax.models import blank
from vit_jax.models import encoder

FORMATS = ('timm', 'hf', 'saved_model', 'tflite')
LAYOUTS = {'timm': torch_layout.TIMM, 'hf': torch_layout.HUGGING_FACE}
# Platforms the SavedModel's XLA module is lowered for (jax2tf native serialization).
SERVING_PLATFORMS = ('cpu', 'cuda', 'tpu')
# timm's hybrid models, by (ResNet units per stage, hidden size).
TIMM_HYBRIDS = {((), 192): 'vit_tiny_r_s16_p8_224', ((2, 2, 2, 2), 384): 'vit_small_r26_s32_224',
                ((2, 2, 2, 2), 768): 'vit_base_r26_s32_224',
                ((3, 4, 9), 768): 'vit_base_r50_s16_224',
                ((3, 4, 6, 3), 1024): 'vit_large_r50_s32_224'}


class ExportError(ValueError):
  """The model cannot be represented in the requested format."""


def _timm_hybrid(model) -> str:
  units = tuple(model.resnet_layers)
  name = TIMM_HYBRIDS.get((units, model.hidden_size))
  if name is None or model.resnet_width_factor != 1:
    raise ExportError(f'timm has no hybrid of ResNet units {units}, width factor '
                      f'{model.resnet_width_factor} and hidden size {model.hidden_size}; its '
                      f'hybrids are {sorted(TIMM_HYBRIDS.values())}: use --format saved_model.')
  return name


def check_exportable(model, format_name: str) -> None:
  """An ExportError, saying why, if `format_name` cannot represent `model`."""
  if format_name in ('timm', 'hf') and model.posemb != 'learned_1d':
    raise ExportError(f"timm's and Hugging Face's ViTs add learned 1-D position embeddings; "
                      f"posemb='{model.posemb}' has other position information: use --format "
                      'saved_model.')
  if format_name == 'timm':
    if model.representation_size is not None:
      raise ExportError("timm's VisionTransformer has no pre-logits (representation) layer, and "
                        'the model has one: use --format saved_model.')
    if model.classifier not in ('token', 'gap'):
      raise ExportError(f"timm's ViT heads classify one pooled token; classifier="
                        f"'{model.classifier}' gives per-token logits: use --format saved_model.")
    if model.resnet_layers is not None:
      _timm_hybrid(model)
  elif format_name == 'hf':
    reason = None
    if model.classifier != 'token':
      reason = f"classifies the class token, and classifier='{model.classifier}' has none"
    elif model.representation_size is not None:
      reason = "has no pre-logits layer (ViTModel's tanh pooler does not feed the classifier)"
    elif model.resnet_layers is not None:
      reason = 'has no ResNet stem'
    if reason:
      raise ExportError(f"Hugging Face's ViTForImageClassification {reason}: use --format timm "
                        'or saved_model.')


def timm_model_args(model, image_size: blank.ImageSize) -> tuple[str, dict]:
  """(timm model name or 'VisionTransformer', keyword arguments) that build the exported model;
  img_size a side, or (height, width) for non-square images, as timm takes it."""
  args = dict(img_size=image_size if isinstance(image_size, int) else list(image_size),
              num_classes=model.num_classes,
              act_layer=torch_layout.TIMM_GELU[model.approximate_gelu])
  if model.classifier == 'gap':  # Mean of the patch tokens after the final LayerNorm.
    args.update(class_token=False, global_pool='avg', fc_norm=False)
  if model.resnet_layers is not None:
    return _timm_hybrid(model), args
  patch = model.patch_size[0] if model.patch_size[0] == model.patch_size[1] else model.patch_size
  return 'VisionTransformer', dict(
      patch_size=patch, embed_dim=model.hidden_size, depth=model.num_layers,
      num_heads=model.num_heads, mlp_ratio=model.mlp_dim / model.hidden_size, **args)


def hugging_face_config(model, image_size: blank.ImageSize, labels: list[str]) -> dict:
  """The `config.json` of ViTForImageClassification (ViTConfig's fields) for `model`;
  image_size a side, or [height, width] (ViTConfig takes either)."""
  return {
      'architectures': ['ViTForImageClassification'], 'model_type': 'vit',
      'hidden_size': model.hidden_size, 'num_hidden_layers': model.num_layers,
      'num_attention_heads': model.num_heads, 'intermediate_size': model.mlp_dim,
      'hidden_act': torch_layout.HUGGING_FACE_GELU[model.approximate_gelu],
      'hidden_dropout_prob': 0.0, 'attention_probs_dropout_prob': 0.0,
      'layer_norm_eps': encoder.LAYERNORM_EPS,
      'image_size': image_size if isinstance(image_size, int) else list(image_size),
      'patch_size': model.patch_size[0], 'num_channels': 3, 'qkv_bias': True,
      'encoder_stride': model.patch_size[0],
      'id2label': {str(i): name for i, name in enumerate(labels)},
      'label2id': {name: i for i, name in enumerate(labels)}, 'torch_dtype': 'float32',
  }


def hugging_face_preprocessor(image_size: blank.ImageSize) -> dict:
  """ViTImageProcessor's settings for our preprocessing: bilinear resize, x / 127.5 - 1."""
  height, width = blank.image_hw(image_size)
  return {'image_processor_type': 'ViTImageProcessor', 'do_resize': True,
          'size': {'height': height, 'width': width}, 'resample': 2,  # PIL bilinear.
          'do_rescale': True, 'rescale_factor': 1 / 255, 'do_normalize': True,
          'image_mean': [0.5] * 3, 'image_std': [0.5] * 3}


def state_dict(params: dict, format_name: str) -> dict[str, np.ndarray]:
  """The float32 state dict, contiguous, of `params` for 'timm' or 'hf'."""
  return {key: np.ascontiguousarray(value, np.float32)
          for key, value in torch_layout.to_state_dict(params, LAYOUTS[format_name]).items()}


def _write_json(value: dict, path: str) -> None:
  with open(path, 'w') as f:
    json.dump(value, f, indent=2)


def _write_safetensors(tensors: dict[str, np.ndarray], path: str, metadata: dict) -> None:
  """A .safetensors file opened as every other output is, so with the usual file mode (0644
  under umask 022; safetensors' own save_file makes 0600 files)."""
  with open(path, 'wb') as f:
    f.write(safetensors.numpy.save(tensors, metadata=metadata))


def write_timm(model, params, image_size: blank.ImageSize, out: str, labels: list[str]) -> None:
  del labels  # A timm state dict has no place for them.
  name, args = timm_model_args(model, image_size)
  _write_safetensors(state_dict(params, 'timm'), out, metadata={
      'format': 'pt', 'timm_model': name, 'timm_model_args': json.dumps(args)})


def write_hugging_face(model, params, image_size: blank.ImageSize, out: str,
                       labels: list[str]) -> None:
  os.makedirs(out)
  _write_safetensors(state_dict(params, 'hf'), os.path.join(out, torch_layout.HUGGING_FACE_WEIGHTS),
                     metadata={'format': 'pt'})
  _write_json(hugging_face_config(model, image_size, labels),
              os.path.join(out, torch_layout.HUGGING_FACE_CONFIG))
  _write_json(hugging_face_preprocessor(image_size),
              os.path.join(out, 'preprocessor_config.json'))


def serving_module(model, params, image_size: blank.ImageSize,
                   batch_size: Optional[int] = None):
  """A tf.Module holding `params` as variables, with the uint8 and float serving functions,
  which resize to `image_size` (a side, or (height, width)).

  With `batch_size` None they take (B, H, W, 3) images of any B, H and W, lowered for
  SERVING_PLATFORMS; otherwise (batch_size, height, width, 3), for the CPU alone (what TFLite
  converts).
  """
  # Imported here: only these formats need TensorFlow.
  import tensorflow as tf
  from jax.experimental import jax2tf
  from vit_jax.data import image_ops
  polymorphic = batch_size is None
  height, width = blank.image_hw(image_size)
  apply = jax2tf.convert(
      lambda p, x: model.apply({'params': p}, x, train=False), with_gradient=False,
      polymorphic_shapes=[None, f'(b, {height}, {width}, 3)' if polymorphic else None],
      native_serialization_platforms=SERVING_PLATFORMS if polymorphic else ('cpu',))
  module = tf.Module()
  module.params = tf.nest.map_structure(tf.Variable, params)

  @tf.function(autograph=False)
  def logits(images):
    images = image_ops.resize(tf.cast(images, tf.float32), image_size)
    return {'logits': apply(module.params, image_ops.to_unit_range(images))}

  shape = [None, None, None, 3] if polymorphic else [batch_size, height, width, 3]
  module.serving_default = logits.get_concrete_function(
      tf.TensorSpec(shape, tf.uint8, name='images'))
  module.serving_float = logits.get_concrete_function(
      tf.TensorSpec(shape, tf.float32, name='images'))
  return module


def write_saved_model(model, params, image_size: blank.ImageSize, out: str,
                      labels: list[str]) -> None:
  del labels
  import tensorflow as tf
  module = serving_module(model, params, image_size)
  tf.saved_model.save(module, out, signatures={'serving_default': module.serving_default,
                                               'serving_float': module.serving_float})


# What TensorFlow's TFLite converter writes to stderr at every conversion, whatever it converts:
# two options that its Python half sets and its C++ half ignores (and, as its first native line,
# absl's preamble, which console.NATIVE_INFO_LINE covers).
TFLITE_CONVERTER_NOTICE = re.compile(
    r'W\d{4} \d\d:\d\d:\d+\.\d+ +\d+ tf_tfl_flatbuffer_helpers\.cc:\d+\] '
    r'Ignored (output_format|drop_control_dependency)\.$')


def write_tflite(model, params, image_size: blank.ImageSize, out: str, labels: list[str]) -> None:
  """A TFLite flatbuffer of the uint8 serving function at batch size 1, TFLite's own ops only."""
  del labels
  import tensorflow as tf
  module = serving_module(model, params, image_size, batch_size=1)
  converter = tf.lite.TFLiteConverter.from_concrete_functions([module.serving_default], module)
  with console.native_info_lines_dropped(also=TFLITE_CONVERTER_NOTICE):
    flatbuffer = converter.convert()
  with open(out, 'wb') as f:
    f.write(flatbuffer)


def how_to_load(model, image_size: blank.ImageSize, format_name: str, out: str) -> str:
  """One line on loading the export at `out`."""
  if format_name == 'hf':
    return f'load it with ViTForImageClassification.from_pretrained({out!r})'
  if format_name == 'tflite':
    height, width = blank.image_hw(image_size)
    return (f'run it with the TFLite interpreter: images=(1, {height}, {width}, 3) '
            f'uint8 -> logits (1, {model.num_classes})')
  if format_name == 'saved_model':
    return (f'serve tf.saved_model.load({out!r}).signatures["serving_default"] (uint8) or '
            f'["serving_float"] (float32 in [0, 255]): images=(B, H, W, 3) -> logits '
            f'(B, {model.num_classes})')
  name, args = timm_model_args(model, image_size)
  build = (f'timm.models.vision_transformer.VisionTransformer(**{args})'
           if name == 'VisionTransformer' else f'timm.create_model({name!r}, **{args})')
  return (f'load it with model = {build}; '
          f'model.load_state_dict(safetensors.torch.load_file({out!r}))')


WRITERS = {'timm': write_timm, 'hf': write_hugging_face, 'saved_model': write_saved_model,
           'tflite': write_tflite}


def default_out(checkpoint_path: str, format_name: str) -> str:
  """FILE.npz -> FILE_timm.safetensors, FILE_hf, FILE_saved_model, FILE.tflite; a workdir's
  inside it, WORKDIR/model_timm.safetensors...; a published name's in the current directory,
  under the name of its file."""
  if published.is_name(checkpoint_path):
    base = os.path.splitext(os.path.basename(published.lookup(checkpoint_path).path))[0]
  elif os.path.isdir(checkpoint_path):
    base = os.path.join(checkpoint_path, 'model')
  else:
    base = os.path.splitext(checkpoint_path)[0]
  suffixes = {'timm': '_timm.safetensors', 'tflite': '.tflite'}
  return base + suffixes.get(format_name, f'_{format_name}')


def export(model, params, image_size: blank.ImageSize, format_name: str, out: str,
           labels: list[str]) -> None:
  """Writes `out` in a temporary directory beside it, and renames it there once complete; a
  full disk is an OSError of one line, and leaves nothing behind."""
  check_exportable(model, format_name)
  parent = os.path.dirname(os.path.abspath(out))
  os.makedirs(parent, exist_ok=True)
  try:
    with tempfile.TemporaryDirectory(dir=parent, prefix='.export-') as tmp_dir:
      tmp = os.path.join(tmp_dir, os.path.basename(out))
      WRITERS[format_name](model, params, image_size, tmp, labels)
      os.replace(tmp, out)
  except Exception as e:  # Safetensors' and TensorFlow's errors.
    if not npz.is_out_of_space(e):
      raise
    raise OSError(f'Writing {out} failed (No space left on device); '
                  f'{npz.free_space(parent)} free there: free some space, or pass '
                  'another --out.') from None


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
  parser = console.command_parser(
      'export', description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--checkpoint', required=True, help='training workdir, .npz checkpoint, or '
                      'published name (augreg:B/16-384; python -m vit_jax.checkpoint --list)')
  parser.add_argument('--format', required=True, choices=FORMATS)
  parser.add_argument('--out', help='file (timm, tflite) or directory to write; must not exist. '
                      'Default: next to the checkpoint, e.g. FILE_timm.safetensors')
  parser.add_argument('--model', help='registry name of an .npz checkpoint, e.g. ViT-B_16')
  parser.add_argument('--labels', help="class names for Hugging Face's config: 'imagenet2012' "
                      'or a file with one per line; default: the names recorded with the run, '
                      'else class indices')
  return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
  args = parse_args(argv)
  try:
    out = args.out or default_out(args.checkpoint, args.format)
    errors.prepare_new_output(out)
    if args.labels and args.format != 'hf':
      raise ValueError(f'--labels goes into Hugging Face\'s config.json only; --format '
                       f'{args.format} has no place for class names: drop --labels.')
    model, params = runs.load_model(args.checkpoint, args.model)
    image_size = runs.trained_image_size(args.checkpoint, params, model)
    labels = image_files.load_labels(args.labels, model.num_classes,
                                     runs.saved_label_names(args.checkpoint))
    export(model, params, image_size, args.format, out, labels)
  except (ValueError, OSError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 1
  print(f'Exported {args.checkpoint} ({blank.size_text(image_size)} px, '
        f'{model.num_classes} classes) '
        f'to {out}: {how_to_load(model, image_size, args.format, out)}.')
  return 0


if __name__ == '__main__':
  console.run(main)

"""The published ViT checkpoints by name, and their download into a local cache.

Names:
- `paper:MODEL` is a file of the ViT paper (Dosovitskiy et al., 2020), MODEL its registry name,
  pre-trained on ImageNet-21k at 224 px (`gs://vit_models/imagenet21k/`);
  `paper:MODEL-RES` the same model fine-tuned on ImageNet-2012 at RES px
  (`gs://vit_models/imagenet21k+imagenet2012/`).
- `augreg:SIZE` (`augreg:B/16`, `augreg:R26+S/32`) is the checkpoint that "How to train your
  ViT?" (Steiner et al., 2021) recommends for that size, pre-trained on ImageNet-21k with
  AugReg at 224 px; `augreg:SIZE-RES` the one fine-tuned from it on ImageNet-2012 at RES px
  (`gs://vit_models/augreg/`). The file names spell out the recipe: augmentation level,
  weight decay, dropout, stochastic depth, and the fine-tuning steps and learning rate.
- `sam:SIZE` (`sam:B/16`, `sam:B/32`) is trained on ImageNet-2012 alone, from scratch at 224 px,
  with sharpness-aware minimisation ("When Vision Transformers Outperform ResNets without
  Pre-training or Strong Data Augmentations", Chen et al., 2021; `gs://vit_models/sam/`).

`fetch(name)` downloads a file once, into `cache_dir()` (`$VIT_JAX_CACHE`, default
~/.cache/vit_jax), from its https address, or from `$VIT_JAX_MIRROR`, a URL (http://, https://,
file://) standing for gs://vit_models; later calls read the cached file. A download is written
to a `.part` file, kept only when it has all the bytes the server announced, and its sha256 is
then recorded next to it (FILE.sha256) and checked on each later use. A file placed in the
cache by hand is taken as it is and its sha256 recorded on first use.

Sources of the table (file names as published, none derived):
- the README of google-research/vision_transformer: the imagenet21k and imagenet21k+imagenet2012
  folders and their models (the `-224` files, the R50+ViT-B/16 hybrid), and the table of
  recommended AugReg checkpoints (pre-trained and fine-tuned at 384 px);
- timm (huggingface/pytorch-image-models), timm/models/vision_transformer.py and
  vision_transformer_hybrid.py, pretrained configs: the AugReg files fine-tuned at 224 px, listed
  here only where they start from the recommended pre-trained file, the imagenet21k ViT-H_14, and
  the two SAM files (`vit_base_patch16_224.sam_in1k`, `vit_base_patch32_224.sam_in1k`).
"""
import dataclasses
import difflib
import hashlib
import http.client
import json
import os
import sys
from typing import Optional
import urllib.error
import urllib.request

import tqdm

from vit_jax import console
from vit_jax.cache import cache_dir

BUCKET = 'gs://vit_models'
HTTPS_BUCKET = 'https://storage.googleapis.com/vit_models'
MIRROR_ENV = 'VIT_JAX_MIRROR'
PREFIXES = ('paper:', 'augreg:', 'sam:')
I1K = 'imagenet2012'
I21K = 'imagenet21k'
I21K_I1K = 'imagenet21k+imagenet2012'
_CHUNK_BYTES = 1 << 20
_TIMEOUT_S = 60


class PublishedError(ValueError):
  """An unknown name, or a download that failed or came back damaged; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """One published file: its name here, registry model, resolution (pixels), training data
  (I21K; I21K_I1K for fine-tuned on ImageNet-2012; I1K for trained on it alone) and path in the
  bucket."""
  name: str
  model: str
  resolution: int
  dataset: str
  path: str

  @property
  def gs_url(self) -> str:
    return f'{BUCKET}/{self.path}'

  @property
  def https_url(self) -> str:
    return f'{HTTPS_BUCKET}/{self.path}'


def _paper(model: str, folder: str, file_name: str, resolution: int) -> Checkpoint:
  suffix = '' if folder == I21K else f'-{resolution}'
  return Checkpoint(f'paper:{model}{suffix}', model, resolution, folder,
                    f'{folder}/{file_name}.npz')


def _augreg(size: str, model: str, upstream: str, **fine_tuned: str) -> list[Checkpoint]:
  """The pre-trained file `upstream` (augreg/UPSTREAM.npz) and those fine-tuned from it,
  `res_RES='FILE SUFFIX'` (augreg/UPSTREAM--SUFFIX.npz)."""
  entries = [Checkpoint(f'augreg:{size}', model, 224, I21K, f'augreg/{upstream}.npz')]
  for key, suffix in fine_tuned.items():
    resolution = int(key.removeprefix('res_'))
    entries.append(Checkpoint(f'augreg:{size}-{resolution}', model, resolution, I21K_I1K,
                              f'augreg/{upstream}--{suffix}.npz'))
  return entries


_PAPER = [
    *(_paper(m, I21K, m, 224) for m in
      ('ViT-B_16', 'ViT-B_32', 'ViT-L_16', 'ViT-L_32', 'ViT-H_14', 'R50+ViT-B_16')),
    *(_paper(m, I21K_I1K, m, 384) for m in
      ('ViT-B_16', 'ViT-B_32', 'ViT-L_16', 'ViT-L_32', 'R50+ViT-B_16')),
    *(_paper(m, I21K_I1K, f'{m}-224', 224) for m in ('ViT-B_16', 'ViT-L_16')),
]
_STEPS = 'imagenet2012-steps_20k'
_AUGREG = [
    *_augreg('L/16', 'ViT-L_16', 'L_16-i21k-300ep-lr_0.001-aug_strong1-wd_0.1-do_0.0-sd_0.0',
             res_384=f'{_STEPS}-lr_0.01-res_384'),
    *_augreg('B/16', 'ViT-B_16', 'B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.0-sd_0.0',
             res_224=f'{_STEPS}-lr_0.01-res_224', res_384=f'{_STEPS}-lr_0.03-res_384'),
    *_augreg('S/16', 'ViT-S_16', 'S_16-i21k-300ep-lr_0.001-aug_light1-wd_0.03-do_0.0-sd_0.0',
             res_224=f'{_STEPS}-lr_0.03-res_224', res_384=f'{_STEPS}-lr_0.03-res_384'),
    *_augreg('R50+L/32', 'R50+ViT-L_32',
             'R50_L_32-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-do_0.1-sd_0.1',
             res_224=f'{_STEPS}-lr_0.01-res_224', res_384=f'{_STEPS}-lr_0.01-res_384'),
    *_augreg('R26+S/32', 'R26+ViT-S_32',
             'R26_S_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0',
             res_384=f'{_STEPS}-lr_0.01-res_384'),
    *_augreg('Ti/16', 'ViT-Ti_16', 'Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0',
             res_224=f'{_STEPS}-lr_0.03-res_224', res_384=f'{_STEPS}-lr_0.03-res_384'),
    *_augreg('B/32', 'ViT-B_32', 'B_32-i21k-300ep-lr_0.001-aug_light1-wd_0.1-do_0.0-sd_0.0',
             res_384=f'{_STEPS}-lr_0.01-res_384'),
    *_augreg('S/32', 'ViT-S_32', 'S_32-i21k-300ep-lr_0.001-aug_none-wd_0.1-do_0.0-sd_0.0',
             res_384=f'{_STEPS}-lr_0.01-res_384'),
    *_augreg('R+Ti/16', 'R+ViT-Ti_16',
             'R_Ti_16-i21k-300ep-lr_0.001-aug_none-wd_0.03-do_0.0-sd_0.0',
             res_224=f'{_STEPS}-lr_0.03-res_224', res_384=f'{_STEPS}-lr_0.03-res_384'),
]
_SAM = [Checkpoint(f'sam:{size}', model, 224, I1K, f'sam/{model}.npz')
        for size, model in (('B/16', 'ViT-B_16'), ('B/32', 'ViT-B_32'))]
PUBLISHED: dict[str, Checkpoint] = {c.name: c for c in _PAPER + _AUGREG + _SAM}


def is_name(text) -> bool:
  """Whether `text` is meant as a published name (starts with one of PREFIXES), known or not."""
  return isinstance(text, str) and text.startswith(PREFIXES)


def lookup(name: str) -> Checkpoint:
  """The table's entry of `name`; a PublishedError lists the close names of an unknown one."""
  if name in PUBLISHED:
    return PUBLISHED[name]
  close = difflib.get_close_matches(name, PUBLISHED, n=5, cutoff=0.6)
  hint = f'close names: {", ".join(close)}' if close else 'none is close'
  raise PublishedError(f'Unknown published checkpoint {name!r}; {hint} (all of them: python -m '
                       'vit_jax.checkpoint --list).')


def model_of(name_or_path) -> Optional[str]:
  """The registry model of a published name; None for anything else (paths, workdirs)."""
  return lookup(name_or_path).model if is_name(name_or_path) else None


def cached_path(entry: Checkpoint) -> str:
  """The file of `entry` in the cache, at its path in the bucket (folders keep names apart)."""
  return os.path.join(cache_dir(), *entry.path.split('/'))


def download_url(entry: Checkpoint) -> str:
  """The address `entry` is downloaded from: under $VIT_JAX_MIRROR if set, else its https one."""
  mirror = os.environ.get(MIRROR_ENV)
  return f'{mirror.rstrip("/")}/{entry.path}' if mirror else entry.https_url


def _sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    while chunk := f.read(_CHUNK_BYTES):
      digest.update(chunk)
  return digest.hexdigest()


def _record_path(path: str) -> str:
  return path + '.sha256'


def _write_record(path: str, sha256: str, url: Optional[str] = None) -> None:
  """Records the sha256 of the complete file `path` (and where it came from) next to it."""
  with open(_record_path(path), 'w') as f:
    json.dump({'sha256': sha256, 'size': os.path.getsize(path), 'url': url}, f)


def _check_cached(path: str) -> None:
  """Checks the cached file against its recorded sha256; records one for a file placed by hand."""
  if not os.path.isfile(_record_path(path)):
    _write_record(path, _sha256(path))
    return
  with open(_record_path(path)) as f:
    recorded = json.load(f)['sha256']
  if _sha256(path) != recorded:
    raise PublishedError(f'The cached {path} does not match the sha256 recorded when it was '
                         f'downloaded ({_record_path(path)}): delete both to download it again.')


def _stream(response, out, total: Optional[int], label: str) -> str:
  """Copies `response` into the open file `out` with a progress bar on a terminal; returns the
  sha256 of what was copied."""
  digest = hashlib.sha256()
  with tqdm.tqdm(total=total, unit='B', unit_scale=True, unit_divisor=1024, desc=label,
                 disable=not sys.stderr.isatty()) as bar:
    while chunk := response.read(_CHUNK_BYTES):
      out.write(chunk)
      digest.update(chunk)
      bar.update(len(chunk))
  return digest.hexdigest()


def _download(entry: Checkpoint, path: str) -> None:
  """Downloads `entry` to `path` through a `.part` file, kept only when it is complete."""
  url = download_url(entry)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  part = f'{path}.{os.getpid()}.part'  # One per process: concurrent downloads do not mix.
  try:
    with open(part, 'wb') as out:
      try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
          total = response.headers.get('Content-Length')
          total = None if total is None else int(total)
          sha256 = _stream(response, out, total, entry.name)
      except (OSError, http.client.HTTPException) as e:
        raise PublishedError(
            f'Cannot download {entry.name} from {url} ({type(e).__name__}: {e}): copy '
            f'{entry.gs_url} (also at {entry.https_url}) to {path} by hand, or set '
            f'{MIRROR_ENV} to a mirror of {BUCKET}.') from None
    size = os.path.getsize(part)
    if total is not None and size != total:
      raise PublishedError(f'The download of {entry.name} from {url} stopped after {size} of '
                           f'{total} bytes; nothing was kept: run again to retry.')
    os.replace(part, path)
  finally:
    if os.path.exists(part):
      os.remove(part)
  _write_record(path, sha256, url)


def fetch(name: str) -> str:
  """The local path of published checkpoint `name`: downloaded into the cache on first use,
  checked against its recorded sha256 after."""
  entry = lookup(name)
  path = cached_path(entry)
  if os.path.isfile(path):
    _check_cached(path)
  else:
    _download(entry, path)
  return path


def listing() -> list[str]:
  """One line per published name: name, model, resolution, training data, gs:// address."""
  width = max(len(name) for name in PUBLISHED)
  return [f'{c.name:<{width}}  {c.model:<13} {c.resolution:>4}px  {c.dataset:<24}  {c.gs_url}'
          for c in PUBLISHED.values()]


def main(argv: Optional[list[str]] = None) -> int:
  """`python -m vit_jax.checkpoint --list`: prints the published names."""
  parser = console.command_parser('checkpoint', description=main.__doc__)
  parser.add_argument('--list', action='store_true', required=True,
                      help='print each published name with its model, resolution, training '
                      'data and file')
  parser.parse_args(argv)
  print('\n'.join(listing()))
  return 0


if __name__ == '__main__':
  console.run(main)

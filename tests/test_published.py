"""Published checkpoints by name: the table, name lookup, and downloads from a local HTTP server
standing in for gs://vit_models (this machine has no internet)."""
import functools
import http.server
import os
import re
import shutil
import socket
import threading
import urllib.parse

from flax import traverse_util
import numpy as np
import pytest

from vit_jax import cache
from vit_jax.checkpoints import npz
from vit_jax.checkpoints import published
from vit_jax.checkpoints import runs
from vit_jax.config import checks
from vit_jax.config import defaults
from vit_jax.models import registry

pytestmark = pytest.mark.xdist_group('published')  # Its module fixtures are built once.


# The table.


def test_every_entry_names_a_registry_model_and_a_well_formed_address():
  for entry in published.PUBLISHED.values():
    assert entry.model in registry.MODEL_CONFIGS, entry.name
    assert entry.path.endswith('.npz') and ' ' not in entry.path, entry.name
    assert entry.gs_url == f'gs://vit_models/{entry.path}'
    url = urllib.parse.urlparse(entry.https_url)
    assert (url.scheme, url.netloc) == ('https', 'storage.googleapis.com')
    assert url.path == f'/vit_models/{entry.path}'


def test_augreg_file_names_spell_the_model_and_resolution():
  # The AugReg bucket names models as vit_jax's official configs/registry.py does: 'ViT-B_16' is
  # 'B_16', 'R50+ViT-L_32' is 'R50_L_32'; fine-tuned files end in '-res_RES' and start with the
  # name of the file they were fine-tuned from.
  for entry in published.PUBLISHED.values():
    if not entry.name.startswith('augreg:'):
      continue
    file_name = entry.path.removeprefix('augreg/')
    assert file_name.startswith(entry.model.replace('ViT-', '').replace('+', '_') + '-i21k-')
    if entry.dataset == published.I21K:
      assert '--' not in file_name and entry.resolution == 224
    else:
      upstream = published.lookup(entry.name.rsplit('-', 1)[0])
      assert file_name.startswith(upstream.path.removeprefix('augreg/')[:-4] + '--imagenet2012-')
      assert file_name.endswith(f'-res_{entry.resolution}.npz')


def test_names_resolve_to_their_model_and_files():
  b16 = published.lookup('augreg:B/16')
  assert (b16.model, b16.resolution, b16.dataset) == ('ViT-B_16', 224, 'imagenet21k')
  assert b16.gs_url == ('gs://vit_models/augreg/B_16-i21k-300ep-lr_0.001-aug_medium1-wd_0.1-'
                        'do_0.0-sd_0.0.npz')
  assert published.lookup('augreg:B/16-384').resolution == 384
  assert published.lookup('paper:ViT-B_16').gs_url == 'gs://vit_models/imagenet21k/ViT-B_16.npz'
  assert published.lookup('paper:R50+ViT-B_16-384').gs_url == (
      'gs://vit_models/imagenet21k+imagenet2012/R50+ViT-B_16.npz')
  assert published.model_of('augreg:R26+S/32') == 'R26+ViT-S_32'
  # SAM's files, as timm's pretrained configs name them (vit_base_patch16_224.sam_in1k).
  sam = published.lookup('sam:B/16')
  assert (sam.model, sam.resolution, sam.dataset) == ('ViT-B_16', 224, 'imagenet2012')
  assert sam.https_url == 'https://storage.googleapis.com/vit_models/sam/ViT-B_16.npz'
  assert published.lookup('sam:B/32').gs_url == 'gs://vit_models/sam/ViT-B_32.npz'
  assert published.is_name('sam:B/16') and published.model_of('sam:B/32') == 'ViT-B_32'
  assert published.model_of('/some/dir/model.npz') is None


def test_unknown_name_is_one_line_with_the_close_names():
  with pytest.raises(published.PublishedError) as error:
    published.lookup('augreg:B16-384')
  message = str(error.value)
  assert '\n' not in message and 'augreg:B/16-384' in message and '--list' in message


def test_list_prints_every_name_with_model_resolution_and_data(capsys):
  assert published.main(['--list']) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == len(published.PUBLISHED)
  b16 = next(line for line in lines if line.split()[0] == 'augreg:B/16-384')
  assert b16.split()[1:4] == ['ViT-B_16', '384px', 'imagenet21k+imagenet2012']
  sam = next(line for line in lines if line.split()[0] == 'sam:B/32')
  assert sam.split()[1:] == ['ViT-B_32', '224px', 'imagenet2012',
                             'gs://vit_models/sam/ViT-B_32.npz']


# Training from a published name.


def test_a_published_name_sets_the_model_of_a_config_without_a_registry_model():
  config = defaults.get_config()  # Its ViT-mini_7 is not a registry model.
  config.pretrained_path = 'augreg:S/16'
  checks.use_published_model(config)
  assert config.model_name == 'ViT-S_16' and config.model.hidden_size == 384


def test_a_published_name_of_another_registry_model_is_a_config_error():
  config = defaults.with_model(defaults.get_config(), 'ViT-L_16')
  config.pretrained_path = 'augreg:B/16'
  with pytest.raises(checks.ConfigError, match='--config.model_name=ViT-B_16'):
    checks.use_published_model(config)
  config.pretrained_path = 'augreg:B-16'
  with pytest.raises(checks.ConfigError, match='augreg:B/16'):
    checks.check_pretrained_path(config)


# Downloads.


class _Bucket(http.server.SimpleHTTPRequestHandler):
  """Serves a folder laid out like gs://vit_models; counts GET requests, and cuts the files of
  `truncated` (URL paths) short after half their bytes while announcing all of them."""
  requests = []
  truncated = set()

  def do_GET(self):
    type(self).requests.append(self.path)
    if self.path not in self.truncated:
      return super().do_GET()
    with open(self.translate_path(self.path), 'rb') as f:
      data = f.read()
    self.send_response(200)
    self.send_header('Content-Length', str(len(data)))
    self.end_headers()
    self.wfile.write(data[:len(data) // 2])
    return None

  def log_message(self, *args):  # Quiet.
    pass


@pytest.fixture(scope='module')
def bucket(tmp_path_factory):
  """(base URL, the params served as augreg:Ti/16 (a ViT-Ti_16 with 3 classes, no spec))."""
  root = tmp_path_factory.mktemp('bucket')
  model = registry.get_model('ViT-Ti_16', num_classes=3)
  rng = np.random.default_rng(0)
  params = {k: rng.normal(size=s.shape).astype(np.float32) for k, s in
            traverse_util.flatten_dict(registry.param_shapes(model)).items()}
  params = traverse_util.unflatten_dict(params)
  npz.save(params, os.path.join(root, published.lookup('augreg:Ti/16').path))
  shutil.copy(os.path.join(root, published.lookup('augreg:Ti/16').path),
              os.path.join(root, published.lookup('augreg:Ti/16-224').path))
  handler = functools.partial(_Bucket, directory=str(root))
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  yield f'http://127.0.0.1:{server.server_address[1]}', params
  server.shutdown()
  server.server_close()


@pytest.fixture
def mirror(bucket, tmp_path, monkeypatch):
  monkeypatch.setenv(published.MIRROR_ENV, bucket[0])
  monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / 'cache'))
  _Bucket.requests.clear()
  return bucket[1]


def test_a_name_downloads_once_into_the_cache_and_loads_with_its_model(mirror, tmp_path):
  model, params = runs.load_model('augreg:Ti/16')
  assert (model.hidden_size, model.num_classes) == (192, 3)
  np.testing.assert_array_equal(params['head']['kernel'], mirror['head']['kernel'])
  path = published.lookup('augreg:Ti/16').path
  assert _Bucket.requests == ['/' + path]
  cached = tmp_path / 'cache' / path
  assert cached.is_file() and os.path.isfile(f'{cached}.sha256')
  assert published.fetch('augreg:Ti/16') == str(cached)
  assert len(_Bucket.requests) == 1  # The second use reads the cache.
  with open(cached, 'ab') as f:  # Damaged after the download.
    f.write(b'\0')
  with pytest.raises(published.PublishedError, match='sha256') as error:
    published.fetch('augreg:Ti/16')
  assert '\n' not in str(error.value)


def test_a_truncated_download_leaves_nothing_in_the_cache(mirror, tmp_path):
  path = '/' + published.lookup('augreg:Ti/16-224').path
  _Bucket.truncated.add(path)
  try:
    with pytest.raises(published.PublishedError) as error:
      published.fetch('augreg:Ti/16-224')
  finally:
    _Bucket.truncated.discard(path)
  assert '\n' not in str(error.value) and 'stopped after' in str(error.value)
  assert _Bucket.requests == [path]
  assert [files for _, _, files in os.walk(tmp_path / 'cache')] == [[], []]  # Folders only.


def test_offline_is_one_line_naming_the_url_and_where_to_put_the_file(mirror, tmp_path,
                                                                      monkeypatch):
  with socket.socket() as s:  # A port nothing listens on.
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  monkeypatch.setenv(published.MIRROR_ENV, f'http://127.0.0.1:{port}')
  entry = published.lookup('augreg:Ti/16')
  with pytest.raises(published.PublishedError) as error:
    published.fetch('augreg:Ti/16')
  message = str(error.value)
  assert '\n' not in message
  assert f'http://127.0.0.1:{port}/{entry.path}' in message and entry.gs_url in message
  assert str(tmp_path / 'cache' / entry.path) in message


def test_a_file_placed_in_the_cache_by_hand_is_used_without_a_request(mirror, tmp_path):
  entry = published.lookup('augreg:Ti/16-224')
  npz.save(mirror, os.path.join(tmp_path, 'cache', entry.path))
  assert published.fetch('augreg:Ti/16-224') == str(tmp_path / 'cache' / entry.path)
  assert not _Bucket.requests
  record = (tmp_path / 'cache' / f'{entry.path}.sha256').read_text()
  assert re.fullmatch(r'\{"sha256": "[0-9a-f]{64}".*', record)

"""Tests of preparing a tfds dataset whose download fails: one line, in seconds, nothing left.

The downloads go through a proxy on a local port where nothing listens (or a local server that
breaks off), so that they fail on any machine, online or not, without reaching the internet.
"""
import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import tensorflow_datasets as tfds

from helpers import xla_flags
from vit_jax.data import tfds_source

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def closed_port() -> int:
  """A local port that nothing listens on: connections to it are refused."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def test_a_manual_download_not_there_is_one_line_with_tfds_steps_and_nothing_printed(tmp_path,
                                                                                   capsys):
  # tfds's own imagenet2012, which it never downloads: its files come from image-net.org.
  with pytest.raises(ValueError) as error:
    tfds_source.TfdsSource('imagenet2012', str(tmp_path), None, shuffle_buffer=8)
  message = str(error.value)
  assert '\n' not in message and '..' not in message, message
  assert 'ILSVRC2012_img_train.tar' in message and 'image-net.org' in message
  assert message.endswith('put the files into config.tfds_manual_dir.')
  assert capsys.readouterr().out == ''  # tfds's "Downloading and preparing dataset ..." line.


def test_an_unreachable_tfds_download_is_one_line_in_seconds_and_leaves_nothing(tmp_path):
  home, data_dir, temporary = tmp_path / 'home', tmp_path / 'tfds', tmp_path / 'tmp'
  home.mkdir()
  temporary.mkdir()
  proxy = f'http://127.0.0.1:{closed_port()}'
  env = {**os.environ, 'HOME': str(home), 'TMPDIR': str(temporary),
         'XLA_FLAGS': xla_flags(None), 'https_proxy': proxy,
         'HTTPS_PROXY': proxy, 'http_proxy': proxy, 'HTTP_PROXY': proxy, 'no_proxy': '',
         'NO_PROXY': ''}
  start = time.monotonic()
  result = subprocess.run(  # docs/training.md's command for a tfds preset.
      [sys.executable, '-m', 'vit_jax.main', '--config=configs/vit.py:ti16,cifar10',
       f'--workdir={tmp_path / "workdir"}', f'--config.tfds_data_dir={data_dir}'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  seconds = time.monotonic() - start
  assert result.returncode == 1, result.stderr
  assert 'Retrying' not in result.stderr, result.stderr
  assert 'absl' not in result.stderr, result.stderr  # No "Variant folder ... has no ..." either.
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("Config error: tfds dataset 'cifar10' is not prepared"), last
  for named in ('https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz', 'Connection refused',
                'config.tfds_data_dir', "tfds's manual download", 'config.tfds_manual_dir',
                'cifar-10-binary.tar.gz.'):
    assert named in last, (named, last)
  assert seconds < 150, (seconds, result.stderr)  # tfds alone waits 3.4 minutes between retries.
  assert not data_dir.exists(), sorted(data_dir.rglob('*'))
  assert not (home / 'tensorflow_datasets').exists()
  assert not [path for path in temporary.iterdir() if path.name.endswith('tfds')]


class BreaksOff(http.server.BaseHTTPRequestHandler):
  """Promises 1,000,000 bytes and sends 10."""

  def do_GET(self):  # Http.server's name.
    self.send_response(200)
    self.send_header('Content-Length', '1000000')
    self.end_headers()
    self.wfile.write(b'0123456789')
    self.wfile.flush()
    self.connection.shutdown(socket.SHUT_RDWR)

  def log_message(self, *args):
    del args


@contextlib.contextmanager
def breaking_server():
  server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), BreaksOff)
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f'http://127.0.0.1:{server.server_address[1]}/data.tar.gz'
  finally:
    server.shutdown()
    server.server_close()


class Downloads(tfds.core.GeneratorBasedBuilder):
  """A dataset of one file downloaded from `URL`."""
  VERSION = tfds.core.Version('1.0.0')
  URL = None

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({
        'image': tfds.features.Image(shape=(28, 28, 1)), 'label': tfds.features.ClassLabel(
            num_classes=2)}))

  def _split_generators(self, dl_manager):
    dl_manager.download(self.URL)
    raise AssertionError('The download should have failed.')

  def _generate_examples(self):
    yield from ()


def test_a_download_broken_off_leaves_no_partial_file_behind(tmp_path):
  with breaking_server() as url:
    Downloads.URL = url
    with pytest.raises(ValueError, match="tfds dataset 'downloads' is not prepared"):
      tfds_source.TfdsSource('downloads', str(tmp_path / 'tfds'), None, shuffle_buffer=10)
  assert not (tmp_path / 'tfds').exists(), sorted((tmp_path / 'tfds').rglob('*'))

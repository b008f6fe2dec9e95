"""Tests of benchmarks/suite_profile.py, which sorts a py-spy recording of the suite by kind of
process and of work: here on a recording written by hand."""
import os
import subprocess
import sys

from helpers import TESTS

WORKER = 'process 1:"python -m pytest -q tests";process 2:"python -u -c import sys"'
# Four stacks, one of them split over two lines by the newline in its command.
RECORDING = '\n'.join([
    f'{WORKER};test_x (test_a.py:3);trace_to_jaxpr (jax/_src/pjit.py:9) 30',
    f'{WORKER};test_x (test_a.py:3);make_iterator (tensorflow/python/ops/gen.py:1) 10',
    f'{WORKER};process 3:"python -c import os',
    'print(1)";<module> (<string>:1);_find_and_load (<frozen importlib._bootstrap>:1) 20',
    f'{WORKER};process 4:"python preloaded.py SOCK";serve (preloaded.py:174) 40',
]) + '\n'


def test_each_stack_is_counted_by_its_process_and_its_work(tmp_path):
  (tmp_path / 'spy.txt').write_text(RECORDING)
  script = os.path.join(TESTS, os.pardir, 'benchmarks', 'suite_profile.py')
  out = subprocess.run([sys.executable, script, str(tmp_path / 'spy.txt'), '--rate', '10'],
                       capture_output=True, text=True, check=True).stdout
  cells = [[cell.strip() for cell in line.strip('|').split('|')] for line in out.splitlines()
           if line.startswith('| ')]
  rows = {row[0]: row[1:] for row in cells}
  # Columns: workers, forks, fresh Pythons, pytest, share. 60 busy samples at 10 a second.
  assert rows['JAX tracing'] == ['3.0', '0.0', '0.0', '0.0', '50.0%']
  assert rows['TensorFlow, the rest (tf.data iteration, exports)'][0] == '1.0'
  assert rows['imports'] == ['0.0', '0.0', '2.0', '0.0', '33.3%']
  assert rows['waiting threads (select, poll, queues), or no Python stack'] == [
      '0.0', '4.0', '0.0', '0.0', '']
  assert out.splitlines()[-1] == '100 samples at 10 a second.'

"""Tests of benchmarks/suite_cpu.py, the pytest plugin that prints where the suite's CPU time
goes: here on a one-test suite of its own, in a pytest process of its own."""
import os
import re
import subprocess
import sys

from helpers import TESTS

BUSY_TEST = '''
import subprocess, sys

def test_waits_for_a_busy_python():
  subprocess.run([sys.executable, '-c', 'sum(range(4 * 10**7))'], check=True)
'''


def test_the_cpu_of_a_process_a_test_waited_for_is_counted_for_that_test(tmp_path):
  (tmp_path / 'test_busy.py').write_text(BUSY_TEST)
  env = {name: value for name, value in os.environ.items()  # Not a worker of this session's.
         if not name.startswith('PYTEST_XDIST')}
  env['PYTHONPATH'] = os.path.join(TESTS, os.pardir, 'benchmarks')
  env['TMPDIR'] = str(tmp_path)  # Where the plugin keeps its rows: gone with tmp_path.
  result = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'suite_cpu',
                           'test_busy.py'], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr
  # The child sums 40 million numbers: well over a tenth of a CPU-second.
  waited = re.search(r'^ *([\d.]+)  the processes they started and waited for', result.stdout,
                     re.MULTILINE)
  assert waited and float(waited[1]) > 0.1, result.stdout
  assert re.search(r'^ *([\d.]+)  the processes forked for them from preloaded ones',
                   result.stdout, re.MULTILINE), result.stdout
  test = re.search(r'^ *([\d.]+)  test_busy\.py::test_waits_for_a_busy_python$', result.stdout,
                   re.MULTILINE)
  assert test and float(test[1]) >= float(waited[1]), result.stdout

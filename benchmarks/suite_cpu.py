"""Where the test suite's CPU time goes: a pytest plugin that prints it at the end of a run.

    PYTHONPATH=benchmarks /usr/bin/time python -m pytest -q tests -p suite_cpu

Around each test, each pytest-xdist worker reads `resource.getrusage` of itself (tracing,
compiling and running in the test's own process) and of the processes it has waited for (the fresh
Pythons that a test starts: each command as a user types it, the notebook's kernel). The server of
preloaded processes (tests/preloaded.py) logs what each child it forks used, and for which test.
At the end the controller prints the three sums and the tests that used the most. What none of
them holds (collecting the tests, the workers' and servers' imports) is the rest of the total
that `/usr/bin/time` reports.
"""
import collections
import json
import os
import resource
import tempfile

import pytest

FOLDER_VARIABLE = 'SUITE_CPU_DIR'  # Where the workers and the preloaded servers write.
FORKS_PREFIX = 'forks_'  # tests/preloaded.py's log: forks_<server pid>.jsonl.
_rows = []  # This process's tests: {'test', 'self', 'children'}, CPU-s.


def _cpu(who) -> float:
  usage = resource.getrusage(who)
  return usage.ru_utime + usage.ru_stime


def pytest_configure(config):
  del config
  if 'PYTEST_XDIST_WORKER' not in os.environ:  # The controller, before it starts the workers.
    os.environ[FOLDER_VARIABLE] = tempfile.mkdtemp(prefix='suite_cpu_')


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  own, waited = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
  yield
  _rows.append({'test': item.nodeid, 'self': _cpu(resource.RUSAGE_SELF) - own,
                'children': _cpu(resource.RUSAGE_CHILDREN) - waited})


def pytest_sessionfinish(session):
  del session
  name = os.environ.get('PYTEST_XDIST_WORKER', 'main')
  with open(os.path.join(os.environ[FOLDER_VARIABLE], f'rows_{name}.json'), 'w') as f:
    json.dump(_rows, f)


def pytest_terminal_summary(terminalreporter):
  if 'PYTEST_XDIST_WORKER' in os.environ:
    return
  folder = os.environ[FOLDER_VARIABLE]
  rows, forks = [], collections.Counter()
  for name in sorted(os.listdir(folder)):
    with open(os.path.join(folder, name)) as f:
      if name.startswith(FORKS_PREFIX):
        for line in f:
          fork = json.loads(line)
          forks[fork['test']] += fork['cpu']
      else:
        rows += json.load(f)
  used = collections.Counter()
  for row in rows:
    used[row['test']] += row['self'] + row['children']
  used.update(forks)
  write = terminalreporter.write_line
  write('')
  write('Where the CPU time of the tests went (CPU-s; the total: /usr/bin/time):')
  write(f'{sum(row["self"] for row in rows):8.1f}  the tests in their own processes')
  write(f'{sum(row["children"] for row in rows):8.1f}  the processes they started and waited '
        'for (fresh Pythons)')
  write(f'{sum(forks.values()):8.1f}  the processes forked for them from preloaded ones')
  write('The tests that used the most, with what they started:')
  for test, seconds in used.most_common(12):
    write(f'{seconds:8.1f}  {test}')

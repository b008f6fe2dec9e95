"""Where the suite's CPU goes by kind of work, from a py-spy recording of a whole run.

    py-spy record --subprocesses --rate 40 --format raw -o spy.txt -- python -m pytest -q tests
    python benchmarks/suite_profile.py spy.txt

py-spy samples the Python stack of every busy thread of the run's processes (`--rate` times a
second); in its raw format each line is one stack, its frames joined by ';', then the number of
samples that ended in it, the processes it ran in leading as `process PID:"COMMAND"` frames. This
script sorts the samples by kind of process (pytest's own, the pytest-xdist workers, the
processes forked from tests/preloaded.py's servers, fresh Pythons) and by the first of WORK that
names a frame of the stack, and prints CPU-s (samples over the rate) and shares. benchmarks/
suite_cpu.py counts the same run per test; this counts it per kind of work.

py-spy counts some waiting threads as busy (in select, poll, an idle queue: the frames of
WAITING), and shows threads with no Python stack as their process frames alone; both are shown
apart from the busy work. Native work is counted in the Python frame that called it, and py-spy
itself slows the run: the shares, not the sums, are the figures to compare between runs.
"""
import argparse
import collections
import re

# (kind of work, a pattern of the frames that mark it), the first match deciding.
WORK = (
    ('imports', re.compile(r'_find_and_load')),
    ('XLA compiles', re.compile(r'compile_or_get_cached|backend_compile')),
    ('JAX lowering', re.compile(r'lower_jaxpr_to_module|jaxpr_subcomp|lower_sharding_computation')),
    ('JAX tracing', re.compile(r'trace_to_jaxpr|_create_pjit_jaxpr|eval_shape|_infer_params')),
    ('TensorFlow graphs (tf.data map, tf.function)', re.compile(r'tensorflow/.*func_graph')),
    ('TensorFlow, the rest (tf.data iteration, exports)', re.compile(r'tensorflow/')),
)
# The frames that waiting threads end in.
WAITING = re.compile(r'^(\w+Selector\.select|Popen2IO\.read|Condition\.wait|_worker \(concurrent|'
                     r'OutStream\._watch_pipe_fd|ParentPollerUnix\.run|device \(zmq|'
                     r'GarbageCollectorThread\.run|serve \(preloaded)')
NOT_BUSY = 'waiting threads (select, poll, queues), or no Python stack'
OTHER = 'the rest (running steps, NumPy, Orbax, the tests themselves)'
PROCESSES = ('pytest-xdist workers', 'forked from preloaded servers', 'fresh Pythons', 'pytest')


def process_kind(frames: list[str]) -> str:
  """Which of PROCESSES ran a stack, from its leading `process PID:"COMMAND"` frames."""
  processes = [frame for frame in frames if frame.startswith('process ')]
  if len(processes) <= 1:
    return 'pytest'
  if any('preloaded.py' in frame for frame in processes):
    return 'forked from preloaded servers'
  return 'pytest-xdist workers' if len(processes) == 2 else 'fresh Pythons'


def work_kind(frames: list[str]) -> str:
  code = [frame for frame in frames if not frame.startswith('process ')]
  if not code or WAITING.match(code[-1]):
    return NOT_BUSY
  stack = ';'.join(code)
  return next((kind for kind, pattern in WORK if pattern.search(stack)), OTHER)


def tally(lines) -> collections.Counter:
  """{(process kind, work kind): samples} of py-spy's raw `lines`. A command line that holds a
  newline (`python -c CODE`) splits its stacks over several lines, joined again here: a stack
  ends at the line that ends in its count."""
  samples, pending = collections.Counter(), ''
  for line in lines:
    pending += line.rstrip('\n')
    stack, _, count = pending.rpartition(' ')
    if count.isdigit() and stack:
      frames = stack.split(';')
      samples[process_kind(frames), work_kind(frames)] += int(count)
      pending = ''
    else:
      pending += ' '
  return samples


def table(samples: collections.Counter, rate: float) -> list[str]:
  """Markdown rows: each kind of work, its CPU-s in each kind of process and its share of the
  busy samples (all but NOT_BUSY's)."""
  total = sum(samples.values()) - sum(samples[process, NOT_BUSY] for process in PROCESSES)
  works = [kind for kind, _ in WORK] + [OTHER, NOT_BUSY]
  rows = ['| work | ' + ' | '.join(PROCESSES) + ' | share |', '|---|' + '---:|' * 5]
  for work in works:
    seconds = [samples[process, work] / rate for process in PROCESSES]
    share = '' if work == NOT_BUSY else f'{sum(seconds) * rate / total:.1%}'
    rows.append(f'| {work} | ' + ' | '.join(f'{s:.1f}' for s in seconds) + f' | {share} |')
  totals = [sum(samples[process, work] for work in works) / rate for process in PROCESSES]
  rows.append('| all | ' + ' | '.join(f'{s:.1f}' for s in totals) + ' | |')
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n', 1)[0])
  parser.add_argument('recording', help="py-spy's raw output (--format raw)")
  parser.add_argument('--rate', type=float, default=40, help='the samples a second it was taken at')
  args = parser.parse_args()
  with open(args.recording) as f:
    samples = tally(f)
  print('\n'.join(table(samples, args.rate)))
  print(f'{sum(samples.values()):,} samples at {args.rate:g} a second.')


if __name__ == '__main__':
  main()

"""Python processes forked from one that has imported the libraries already: `python -m MODULE`
and `python -c CODE` as real processes (their own pid, devices, signals and exit status), without
the 5 to 8 CPU-s that each spends importing TensorFlow, JAX, Flax, Orbax and clu before it runs a
line of its own.

`start(args, env=..., cwd=...)` returns a `Process` that answers as `subprocess.Popen` does (pid,
poll, wait, send_signal, kill, returncode, stdout); `run(args, ...)` is `subprocess.run` with
captured output. Each pytest-xdist worker starts one server, at its first process.

A child is what `python` would start, up to where it imports: the server has imported the
libraries but started nothing (no JAX backend, no thread of its own, no logging set up), and reads
its environment as the child's would be, since JAX and TensorFlow read theirs as they are imported.
So a process whose environment differs from the server's in a JAX_ or TF_ variable starts as a
plain subprocess instead. The tests of what a process does as it starts
(its imports, TensorFlow's start-up lines, the commands as a user types them) start plain ones.

Run as a script, this file is the server: `python preloaded.py SOCKET`.
"""
import atexit
import gc
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# What a training process of vit_jax imports; not vit_jax.main, which `-m` runs as __main__.
PRELOADED = ('tensorflow', 'tensorflow_datasets', 'jax', 'flax.linen', 'optax',
             'orbax.checkpoint', 'clu.metric_writers', 'vit_jax.training.trainer',
             'vit_jax.evaluators.fewshot', 'vit_jax.config.command_line')
# Variables read as the libraries are imported: a child that differs in one starts plainly.
READ_AT_IMPORT = ('JAX_', 'TF_')
_server = None  # (process, socket path, its READ_AT_IMPORT variables) of this process's server.


def _imported_environment(env) -> dict[str, str]:
  return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT)}


class Process:
  """A child of the server, as `subprocess.Popen` shows one (with stdin from /dev/null)."""

  def __init__(self, connection: socket.socket, pid: int, stdout, stderr):
    self._connection = connection
    self.pid = pid
    self.stdout, self.stderr = stdout, stderr  # Text, where PIPE was asked for.
    self.returncode = None

  def poll(self):
    if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
      self._read_status()
    return self.returncode

  def wait(self, timeout=None):
    if self.returncode is None:
      if not select.select([self._connection], [], [], timeout)[0]:
        raise subprocess.TimeoutExpired(f'process {self.pid}', timeout)
      self._read_status()
    return self.returncode

  def _read_status(self):
    status = self._connection.recv(64).decode()
    self._connection.close()
    if not status:
      raise RuntimeError(f'The server of preloaded processes ended before process {self.pid}.')
    self.returncode = int(status)

  def send_signal(self, signum):
    if self.poll() is None:
      try:
        os.kill(self.pid, signum)
      except ProcessLookupError:  # It has just ended.
        pass

  def kill(self):
    self.send_signal(signal.SIGKILL)


def start(args, *, env=None, cwd=None, stderr=subprocess.STDOUT, limits=None):
  """`python ARGS` (ARGS: ['-m', MODULE, ...] or ['-c', CODE, ...]) as a Process, or as a
  subprocess.Popen where the server cannot start it; its stdout a pipe, its `stderr` STDOUT or
  PIPE (as for Popen; text). `limits`: {resource: soft limit}, set before the child runs."""
  env = dict(os.environ if env is None else env)
  server_env = _server[2] if _server else _imported_environment(os.environ)
  if _imported_environment(env) != server_env:
    process = subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                               stderr=stderr, stdin=subprocess.DEVNULL, text=True)
    for limit, soft in (limits or {}).items():
      resource.prlimit(process.pid, limit, (soft, resource.RLIM_INFINITY))
    return process
  pipes, child_fds = {}, []  # Our ends by name; the child's 1 and 2.
  for name in ('stdout', 'stderr') if stderr == subprocess.PIPE else ('stdout',):
    read, write = os.pipe()
    pipes[name] = os.fdopen(read, 'r')
    child_fds.append(write)
  connection = socket.socket(socket.AF_UNIX)
  connection.connect(_server_socket())
  request = {'args': list(map(str, args)), 'env': env, 'cwd': str(cwd or os.getcwd()),
             'limits': dict(limits or {})}
  socket.send_fds(connection, [json.dumps(request).encode()], child_fds)
  for fd in child_fds:
    os.close(fd)
  pid = int(connection.recv(64).decode())
  return Process(connection, pid, pipes.get('stdout'), pipes.get('stderr'))


def run(args, *, env=None, cwd=None, timeout=300) -> subprocess.CompletedProcess:
  """`subprocess.run([python, *ARGS], capture_output=True, text=True)` by `start`."""
  process = start(args, env=env, cwd=cwd, stderr=subprocess.PIPE)
  outputs = {}
  readers = [threading.Thread(target=lambda name=name: outputs.update(
      {name: getattr(process, name).read()})) for name in ('stdout', 'stderr')]
  for reader in readers:
    reader.start()
  try:
    process.wait(timeout)
  except subprocess.TimeoutExpired:
    process.kill()
    raise
  for reader in readers:
    reader.join()
  return subprocess.CompletedProcess(args, process.returncode, outputs['stdout'],
                                     outputs['stderr'])


def _server_socket() -> str:
  """The socket of this process's server, started at the first call (it ends with this process).
  The server's own output goes to a file beside the socket."""
  global _server
  if _server is None:
    folder = tempfile.mkdtemp(prefix='vit_jax_preloaded_')
    path, log = os.path.join(folder, 'socket'), os.path.join(folder, 'server.log')
    with open(log, 'w') as output:
      process = subprocess.Popen([sys.executable, os.path.abspath(__file__), path],
                                 stdin=subprocess.DEVNULL, stdout=output, stderr=output)
    atexit.register(_stop, process)
    while not os.path.exists(path):
      if process.poll() is not None:
        with open(log) as output:
          raise RuntimeError(f'The server of preloaded processes exited with '
                             f'{process.returncode}:\n{output.read()[-3000:]}')
      time.sleep(0.05)
    _server = process, path, _imported_environment(os.environ)
  return _server[1]


def _stop(server: subprocess.Popen) -> None:
  server.kill()
  server.wait()  # Its children's CPU time then counts as this process's children's.


def serve(path: str) -> None:
  """Forks a child for each request on the socket at `path`; sends each client its child's pid,
  then its exit status as Popen.returncode gives it. Where benchmarks/suite_cpu.py measures the
  suite, also logs the CPU time of each child, and the test that asked for it, in its folder."""
  for module in PRELOADED:
    __import__(module)
  gc.freeze()  # Out of the children's collections, and unwritten: their pages stay shared.
  listener = socket.socket(socket.AF_UNIX)
  listener.bind(path + '.tmp')
  listener.listen(64)
  os.rename(path + '.tmp', path)  # Ready.
  clients = {}  # Child pid: (the connection that started it, the test it runs for).
  cpu_log = os.environ.get('SUITE_CPU_DIR') and os.path.join(
      os.environ['SUITE_CPU_DIR'], f'forks_{os.getpid()}.jsonl')
  parent = os.getppid()
  while os.getppid() == parent:  # Not past the process that started it.
    if select.select([listener], [], [], 0.02)[0]:
      connection, _ = listener.accept()
      message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
      request = json.loads(message)
      pid = os.fork()
      if pid == 0:
        listener.close()
        connection.close()
        _child(request, fds)  # Never returns.
      for fd in fds:
        os.close(fd)
      connection.sendall(str(pid).encode())
      test = request['env'].get('PYTEST_CURRENT_TEST', '').rsplit(' (', 1)[0]  # Less its phase.
      clients[pid] = connection, test
    while clients:
      pid, status, usage = os.wait4(-1, os.WNOHANG)
      if not pid:
        break
      connection, test = clients.pop(pid)
      if cpu_log:
        with open(cpu_log, 'a') as log:
          log.write(json.dumps({'test': test, 'cpu': usage.ru_utime + usage.ru_stime}) + '\n')
      try:
        connection.sendall(str(os.waitstatus_to_exitcode(status)).encode())
      except OSError:  # The client is gone.
        pass
      connection.close()


def _child(request, fds) -> None:
  """Becomes `python ARGS` as the request gives it, and exits as Python does."""
  # Ctrl-C raises KeyboardInterrupt, as in a Python started from a terminal: pytest-xdist's
  # workers ignore SIGINT, and so would their children.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  for limit, soft in request['limits'].items():
    resource.setrlimit(int(limit), (soft, resource.RLIM_INFINITY))
  devnull = os.open(os.devnull, os.O_RDONLY)
  for fd, target in ((devnull, 0), (fds[0], 1), (fds[-1], 2)):  # One fd: stderr to stdout.
    os.dup2(fd, target)
  for fd in {devnull, *fds}:
    os.close(fd)
  os.environ.clear()
  os.environ.update(request['env'])
  os.chdir(request['cwd'])
  option, target, *argv = request['args']
  code = 0
  try:
    if option == '-m':
      sys.path[0] = os.getcwd()
      sys.argv = [target, *argv]
      import runpy
      runpy.run_module(target, run_name='__main__', alter_sys=True)
    else:
      sys.path[0] = ''
      sys.argv = ['-c', *argv]
      exec(compile(target, '<string>', 'exec'), {'__name__': '__main__'})
  except SystemExit as exit_:
    code = _exit_status(exit_)
  except KeyboardInterrupt:
    _print_traceback()
    _shut_down()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
  except BaseException:
    _print_traceback()
    code = 1
  _shut_down()
  os._exit(code)


def _print_traceback() -> None:
  """Prints the exception being handled as Python does, without this module's frame."""
  kind, value, traceback = sys.exc_info()
  sys.excepthook(kind, value.with_traceback(traceback.tb_next), traceback.tb_next)


def _exit_status(exit_: SystemExit) -> int:
  """The status Python exits with on an uncaught SystemExit (printing a non-integer code)."""
  if exit_.code is None:
    return 0
  if isinstance(exit_.code, int):
    return exit_.code
  print(exit_.code, file=sys.stderr)
  return 1


def _shut_down() -> None:
  """What Python does at exit before it frees the interpreter: it waits for the threads that are
  not daemons, runs the atexit functions and flushes its standard streams."""
  threading._shutdown()
  atexit._run_exitfuncs()
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass


if __name__ == '__main__':
  serve(sys.argv[1])

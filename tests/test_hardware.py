"""Tests of vit_jax/hardware.py: published peaks, and keeping freed host memory on a CPU."""
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp

from vit_jax import hardware

# Runs a jitted step whose 128 MiB output is allocated and freed at every call, and prints
# the fewest page faults of one call (averaged over 5) in 4 windows after a warm-up. With
# argument 'keep', keeps freed memory first.
PAGE_FAULTS_PER_STEP = textwrap.dedent('''
    import resource, sys
    from vit_jax import hardware
    if sys.argv[1] == 'keep':
      assert hardware.keep_freed_host_memory()
    import jax, jax.numpy as jnp
    step = jax.jit(lambda x: jnp.sin(x) * 2)
    x = jnp.ones((8192, 4096))
    for _ in range(10):  # Warm up.
      step(x).block_until_ready()
    faults = []
    for _ in range(4):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      for _ in range(5):
        step(x).block_until_ready()
      faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
    print(min(faults))
''')


def run_python(code: str, *args: str, **env: str) -> str:
  """Standard output of `code` run by a fresh Python (one whose JAX has not started yet)."""
  return subprocess.run([sys.executable, '-c', code, *args], env={**os.environ, **env},
                        check=True, capture_output=True, text=True).stdout


def test_kept_host_memory_spares_each_step_its_page_faults():
  default = float(run_python(PAGE_FAULTS_PER_STEP, 'default'))
  kept = float(run_python(PAGE_FAULTS_PER_STEP, 'keep'))
  pages_of_output = 128 * 2**20 // 4096
  assert default > pages_of_output / 2  # glibc gave the freed output back to the kernel.
  # Kept, a call faults only where the heap grows (when outputs freed late overlap the next).
  assert kept < default / 10


def test_host_memory_is_left_alone_for_an_accelerator():
  code = 'from vit_jax import hardware; print(hardware.only_cpu_backend(), ' \
         'hardware.keep_freed_host_memory())'
  assert run_python(code, JAX_PLATFORMS='cuda').split() == ['False', 'False']
  assert run_python(code, JAX_PLATFORMS='cpu').split() == ['True', 'True']


def test_accelerators_use_their_published_peak():
  assert hardware.published_peak_flops('NVIDIA H100 80GB HBM3', jnp.bfloat16) == 989e12
  assert hardware.published_peak_flops('TPU v4', jnp.float32) == 275e12 / 4
  assert hardware.published_peak_flops('cpu', jnp.float32) is None  # Measured instead.

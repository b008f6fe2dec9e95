"""XLA:CPU's options for the tests' tiny programs, which compile for longer than they run.

tests/conftest.py puts them in XLA_FLAGS for the whole session (and the processes it starts keep
them: helpers.xla_flags); benchmarks/compile_options.py measures what each saves. Importing this
file changes nothing.

- LLVM optimisation level 0, and XLA:CPU's elemental emitters instead of its fusion emitters: a
  tiny train step compiles several times as fast, with the same losses to 5 digits;
- one LLVM module, not split for threads to compile in parallel: the suite keeps every core
  busy, so those threads would only add their overhead.

The figures: docs/testing.md.
"""
QUICK_COMPILE = ('--xla_backend_optimization_level=0', '--xla_cpu_use_fusion_emitters=false',
                 '--xla_cpu_parallel_codegen_split_count=1')

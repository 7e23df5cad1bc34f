"""Where a step's first call goes: trace, lower, compile and the first run, timed apart.

Run one case per process (a process's caches would shorten a second measurement)::

  PYTHONPATH=. python benchmarks/first_call.py gpt2 adam optirs-apply

prints one line: the case, then seconds of ``jit(step).trace``, ``.lower()``,
``.compile()``, the first run, and their total. A fourth argument ``h200`` traces, lowers
and compiles the step for the compile-only H200 (:mod:`optirs_jax.bench.compile_only`) on
shapes alone, so a machine without a GPU times XLA's CUDA compile (no run)::

  JAX_PLATFORMS=cpu PYTHONPATH=. python benchmarks/first_call.py leaves adam optirs-apply h200
"""

import itertools
import sys
import time

import jax

from optirs_jax.bench.cases import abstract_step_and_inputs, step_and_inputs
from optirs_jax.bench.compile_only import h200_meshes, on_h200
from optirs_jax.bench.timing import first_call_parts


def for_h200(tree: str, name: str, impl: str):
  step, args = abstract_step_and_inputs(tree, name, impl)
  args = on_h200(args)
  times = [time.perf_counter()]
  with jax.sharding.use_abstract_mesh(h200_meshes()[1]):
    traced = jax.jit(step, donate_argnums=(0, 1)).trace(*args)
    times.append(time.perf_counter())
    lowered = traced.lower()
    times.append(time.perf_counter())
    lowered.compile()
    times.append(time.perf_counter())
  t, lo, c = (b - a for a, b in itertools.pairwise(times))
  print(f"{tree} {name} {impl} (compile-only H200): trace {t:.2f} lower {lo:.2f} "
        f"compile {c:.2f} total {t + lo + c:.2f} s", flush=True)


def main(tree: str, name: str, impl: str, target: str = "device"):
  if target == "h200":
    return for_h200(tree, name, impl)
  if target != "device":
    raise ValueError(f"target {target!r} is not one of 'device', 'h200'")
  step, args = step_and_inputs(tree, name, impl)
  _, parts = first_call_parts(jax.jit(step, donate_argnums=(0, 1)), *args)
  print(f"{tree} {name} {impl}: trace {parts[0]:.2f} lower {parts[1]:.2f} "
        f"compile {parts[2]:.2f} run {parts[3]:.2f} total {sum(parts):.2f} s", flush=True)


if __name__ == "__main__":
  main(*(sys.argv[1:] + ["gpt2", "adam", "optirs-apply"][len(sys.argv) - 1:])[:4])

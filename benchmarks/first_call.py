"""Where a step's first call goes: trace, lower, compile and the first run, timed apart.

Run one case per process (a process's caches would shorten a second measurement)::

  PYTHONPATH=. python benchmarks/first_call.py gpt2 adam optirs-apply

prints one line: the case, then seconds of ``jit(step).trace``, ``.lower()``,
``.compile()``, the first run, and their total.
"""

import sys

import jax

from optirs_jax.bench.cases import step_and_inputs
from optirs_jax.bench.timing import first_call_parts


def main(tree: str, name: str, impl: str):
  step, args = step_and_inputs(tree, name, impl)
  _, parts = first_call_parts(jax.jit(step, donate_argnums=(0, 1)), *args)
  print(f"{tree} {name} {impl}: trace {parts[0]:.2f} lower {parts[1]:.2f} "
        f"compile {parts[2]:.2f} run {parts[3]:.2f} total {sum(parts):.2f} s", flush=True)


if __name__ == "__main__":
  main(*(sys.argv[1:] + ["gpt2", "adam", "optirs-apply"][len(sys.argv) - 1:])[:3])

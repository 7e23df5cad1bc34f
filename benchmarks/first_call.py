"""Where a step's first call goes: trace, lower, compile and the first run, timed apart.

Run one case per process (a process's caches would shorten a second measurement)::

  PYTHONPATH=. python benchmarks/first_call.py gpt2 adam optirs-apply

prints one line: the case, then seconds of ``jit(step).trace``, ``.lower()``,
``.compile()``, the first run, and their total.
"""

import sys

import jax

from optirs_jax.bench.cases import OPTIMIZERS, jax_step, make_grads, make_tree, tree_shapes
from optirs_jax.bench.timing import first_call_parts


def main(tree: str, name: str, impl: str):
  opt = OPTIMIZERS[name]
  shapes = tree_shapes(tree, 1.0)
  grads = make_grads(shapes, opt)
  params = make_tree(shapes, 0, opt.dtype)
  tx, step = jax_step(impl, opt)
  state = tx.init(params)
  jax.block_until_ready((params, state, grads))
  _, parts = first_call_parts(jax.jit(step, donate_argnums=(0, 1)), params, state, grads)
  print(f"{tree} {name} {impl}: trace {parts[0]:.2f} lower {parts[1]:.2f} "
        f"compile {parts[2]:.2f} run {parts[3]:.2f} total {sum(parts):.2f} s", flush=True)


if __name__ == "__main__":
  main(*(sys.argv[1:] + ["gpt2", "adam", "optirs-apply"][len(sys.argv) - 1:])[:3])

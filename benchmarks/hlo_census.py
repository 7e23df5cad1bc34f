"""What one compiled optimizer step launches: the ops of the optimized HLO's entry computation.

    PYTHONPATH=. python3 benchmarks/hlo_census.py [tree] [impl,...] [small:large policy]

For each implementation (names of ``python -m optirs_jax.bench``), counts the entry
computation's instructions by kind (fusions by their name stem, custom calls, copies), which
on a GPU is about the number of kernels one step launches, and prints the largest fusions
by operand count. Steps donate params and state in the order of their outputs.
"""

import collections
import re
import sys
import time

import jax

from optirs_jax import ExecutorOptions, bench

# name = type op(...); a tuple type holds spaces, so the op is the first word before "(".
LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\s([a-z][\w\-]*)\(")


def launch_ops(hlo: str) -> collections.Counter:
  """The entry computation's instructions that run as work, by kind (fusions by name stem)."""
  entry = hlo[hlo.index("\nENTRY"):]
  entry = entry[:entry.index("\n}")]
  kinds = collections.Counter()
  for line in entry.splitlines()[1:]:
    m = LINE.match(line)
    if not m:
      continue
    name, op = m.group(1), m.group(2)
    if op in ("parameter", "get-tuple-element", "tuple", "bitcast", "constant"):
      continue
    kinds[re.sub(r"[.\d]+$", "", name) if op == "fusion" else op] += 1
  return kinds


def census(tree: str, impl: str, options: ExecutorOptions, optimizer: str = "adam") -> None:
  shapes = bench.tree_shapes(tree, 1.0 if jax.default_backend() != "cpu" else 1 / 64)
  tx, step = bench.jax_step(impl, bench.OPTIMIZERS[optimizer], options)
  params, grads = bench.make_tree(shapes, 0), bench.make_tree(shapes, 1)
  t0 = time.perf_counter()
  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), grads).compile()
  seconds = time.perf_counter() - t0
  kinds = launch_ops(compiled.as_text())
  total = sum(kinds.values())
  print(f"{tree} {impl} ({options.small_leaf_policy}/{options.large_leaf_policy}): "
        f"{len(shapes)} leaves, compile {seconds:.1f} s, {total} launch-level "
        f"ops: " + ", ".join(f"{k} {v}" for k, v in kinds.most_common(12)), flush=True)


def main(argv):
  tree = argv[1] if len(argv) > 1 else "leaves"
  impls = argv[2].split(",") if len(argv) > 2 else ["optirs-apply", "optax"]
  options = ExecutorOptions()
  if len(argv) > 3:
    small, large = argv[3].split(":")
    options = ExecutorOptions(small_leaf_policy=small, large_leaf_policy=large)
  for impl in impls:
    census(tree, impl, options)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))

"""The finiteness check of a loss-scaled step (``unscaled_all_finite``) on GPT-2 small's
bfloat16 gradients: elements per grouped block x Triton warps; kernel time from the
profiler (optirs_jax.bench.timing) as % of the copy bandwidth for reading 2 bytes per
parameter.

  python3 benchmarks/finite_tiling.py [rows,...] [warps,...]
"""

import sys

import jax
import jax.numpy as jnp

import optirs_jax
from optirs_jax.bench.cases import make_tree, tree_shapes
from optirs_jax.bench.timing import copy_bandwidth, kernel_seconds_per_step
from optirs_jax.mixed_precision._finite import FINITE_OPTIONS, unscaled_all_finite

ROWS = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "8,16,32,64").split(",")]
WARPS = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "4,8").split(",")]


def main():
  bw = copy_bandwidth(1 << 28, warmup=3, batches=1, steps=10) / 1e9
  grads = make_tree(tree_shapes("gpt2", 1.0), 1, jnp.bfloat16)
  n = sum(g.size for g in jax.tree.leaves(grads))
  default = FINITE_OPTIONS.grouped_tiling
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; copy {bw:.0f} GB/s; "
        f"unscaled_all_finite on GPT-2 bfloat16 gradients ({n} elements); default "
        f"{default.block_elems} elements, {default.num_warps} warps")
  for rows in ROWS:
    for warps in WARPS:
      options = optirs_jax.ExecutorOptions(
          grouped_tiling=optirs_jax.Tiling(block_rows=rows, num_warps=warps, flat=True))
      check = jax.jit(lambda g, s, options=options: unscaled_all_finite(
          jax.tree.leaves(g), s, executor_options=options))
      scale = jnp.float32(2.0**-15)
      ok = check(grads, scale)
      assert bool(ok)
      t, _ = kernel_seconds_per_step(lambda _, check=check: check(grads, scale), ok, 10)
      label = f"block {rows * 128:6d} warps {warps}"
      if t is None:
        print(f"{label}: no device trace (CPU)", flush=True)
        continue
      print(f"{label}: {t * 1e3:7.3f} ms  {2 * n / t / 1e9 / bw:6.1%} of copy", flush=True)


if __name__ == "__main__":
  main()

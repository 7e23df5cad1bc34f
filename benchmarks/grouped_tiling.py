"""The grouped kernel's geometry: elements per block (``ExecutorOptions.grouped_tiling``) x
Triton warps x launch plan, for the fused apply of bench cases (by default Adam) on 2000
leaves of 16K parameters (the bench's ``leaves`` tree) and on GPT-2 small; kernel time from
the profiler (optirs_jax.bench.timing), as % of the copy bandwidth at the case's minimal
bytes, Adam's grouped launches per step (and how many distinct ones), and the first call's
trace, lowering and compile seconds (how the Triton compile grows with the leaves of one
launch).

  python3 benchmarks/grouped_tiling.py [rows,...] [warps,...] [tree,...] [plan,...] \
      [case,...]

``plan``: a launch-plan spec of :mod:`optirs_jax.bench.variants`
(``MAX[/SPLIT[/BLOCKS]][:greedy][:branch][:select]``). ``case``: names of
``optirs_jax.bench.cases.OPTIMIZERS`` (e.g. ``adamw_bf16_master``).

Buffers per launch beyond 384 (8-byte pointers in a 4 KB parameter space) need CUDA's
32 KB kernel parameters (CUDA 12.1, Volta or newer); a variant that fails prints why.
"""

import math
import sys

import jax

import optirs_jax
from optirs_jax.bench.cases import (
  OPTIMIZERS,
  jax_step,
  make_grads,
  make_tree,
  param_count,
  tree_shapes,
)
from optirs_jax.bench.timing import copy_bandwidth, first_call_parts, kernel_seconds_per_step
from optirs_jax.bench.variants import PlanVariant, plan_variant

ROWS = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "8,16,32,64").split(",")]
WARPS = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "4,8").split(",")]
TREES = (sys.argv[3] if len(sys.argv) > 3 else "leaves,gpt2").split(",")
PLANS = (sys.argv[4] if len(sys.argv) > 4 else "384/112").split(",")
NAMES = (sys.argv[5] if len(sys.argv) > 5 else "adam").split(",")


def main():
  for spec in PLANS:
    PlanVariant.parse(spec)  # a bad spec stops the run before any compile
  bw = copy_bandwidth(1 << 28, warmup=3, batches=1, steps=10) / 1e9
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; copy {bw:.0f} GB/s; "
        "fused apply (optirs_jax.apply); % of copy at each case's minimal bytes")
  for name, tree in [(a, b) for a in NAMES for b in TREES]:
    opt = OPTIMIZERS[name]
    shapes = tree_shapes(tree, 1.0)
    n = param_count(shapes)
    grads = make_grads(shapes, opt)
    for spec, rows, warps in [(a, b, c) for a in PLANS for b in ROWS for c in WARPS]:
      tiling = optirs_jax.Tiling(block_rows=rows, num_warps=warps, flat=True)
      label = f"{name} {tree:8s} block {rows * 128:6d} warps {warps} plan {spec:>14s}"
      with plan_variant(spec) as variant:
        options = variant.options(optirs_jax.ExecutorOptions(grouped_tiling=tiling,
                                                             grouped_min_block_bytes=0))
        tx, fn = jax_step("optirs-apply", opt, options)
        # The gradients are an argument, not a constant of the program (a closed-over tree
        # would be compiled into it).
        step = jax.jit(fn, donate_argnums=(0, 1))
        try:
          params = make_tree(shapes, 0, opt.dtype)
          state = tx.init(params)
          # Adam's fused apply reads g, p, mu, nu and writes p, mu, nu: 7 buffers a leaf
          # (the first pass's launches; other cases are not counted).
          calls = variant.plan([math.prod(shapes[k]) for k in sorted(shapes)],
                               block_elems=tiling.block_elems, operands_per_leaf=7)
          jax.block_until_ready((params, state))
          state, parts = first_call_parts(step, params, state, grads)
          t, state = kernel_seconds_per_step(lambda st, step=step: step(*st, grads), state, 10)
        except Exception as e:  # a variant the toolchain rejects is a result
          print(f"{label}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
          continue
      first = (f"first call {sum(parts):5.1f} s (trace {parts[0]:.2f}, lower {parts[1]:.2f}, "
               f"compile {parts[2]:.2f})")
      count = (f"{len(calls)} launches ({len({c.sizes for c in calls})} distinct), "
               if name == "adam" else "")
      if t is None:
        print(f"{label}: no device trace (CPU), {count}{first}", flush=True)
        continue
      print(f"{label}: {t * 1e3:7.3f} ms  {opt.bytes_per_param * n / t / 1e9 / bw:6.1%} of "
            f"copy, {count}{first}", flush=True)
      del state


if __name__ == "__main__":
  main()

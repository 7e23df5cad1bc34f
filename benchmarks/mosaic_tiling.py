"""Mosaic GPU beside Triton: the fused apply (optirs_jax.apply) of bench cases on bench trees
with the default Triton kernels and with ``ExecutorOptions(gpu_kernels="mosaic_gpu")`` at
each ``mosaic_gpu_tiling`` (block rows x blocks in flight x thread blocks), and optax's
step; kernel time per step from the profiler (optirs_jax.bench.timing), as % of the copy
bandwidth at the case's minimal bytes and as a ratio to Triton's, and the first call's
seconds (trace, compile and run).

  python3 benchmarks/mosaic_tiling.py [rows:stages:programs[:nb],...] [tree,...] [case,...]

``programs`` 0 launches one thread block per block; ``sm`` one per streaming
multiprocessor (persistent thread blocks), ``2sm`` two; ``:nb`` drops Pallas's barriers
around shared-memory stores (``mosaic_gpu.AUTO_BARRIERS``). Blocks and stages past the shared
memory are lowered by ``mosaic_gpu.geometry`` (Adam in float32: 64 rows in flight).
Defaults: ``32:1:0,64:1:0,8:8:sm,16:4:sm,32:2:sm,16:2:2sm gpt2,leaves adam``.
A variant the toolchain rejects prints why and the sweep goes on.
"""

import sys
import time

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
from optirs_jax.bench.timing import copy_bandwidth, kernel_seconds_per_step
from optirs_jax.pallas import mosaic_gpu

VARIANTS = (sys.argv[1] if len(sys.argv) > 1 else
            "32:1:0,64:1:0,8:8:sm,16:4:sm,32:2:sm,16:2:2sm").split(",")
TREES = (sys.argv[2] if len(sys.argv) > 2 else "gpt2,leaves").split(",")
NAMES = (sys.argv[3] if len(sys.argv) > 3 else "adam").split(",")


def variant_options(spec: str) -> optirs_jax.ExecutorOptions:
  rows, stages, programs, *flags = spec.split(":")
  mosaic_gpu.AUTO_BARRIERS = "nb" not in flags  # read when the step is traced
  if programs.endswith("sm"):
    programs = int(programs[:-2] or 1) * mosaic_gpu.sm_count()
  programs = int(programs) or None
  tiling = optirs_jax.Tiling(block_rows=int(rows), num_stages=int(stages), programs=programs)
  return optirs_jax.ExecutorOptions(gpu_kernels="mosaic_gpu", mosaic_gpu_tiling=tiling)


def measure(impl, opt, options, shapes, grads):
  """(kernel seconds per step or None, first call seconds)."""
  tx, fn = jax_step(impl, opt, options)
  step = jax.jit(fn, donate_argnums=(0, 1))  # the gradients are an argument, not a constant
  params = make_tree(shapes, 0, opt.dtype)
  state = tx.init(params)
  start = time.perf_counter()
  state = step(params, state, grads)
  jax.block_until_ready(state)
  first = time.perf_counter() - start
  t, state = kernel_seconds_per_step(lambda st: step(*st, grads), state, 10)
  del state
  return t, first


def main():
  bw = copy_bandwidth(1 << 28, warmup=3, batches=1, steps=10) / 1e9
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; copy {bw:.0f} GB/s; "
        f"{mosaic_gpu.sm_count()} SMs; fused apply; % of copy at each case's minimal bytes; "
        "x: Triton's kernel time / this one's")
  for name, tree in [(a, b) for a in NAMES for b in TREES]:
    opt = OPTIMIZERS[name]
    shapes = tree_shapes(tree, 1.0)
    n = param_count(shapes)
    grads = make_grads(shapes, opt)
    runs = [("optax", "optax", None), ("triton", "optirs-apply", None)]
    runs += [(f"mosaic {v}", "optirs-apply", v) for v in VARIANTS]
    triton = None
    for label, impl, spec in runs:
      label = f"{name} {tree:7s} {label:18s}"
      try:
        options = variant_options(spec) if spec else None
        t, first = measure(impl, opt, options, shapes, grads)
      except Exception as e:  # a variant the toolchain rejects is a result
        print(f"{label}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      if t is None:
        print(f"{label}: no device trace (CPU), first call {first:5.1f} s", flush=True)
        continue
      triton = t if impl == "optirs-apply" and spec is None else triton
      ratio = f"x{triton / t:5.3f}" if triton else "      "
      print(f"{label}: {t * 1e3:7.3f} ms  {opt.bytes_per_param * n / t / 1e9 / bw:6.1%} of "
            f"copy {ratio}  first call {first:5.1f} s", flush=True)


if __name__ == "__main__":
  main()

"""The 8-bit kernels' launch settings on GPT-2 small: kernel time per step through the fused
apply for each ``quantized_tiling`` (quantization blocks per program, warps), with float32
AdamW and Lion in the same process for scale.

    PYTHONPATH=. python3 benchmarks/quantized_tiling.py [blocks per program] [warps] [cases]
        [coders] [policies]

Each argument is a comma list (defaults ``1,2,4``, ``1,2,4``, every case, ``table`` and
``group``; the coders are ``ExecutorOptions.dynamic_map_coder``'s, the same codes either
way; the policies ``ExecutorOptions.large_leaf_policy``'s: the 8-bit leaves in grouped
launches, ``group``, or one launch a leaf, ``in-place``). The cases:
``adamw8bit`` in both formats (8-bit Adam's own kernel), ``adamw`` and
``lion`` with ``state_quantization`` ``"dynamic8"`` and ``"fp8"`` (the spec builder's
quantized kernel). Kernel time from
the profiler (:func:`optirs_jax.bench.timing.profile_steps`), 10 steps after 3 of warm-up;
copy bandwidth measured in the same process, and each line's share of it at the case's
minimal bytes per parameter.
"""

import sys

import jax

import optirs_jax
from optirs_jax.bench import timing
from optirs_jax.bench.cases import gpt2_small_shapes, make_tree
from optirs_jax.pallas.options import ExecutorOptions, Tiling

# name: (maker, bytes per parameter moved at the least: params 4 + 4, gradient 4, codes)
CASES = {
  "adamw8bit-dynamic8": (lambda o: optirs_jax.adamw8bit(1e-3, executor_options=o), 16),
  "adamw8bit-fp8": (lambda o: optirs_jax.adamw8bit(1e-3, state_quantization="fp8",
                                                   executor_options=o), 16),
  "adamw-dynamic8": (lambda o: optirs_jax.adamw(1e-3, state_quantization="dynamic8",
                                                executor_options=o), 16),
  "adamw-fp8": (lambda o: optirs_jax.adamw(1e-3, state_quantization="fp8",
                                           executor_options=o), 16),
  "lion-dynamic8": (lambda o: optirs_jax.lion(1e-4, state_quantization="dynamic8",
                                              executor_options=o), 14),
  "lion-fp8": (lambda o: optirs_jax.lion(1e-4, state_quantization="fp8",
                                         executor_options=o), 14),
}
FLOAT32 = {"adamw": (lambda o: optirs_jax.adamw(1e-3, executor_options=o), 28),
           "lion": (lambda o: optirs_jax.lion(1e-4, executor_options=o), 20)}


def kernel_ms(make, options) -> float:
  shapes = gpt2_small_shapes()
  params, grads = make_tree(shapes, 0), make_tree(shapes, 1)
  tx = make(options)
  fn = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p), donate_argnums=(0, 1))
  state = (params, tx.init(params))
  run = lambda st: fn(st[0], st[1], grads)
  for _ in range(3):
    state = run(state)
  prof, _ = timing.profile_steps(run, state, 10)
  return (prof["summed_s"] or float("nan")) * 1e3


def main(argv):
  rows = [int(x) for x in (argv[1] if len(argv) > 1 else "1,2,4").split(",")]
  warps = [int(x) for x in (argv[2] if len(argv) > 2 else "1,2,4").split(",")]
  names = argv[3].split(",") if len(argv) > 3 else list(CASES)
  coders = argv[4].split(",") if len(argv) > 4 else ["table"]
  policies = argv[5].split(",") if len(argv) > 5 else ["group"]
  n = sum(x.size for x in jax.tree.leaves(make_tree(gpt2_small_shapes(), 0)))
  copy = timing.copy_bandwidth(1 << 27, warmup=3, batches=3, steps=10)
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: GPT-2 small ({n} "
        f"parameters), fused apply, kernel ms per step; copy {copy / 1e9:.0f} GB/s")
  print(f"{'case':<20}{'coder':>18}{'policy':>9}{'blocks':>7}{'warps':>6}{'kernel ms':>11}"
        f"{'% copy':>8}")
  line = lambda name, c, p, r, w, ms, b: print(
      f"{name:<20}{c:>18}{p:>9}{r:>7}{w:>6}{ms:>11.3f}"
      f"{100 * n * b / (ms * 1e-3) / copy:>8.1f}", flush=True)
  for name, (make, b) in FLOAT32.items():
    line(name, "-", "-", "-", "-", kernel_ms(make, ExecutorOptions()), b)
  for name in names:
    make, b = CASES[name]
    for c in coders if "dynamic8" in name else ["table"]:
      for p in policies:
        for r in rows:
          for w in warps:
            options = ExecutorOptions(quantized_tiling=Tiling(block_rows=r, num_warps=w),
                                      dynamic_map_coder=c,
                                      large_leaf_policy=p)
            line(name, c, p, r, w, kernel_ms(make, options), b)


if __name__ == "__main__":
  main(sys.argv)

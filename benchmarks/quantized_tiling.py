"""The 8-bit kernel's launch settings on GPT-2 small: kernel time per step of ``adamw8bit``
(both state formats) through the fused apply for each ``quantized_tiling``.

    PYTHONPATH=. python3 benchmarks/quantized_tiling.py [blocks per program] [warps]

Both arguments are comma lists (defaults ``1,2,4`` and ``1,2,4``); kernel time from the
profiler (:func:`optirs_jax.bench.timing.profile_steps`), 10 steps after 3 of warm-up.
"""

import sys

import jax

import optirs_jax
from optirs_jax.bench import timing
from optirs_jax.bench.cases import gpt2_small_shapes, make_tree
from optirs_jax.pallas.options import ExecutorOptions, Tiling


def kernel_ms(fmt: str, tiling: Tiling) -> float:
  shapes = gpt2_small_shapes()
  params, grads = make_tree(shapes, 0), make_tree(shapes, 1)
  tx = optirs_jax.adamw8bit(1e-3, state_quantization=fmt,
                            executor_options=ExecutorOptions(quantized_tiling=tiling))
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
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}: GPT-2 small adamw8bit, "
        "fused apply, kernel ms per step")
  print(f"{'format':<10}{'blocks':>7}{'warps':>6}{'kernel ms':>11}")
  for fmt in ("dynamic8", "fp8"):
    for r in rows:
      for w in warps:
        ms = kernel_ms(fmt, Tiling(block_rows=r, num_warps=w))
        print(f"{fmt:<10}{r:>7}{w:>6}{ms:>11.3f}", flush=True)


if __name__ == "__main__":
  main(sys.argv)

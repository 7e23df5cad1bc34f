"""The 8-bit Adam kernel's geometry on one GPT-2-sized leaf: quantization blocks per program
(``ExecutorOptions.quantized_tiling.block_rows``) x Triton warps, kernel time from the
profiler (optirs_jax.bench.timing), as % of the copy bandwidth for its 16 bytes per
parameter.

  python3 benchmarks/adam8bit_tiling.py [rows,...] [warps,...]
"""

import sys

import jax
import jax.numpy as jnp

import optirs_jax
from optirs_jax.bench.timing import copy_bandwidth, kernel_seconds_per_step

ROWS = [int(v) for v in (sys.argv[1] if len(sys.argv) > 1 else "1,2,4,8,16").split(",")]
WARPS = [int(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8").split(",")]
N = 50257 * 768  # GPT-2's token embedding


def main():
  bw = copy_bandwidth(1 << 28, warmup=3, batches=1, steps=10) / 1e9
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; copy {bw:.0f} GB/s; "
        f"leaf {N} float32 parameters, 16 bytes each")
  params = {"w": jax.random.normal(jax.random.key(0), (N,))}
  grads = {"w": jax.random.normal(jax.random.key(1), (N,))}
  for rows in ROWS:
    for warps in WARPS:
      tiling = optirs_jax.Tiling(block_rows=rows, num_warps=warps)
      tx = optirs_jax.adam8bit(1e-3, executor_options=optirs_jax.ExecutorOptions(
          quantized_tiling=tiling))
      step = jax.jit(lambda p, s, tx=tx: optirs_jax.apply(tx, grads, s, p),
                     donate_argnums=(0, 1))
      state = (jax.tree.map(jnp.copy, params), tx.init(params))
      state = step(*state)
      t, state = kernel_seconds_per_step(lambda st, step=step: step(*st), state, 10)
      print(f"rows {rows:3d} warps {warps}: {t * 1e3:7.3f} ms  {16 * N / t / 1e9 / bw:6.1%} "
            "of copy", flush=True)


if __name__ == "__main__":
  main()

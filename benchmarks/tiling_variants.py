"""Times the Adam kernel (fused apply) on one flat 268M-element leaf under several tilings.

    PYTHONPATH=. python3 benchmarks/tiling_variants.py

Each variant replaces the CUDA tiling, builds a fresh step, and reports ms, % of the copy
bandwidth measured in the same run, and how many copies the compiled program holds (an
aliasing the compiler could not honour shows up as a copy).
"""

import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import optirs_jax
from optirs_jax.pallas import kernel

N = 1 << 28


def timeit(f, state, reps=20):
  for _ in range(3):
    state = f(state)
  jax.block_until_ready(state)
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(reps):
      state = f(state)
    jax.block_until_ready(state)
    times.append((time.perf_counter() - t0) / reps)
  return statistics.median(times)


def main():
  x = jnp.arange(N, dtype=jnp.float32)
  copy = jax.jit(lambda x: -x, donate_argnums=0)
  copy_s = timeit(copy, x)
  print(f"copy {copy_s * 1e3:.3f} ms, {8 * N / copy_s / 1e9:.0f} GB/s")
  variants = {"2d r32 w4": kernel.Tiling(32, num_warps=4),
              "2d r8 w4": kernel.Tiling(8, num_warps=4),
              "1d 4096 w8": kernel.Tiling(32, num_warps=8, flat=True),
              "1d 4096 w4": kernel.Tiling(32, num_warps=4, flat=True),
              "1d 1024 w4": kernel.Tiling(8, num_warps=4, flat=True),
              "1d 8192 w8": kernel.Tiling(64, num_warps=8, flat=True)}
  g = {"w": jnp.full((N,), 1e-3, jnp.float32)}
  for label, tiling in [("optax", None)] + list(variants.items()):
    if tiling is not None:
      kernel.TILINGS["cuda"] = tiling
      tx = optirs_jax.adam(1e-3)
      step = lambda gr, s, p: optirs_jax.apply(tx, gr, s, p)
    else:
      tx = optax.adam(1e-3)
      step = lambda gr, s, p: (optax.apply_updates(p, tx.update(gr, s, p)[0]),
                               tx.update(gr, s, p)[1])
    params = {"w": jnp.ones((N,), jnp.float32)}
    jitted = jax.jit(step, donate_argnums=(1, 2))
    compiled = jitted.lower(g, tx.init(params), params).compile()
    hlo = compiled.as_text()
    copies = len(re.findall(r"= f32\[\d+\]\{0\} copy\(", hlo))
    sec = timeit(lambda ps: compiled(g, ps[1], ps[0]), (params, tx.init(params)))
    print(f"{label:<12} {sec * 1e3:7.3f} ms  {100 * copy_s / sec * 28 / 8:5.1f}% of copy bw  "
          f"copies in HLO: {copies}", flush=True)
    del params
  return 0


if __name__ == "__main__":
  sys.exit(main())

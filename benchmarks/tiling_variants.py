"""Times the Adam kernel (fused apply) on one flat 268M-element leaf under several tilings.

    PYTHONPATH=. python3 benchmarks/tiling_variants.py

Each variant sets the packed and in-place kernels' CUDA tiling, builds a fresh step, and
reports ms, % of the copy bandwidth measured in the same run, and how many copies the
compiled program holds (an aliasing the compiler could not honour shows up as a copy).
"""

import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import optirs_jax
from optirs_jax import ExecutorOptions, Tiling

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
  variants = {"2d r32 w4": Tiling(32, num_warps=4),
              "2d r8 w4": Tiling(8, num_warps=4),
              "1d 4096 w8": Tiling(32, num_warps=8, flat=True),
              "1d 4096 w4": Tiling(32, num_warps=4, flat=True),
              "1d 1024 w4": Tiling(8, num_warps=4, flat=True),
              "1d 8192 w8": Tiling(64, num_warps=8, flat=True)}
  g = {"w": jnp.full((N,), 1e-3, jnp.float32)}
  for label, tiling in [("optax", None)] + list(variants.items()):
    if tiling is not None:
      tx = optirs_jax.adam(1e-3, executor_options=ExecutorOptions(
          small_leaf_policy="pack", large_leaf_policy="in-place", cuda_tiling=tiling))
      step = lambda p, s, gr: optirs_jax.apply(tx, gr, s, p)
    else:
      tx = optax.adam(1e-3)
      step = lambda p, s, gr: (optax.apply_updates(p, tx.update(gr, s, p)[0]),
                               tx.update(gr, s, p)[1])
    params = {"w": jnp.ones((N,), jnp.float32)}
    # Donated arguments in the order of the outputs (see optirs_jax.bench.jax_step).
    jitted = jax.jit(step, donate_argnums=(0, 1))
    compiled = jitted.lower(params, tx.init(params), g).compile()
    hlo = compiled.as_text()
    copies = len(re.findall(r"= f32\[\d+\]\{0\} copy\(", hlo))
    sec = timeit(lambda ps: compiled(ps[0], ps[1], g), (params, tx.init(params)))
    print(f"{label:<12} {sec * 1e3:7.3f} ms  {100 * copy_s / sec * 28 / 8:5.1f}% of copy bw  "
          f"copies in HLO: {copies}", flush=True)
    if label in ("optax", "2d r32 w4", "1d 4096 w8"):  # what the compiled step runs
      entry = hlo[hlo.index("ENTRY"):]
      print("   ", "\n    ".join(line.strip()[:160] for line in entry.splitlines()[:14]))
    del params
  triton_adam(copy_s)
  return 0


def triton_adam(copy_s):
  """A plain Triton Adam kernel on torch tensors: what the hardware gives one 1-D kernel."""
  try:
    import torch
    import triton
    import triton.language as tl
  except ImportError as e:
    print("triton reference skipped:", e)
    return

  @triton.jit
  def adam(p, g, m, v, n, lr, b1, b2, eps, bc1, bc2, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gg = tl.load(g + offs, mask=mask)
    mm = b1 * tl.load(m + offs, mask=mask) + (1 - b1) * gg
    vv = b2 * tl.load(v + offs, mask=mask) + (1 - b2) * gg * gg
    tl.store(m + offs, mm, mask=mask)
    tl.store(v + offs, vv, mask=mask)
    pp = tl.load(p + offs, mask=mask) - lr * (mm / bc1) / (tl.sqrt(vv / bc2) + eps)
    tl.store(p + offs, pp, mask=mask)

  dev = "cuda"
  p, g = torch.ones(N, device=dev), torch.full((N,), 1e-3, device=dev)
  m, v = torch.zeros(N, device=dev), torch.zeros(N, device=dev)
  for block, warps in ((1024, 4), (4096, 8)):
    def step(_):
      adam[(triton.cdiv(N, block),)](p, g, m, v, N, 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.001,
                                     BLOCK=block, num_warps=warps)
      return None

    def timed(reps=20):
      for _ in range(3):
        step(None)
      torch.cuda.synchronize()
      times = []
      for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
          step(None)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps)
      return statistics.median(times)

    sec = timed()
    print(f"triton {block} w{warps} {sec * 1e3:7.3f} ms  {100 * copy_s / sec * 28 / 8:5.1f}% "
          "of copy bw (torch tensors, plain Triton)", flush=True)


if __name__ == "__main__":
  sys.exit(main())

"""Where a packed step's extra time goes: packing many leaves into one buffer and back.

    PYTHONPATH=. python3 benchmarks/unpack_variants.py [leaves] [size]

Times, for ``leaves`` leaves of ``size`` float32 elements: the concatenation into one
buffer (what the kernel path does with g, m, v), and two ways back to leaves: bare slices
(``jnp.split``, what ``optirs_jax.pallas.packed._unpack`` does) and slices feeding a
multiply by an opaque 1 (tried so that XLA would merge them; it did not, see
benchmarks/NOTES.md).
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
from hlo_census import launch_ops


def timeit(f, *args, reps=20):
  out = f(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = f(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / reps)
  return statistics.median(times)


def main(argv):
  n = int(argv[1]) if len(argv) > 1 else 2000
  size = int(argv[2]) if len(argv) > 2 else 16384
  leaves = [jnp.full((size,), i, jnp.float32) for i in range(n)]
  flat = jnp.concatenate(leaves)
  cuts = [size * i for i in range(1, n)]
  gb = n * size * 4 * 2 / 1e9  # read + write

  def bare(x):
    return jnp.split(x, cuts)

  def scaled(x):
    one = jax.lax.optimization_barrier(jnp.ones((), x.dtype))
    return [p * one for p in jnp.split(x, cuts)]

  variants = {"concatenate": (jax.jit(lambda *xs: jnp.concatenate(xs)), leaves),
              "split bare": (jax.jit(bare), [flat]),
              "split * opaque one": (jax.jit(scaled), [flat])}
  print(f"# {jax.devices()[0].device_kind}: {n} leaves x {size} float32")
  for label, (f, args) in variants.items():
    t0 = time.perf_counter()
    compiled = f.lower(*args).compile()
    compile_s = time.perf_counter() - t0
    kernels = sum(launch_ops(compiled.as_text()).values())
    sec = timeit(compiled, *args)
    print(f"{label:<20} {sec * 1e3:8.3f} ms  {gb / sec:7.0f} GB/s  {kernels:5d} kernels  "
          f"compile {compile_s:.1f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))

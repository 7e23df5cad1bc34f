"""Whether XLA:CPU compiles a many-leaf Adam step faster with the leaves stacked: a plain
jnp Adam (bias-corrected, step 1) per leaf, on ``jnp.stack``-ed leaves (and back), or on
``jnp.concatenate``-d leaves (and ``jnp.split``); lowering and compile seconds, the first
run and the fastest of 5 steps. One variant per process (a process's caches would
shorten the compile).

  JAX_PLATFORMS=cpu python benchmarks/cpu_stacking.py LEAVES SIZE leaf|stack|concat
"""

import sys
import time

import jax
import jax.numpy as jnp


def adam(g, p, m, v):
  m = 0.9 * m + 0.1 * g
  v = 0.999 * v + 0.001 * g * g
  return p - 1e-3 * (m / 0.1) / (jnp.sqrt(v / 0.001) + 1e-8), m, v


def per_leaf(g, p, m, v):
  out = [adam(*a) for a in zip(g, p, m, v, strict=True)]
  return tuple([o[k] for o in out] for k in range(3))


def stacked(g, p, m, v):
  return tuple(list(x) for x in adam(*(jnp.stack(x) for x in (g, p, m, v))))


def concatenated(g, p, m, v):
  return tuple(jnp.split(x, len(g)) for x in adam(*(jnp.concatenate(x) for x in (g, p, m, v))))


def main():
  n, size, variant = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  variants = {"leaf": per_leaf, "stack": stacked, "concat": concatenated}
  if variant not in variants:
    raise SystemExit(f"unknown variant {variant!r}; valid: {sorted(variants)}")
  xs = [[jnp.full((size,), i + k, jnp.float32) for i in range(n)] for k in range(4)]
  f = jax.jit(variants[variant], donate_argnums=(1, 2, 3))
  t0 = time.perf_counter()
  lowered = f.lower(*xs)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  out = jax.block_until_ready(compiled(*xs))
  t3 = time.perf_counter()
  steps = []
  for _ in range(5):
    a = time.perf_counter()
    out = jax.block_until_ready(compiled(xs[0], *out))
    steps.append(time.perf_counter() - a)
  print(f"{variant} x {n}: lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s, first run "
        f"{t3 - t2:.3f} s, step {min(steps) * 1e3:.1f} ms")


if __name__ == "__main__":
  main()

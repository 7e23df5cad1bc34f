"""The sharded path on a one-device mesh against the unsharded step (GPT-2 small, Adam).

    PYTHONPATH=. python3 benchmarks/sharded_overhead.py

Kernel time per step (profiler) and per-call time of the fused step: plain arrays; arrays
placed with a NamedSharding on a 1-device mesh (Auto axes: custom_partitioning); and the
step inside a shard_map over that mesh (the kernels run on the local shards).
"""

import sys

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optirs_jax
from optirs_jax.bench import timing
from optirs_jax.bench.cases import make_tree, tree_shapes


def main():
  shapes = tree_shapes("gpt2", 1.0 if jax.default_backend() != "cpu" else 1 / 64)
  tx = optirs_jax.adam(1e-3)
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  step = lambda p, s, g: optirs_jax.apply(tx, g, s, p)
  spec = lambda t: jax.tree.map(lambda _: P(), t)
  variants = {
      "plain": (jax.jit(step, donate_argnums=(0, 1)), lambda t: t),
      "1-device mesh": (jax.jit(step, donate_argnums=(0, 1)),
                        lambda t: jax.device_put(t, NamedSharding(mesh, P()))),
  }
  grads = make_tree(shapes, 1)
  sspec = spec(tx.init(grads))
  variants["shard_map"] = (
      jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec(grads), sspec, spec(grads)),
                            out_specs=(spec(grads), sspec)), donate_argnums=(0, 1)),
      lambda t: t)
  for name, (fn, place) in variants.items():
    params = place(make_tree(shapes, 0))
    state, g = place(tx.init(params)), place(grads)
    run = lambda ps: fn(ps[0], ps[1], g)
    (params, state), first = timing.first_call(fn, params, state, g)
    sec, ps, _ = timing.time_steps(run, (params, state), warmup=2, batches=3, per_batch=10)
    kernel, _ = timing.kernel_seconds_per_step(run, ps, 10)
    kernel_ms = f"{kernel * 1e3:.3f}" if kernel else "-"
    print(f"{name:<14} kernel {kernel_ms} ms  per call {sec * 1e3:.3f} ms  "
          f"first call {first:.1f} s", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Which kernels one step runs on the device, and how long each takes (profiler trace).

    PYTHONPATH=. python3 benchmarks/kernel_breakdown.py [tree] [optimizer] [impl]

Traces 10 steps of one bench case and prints, per kernel name, its launches per step and
its time per step, largest first.
"""

import collections
import glob
import os
import sys
import tempfile

import jax
from jax.profiler import ProfileData

from optirs_jax.bench import timing
from optirs_jax.bench.cases import (
  OPTIMIZERS,
  jax_step,
  make_grads,
  make_tree,
  tree_shapes,
)


def main(argv):
  tree, name, impl = (argv[1:] + ["gpt2", "adamw_bf16_master", "optirs-apply"][len(argv) - 1:])[:3]
  opt = OPTIMIZERS[name]
  shapes = tree_shapes(tree, 1.0)
  tx, step = jax_step(impl, opt)
  grads = make_grads(shapes, opt)
  params = make_tree(shapes, 0, opt.dtype)
  fn = jax.jit(step, donate_argnums=(0, 1))
  state = (params, tx.init(params))
  for _ in range(3):
    state = fn(state[0], state[1], grads)
  timing.block(state)
  steps = 10
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(steps):
        state = fn(state[0], state[1], grads)
      timing.block(state)
    data = ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"),
                                           recursive=True)[0])
  plane = data.find_plane_with_name("/device:GPU:0")
  total, count = collections.Counter(), collections.Counter()
  for line in plane.lines:
    if line.name.startswith("Stream"):
      for e in line.events:
        total[e.name] += e.duration_ns / steps
        count[e.name] += 1 / steps
  print(f"{tree} {name} {impl}: {sum(total.values()) / 1e6:.3f} ms per step, "
        f"{sum(count.values()):.0f} kernels")
  for k, ns in total.most_common(15):
    print(f"  {ns / 1e6:8.3f} ms  x{count[k]:5.1f}  {k[:110]}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))

"""Whether XLA would overlap the grouped launches if they ran on several GPU streams: every
``k``-th launch of the fused apply is put on stream ``k`` (``compute_on("gpu_stream:k")``,
which XLA turns into an async call on that stream), the step is compiled for the
compile-only H200 (``optirs_jax.bench.compile_only``), and the scheduled module's launches
are listed in order: an async launch overlaps others only where launches are scheduled
between its start and its done.

  PYTHONPATH=. python benchmarks/stream_overlap.py [tree] [streams] [plan] [option=value,...]

``tree``: a bench tree; ``streams``: how many streams the launches take turns on (the
first is the main stream); ``plan``: a launch-plan spec of :mod:`optirs_jax.bench.variants`;
options: XLA compile options, e.g. ``xla_gpu_enable_latency_hiding_scheduler=1``.
"""

import itertools
import re
import sys

import jax
from jax.experimental.compute_on import compute_on

from optirs_jax.bench.cases import OPTIMIZERS, abstract_tree, jax_step
from optirs_jax.bench.compile_only import lower_for_h200
from optirs_jax.bench.variants import plan_variant
from optirs_jax.pallas import dispatch

LAUNCH = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?\b(call-start|call-done|custom-call)\(")


def on_streams(grouped_call, streams: int):
  """``grouped_call`` with its ``k``-th call on stream ``k % streams`` (0: the main one)."""
  turn = itertools.count()

  def call(*args, **kwargs):
    stream = next(turn) % streams
    if not stream:
      return grouped_call(*args, **kwargs)
    with compute_on(f"gpu_stream:{stream}"):
      return grouped_call(*args, **kwargs)

  return call


def main():
  tree = sys.argv[1] if len(sys.argv) > 1 else "leaves"
  streams = int(sys.argv[2]) if len(sys.argv) > 2 else 2
  spec = sys.argv[3] if len(sys.argv) > 3 else "1512/112"
  options = {}
  for item in filter(None, (sys.argv[4] if len(sys.argv) > 4 else "").split(",")):
    key, value = item.split("=")
    options[key] = {"1": True, "0": False}.get(value, value)
  opt = OPTIMIZERS["adam"]
  params = abstract_tree(tree, opt.dtype)
  grouped_call = dispatch.grouped_call
  dispatch.grouped_call = on_streams(grouped_call, streams)
  try:
    with plan_variant(spec) as variant:
      tx, fn = jax_step("optirs-apply", opt, variant.options())
      state = jax.eval_shape(tx.init, params)
      compiled = lower_for_h200(fn, params, state, params).compile(options or None)
  finally:
    dispatch.grouped_call = grouped_call
  entry = compiled.as_text().split("\nENTRY ", 1)[1]
  order = [m.group(2) if m.group(2) != "custom-call" else "launch"
           for m in map(LAUNCH.match, entry.splitlines()) if m]
  print(f"# jax {jax.__version__}; Adam on {tree}, plan {spec}, {streams} streams, options "
        f"{options}; the entry computation's launches in schedule order:")
  print(" ".join(order))
  starts = [i for i, op in enumerate(order) if op == "call-start"]
  between = [order.index("call-done", i) - i - 1 for i in starts]
  print(f"async launches: {len(starts)}; launches scheduled between a start and its done: "
        f"{between}")


if __name__ == "__main__":
  main()

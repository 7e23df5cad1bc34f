"""Where a step's compile goes: ``jit(step).lower(...).compile()`` under the profiler, its
host events summed by name (inclusive seconds and count, the longest first).

  PYTHONPATH=. python benchmarks/compile_profile.py leaves adam optirs-apply [top] [h200]

``h200``: compile for the compile-only H200 (``optirs_jax.bench.compile_only``) instead of
this machine's device, so a machine without a GPU profiles XLA's CUDA compile. One case per
process (a process's caches would shorten the compile). Nested events count
in their own name and in their parents', so the rows do not add up to the total.
"""

import collections
import glob
import os
import sys
import tempfile
import time

import jax
from jax.profiler import ProfileData

from optirs_jax.bench.cases import abstract_step_and_inputs, step_and_inputs
from optirs_jax.bench.compile_only import lower_for_h200


def main(tree: str, name: str, impl: str, top: int = 40, target: str = "device"):
  if target == "h200":
    step, args = abstract_step_and_inputs(tree, name, impl)
    lowered = lower_for_h200(step, *args)
    kind = "compile-only NVIDIA H200"
  elif target == "device":
    step, args = step_and_inputs(tree, name, impl)
    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(*args)
    kind = jax.devices()[0].device_kind
  else:
    raise SystemExit(f"unknown target {target!r}; valid: device, h200")
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      t0 = time.perf_counter()
      lowered.compile()
      seconds = time.perf_counter() - t0
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    profile = ProfileData.from_file(files[0])
  totals: dict[str, list] = collections.defaultdict(lambda: [0, 0])
  for plane in profile.planes:
    if plane.name.startswith("/device:"):
      continue
    for line in plane.lines:
      for event in line.events:
        row = totals[event.name]
        row[0] += event.duration_ns
        row[1] += 1
  print(f"# {tree} {name} {impl}: compile {seconds:.2f} s wall; host events by inclusive "
        f"seconds ({kind}, jax {jax.__version__})", flush=True)
  for event, (ns, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
    print(f"{ns / 1e9:9.3f} s {count:7d}x  {event[:110]}", flush=True)


if __name__ == "__main__":
  args = sys.argv[1:]
  main(*args[:3], *[int(a) for a in args[3:4]], *args[4:5])

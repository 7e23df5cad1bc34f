"""The largest model of the GPT family a configuration trains on one device.

A ladder of (layers, width) from GPT-2 small through GPT-2 XL's shape and on (heads of 64
dimensions); a binary search over it, each attempt in a fresh process that builds the model
and the optimizer state and trains two steps (:func:`probe`). An attempt that ends in an
error (out of memory) does not fit. The result: the largest rung that fits, its parameters
and peak device memory, and every attempt.

>>> largest_fitting(10, lambda k: k <= 6)
(6, [5, 8, 7, 6])
"""

from __future__ import annotations

import sys
from collections.abc import Callable

# (layers, width): GPT-2 small, medium, large and XL's shapes, then wider and deeper.
LADDER = ((12, 768), (24, 1024), (36, 1280), (48, 1600), (48, 2048), (56, 2560), (64, 3072),
          (72, 3584), (80, 4096), (88, 4608), (96, 5120), (104, 6144))


def parse_ladder(text: str) -> tuple[tuple[int, int], ...]:
  """``"12x768,24x1024"`` as ``((12, 768), (24, 1024))``, checked to grow."""
  try:
    rungs = tuple(tuple(int(v) for v in part.split("x")) for part in text.split(","))
  except ValueError:
    rungs = ()
  if not rungs or any(len(r) != 2 or min(r) < 1 for r in rungs):
    raise ValueError(f"a ladder is comma-separated LAYERSxWIDTH, e.g. '12x768,24x1024'; "
                     f"got {text!r}")
  return rungs


def largest_fitting(n: int, fits: Callable[[int], bool]) -> tuple[int, list[int]]:
  """The largest ``k < n`` with ``fits(k)`` (-1 if none), for a monotone ``fits``, and the
  rungs tried, in order (about log2(n) of them)."""
  lo, hi, tried = -1, n, []  # fits(lo) holds (or lo is -1); fits(hi) fails (or hi is n)
  while hi - lo > 1:
    mid = (lo + hi + 1) // 2
    tried.append(mid)
    if fits(mid):
      lo = mid
    else:
      hi = mid
  return lo, tried


def probe(args) -> dict:
  """Builds ``args.one``'s configuration at ``args.probe`` (layers x width) and trains two
  steps: the parameters, the device's peak memory, and the seconds of each phase (the
  build, the first step with its trace and compile, the second). Each phase is logged to
  stderr as it starts, so an attempt cut by its timeout names the phase it was in."""
  import os
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np

  from optirs_jax.bench.gpt import GPTConfig
  from optirs_jax.bench.steps import Hyper, Run
  layers, width = parse_ladder(args.probe)[0]
  start = last = time.perf_counter()
  seconds = {}

  def phase(name: str, next_name: str | None):
    nonlocal last
    now = time.perf_counter()
    seconds[name] = round(now - last, 3)
    last = now
    if next_name:
      print(f"probe {args.one} {args.probe}: {next_name} from {now - start:.1f} s",
            file=sys.stderr, flush=True)

  print(f"probe {args.one} {args.probe}: build from 0.0 s", file=sys.stderr, flush=True)
  model = GPTConfig.preset(args.model).scaled(layers, width)
  context = args.context or model.context
  run = Run(args.one, model, Hyper(total=2, warmup=1))
  rng = np.random.default_rng(0)
  phase("build_s", "first step (trace, compile, run)")
  for k, name in enumerate(("first_step_s", "second_step_s")):
    value = run.step(jnp.asarray(rng.integers(0, 256, (args.batch, context + 1)), jnp.int32))
    jax.block_until_ready(value)
    phase(name, "second step" if k == 0 else None)
  stats = jax.devices()[0].memory_stats() or {}
  return {"config": args.one, "layers": layers, "width": width, "batch": args.batch,
          "context": context, "parameters": run.parameters,
          "peak_bytes": stats.get("peak_bytes_in_use"),
          "memory_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), **seconds}

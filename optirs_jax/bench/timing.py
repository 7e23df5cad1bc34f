"""How the benchmark measures: device time from the profiler, wall time per call, first call.

* **Kernel time per step**: ``steps`` calls run under ``jax.profiler.trace``; the trace is
  read back with ``jax.profiler.ProfileData`` and the durations of the events on the
  device plane's stream lines (``/device:GPU:0``, lines named ``Stream ...``: kernels and
  copies) are summed and divided by the steps. What the device spends, without the host's
  dispatch and without a loop's own overhead. ``None`` where the trace has no device plane
  (the CPU).
* **Per-call wall time**: batches of consecutive calls of the ``jax.jit`` function (its
  C++ fast path, what a training loop calls), the median batch per call, and the host's
  share (the time to enqueue them).
* **First call**: trace, lower, compile and run of the first call, wall time.
"""

from __future__ import annotations

import glob
import itertools
import os
import statistics
import tempfile
import time
import warnings


def block(tree) -> None:
  import jax
  for x in jax.tree.leaves(tree):
    x.block_until_ready()


def time_steps(run_step, state, *, warmup: int, batches: int, per_batch: int, wait=block):
  """Median seconds per step over ``batches`` batches of ``per_batch`` consecutive steps,
  the state after them, and the median seconds per step the host took to enqueue them."""
  for _ in range(warmup):
    state = run_step(state)
  wait(state)
  times, host = [], []
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(per_batch):
      state = run_step(state)
    host.append((time.perf_counter() - t0) / per_batch)
    wait(state)
    times.append((time.perf_counter() - t0) / per_batch)
  return statistics.median(times), state, statistics.median(host)


def device_seconds(profile_data, device: str = "/device:GPU:0", *,
                   busy: bool = False) -> float | None:
  """Seconds of device work in a profile: the summed durations of the events on the
  device plane's stream lines, or None when it has no such plane or no event on it. With
  ``busy``, the time during which at least one event runs (the union of their intervals):
  events that overlap, on several streams or lines, count once."""
  plane = profile_data.find_plane_with_name(device)
  events = [] if plane is None else [e for line in plane.lines if line.name.startswith("Stream")
                                     for e in line.events]
  if not events:  # no plane, or one of a device this process did not use (JAX_PLATFORMS=cpu)
    return None
  if not busy:
    return sum(e.duration_ns for e in events) * 1e-9
  total_ns, end = 0.0, float("-inf")
  for start, stop in sorted((e.start_ns, e.start_ns + e.duration_ns) for e in events):
    if stop > end:
      total_ns += stop - max(start, end)
      end = stop
  return total_ns * 1e-9


def kernel_seconds_per_step(run_step, state, steps: int):
  """(device seconds per step from a profiler trace of ``steps`` steps or None, state): the
  summed kernel time of :func:`profile_steps`."""
  profile, state = profile_steps(run_step, state, steps)
  return profile["summed_s"], state


def top_kernels(profile_data, top: int, device: str = "/device:GPU:0",
                by_op: bool = False) -> list[tuple]:
  """The ``top`` events of the device plane's stream lines by summed duration: ``(name,
  seconds, count)`` each, longest first (empty without a device plane). With ``by_op``,
  each kernel's name is followed by the HLO op that launched it (``"name @ op"``, where the
  trace's event names one: a cuBLAS kernel's name alone does not say which product it ran).
  Where XLA runs the step as CUDA graphs (its default on GPUs) the op is the graph's
  (``command_buffer_1``); ``XLA_FLAGS=--xla_gpu_enable_command_buffer=`` names each op.
  """
  plane = profile_data.find_plane_with_name(device)
  if plane is None:
    return []
  totals: dict[str, list] = {}
  with warnings.catch_warnings():
    # jaxlib 0.11's stats type has no __module__, for which Python 3.12 warns the first
    # time it is iterated: where warnings are errors (this project's pytest), raised inside
    # jaxlib's iterator, it aborted the process. The warning is about jaxlib's type.
    warnings.filterwarnings("ignore", "builtin type .* has no __module__ attribute",
                            DeprecationWarning)
    for line in plane.lines:
      if line.name.startswith("Stream"):
        for e in line.events:
          name = e.name
          if by_op:
            op = next((str(v) for k, v in e.stats if k == "hlo_op"), None)
            name = f"{name} @ {op}" if op and op != name else name
          t = totals.setdefault(name, [0.0, 0])
          t[0] += e.duration_ns * 1e-9
          t[1] += 1
  return sorted(((n, s, c) for n, (s, c) in totals.items()), key=lambda x: -x[1])[:top]


def profile_steps(run_step, state, steps: int, top: int = 0, by_op: bool = False):
  """``({busy_s, summed_s, top}, state)`` per step of a profiler trace of ``steps`` steps:
  the device's busy and summed event time and its ``top`` kernels (name, seconds, calls per
  step; ``by_op``: named with their HLO ops, :func:`top_kernels`); the times None where
  the trace has no device plane."""
  import jax
  from jax.profiler import ProfileData
  block(state)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(steps):
        state = run_step(state)
      block(state)
    files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
    data = ProfileData.from_file(files[0]) if files else None
    busy = device_seconds(data, busy=True) if data else None
    summed = device_seconds(data) if data else None
    kernels = top_kernels(data, top, by_op=by_op) if data and top else []
  per = lambda x: None if x is None else x / steps
  return {"busy_s": per(busy), "summed_s": per(summed),
          "top": [(n, sec / steps, c / steps) for n, sec, c in kernels]}, state


def copy_bandwidth(n: int, *, warmup: int, batches: int, steps: int) -> float:
  """Bytes read plus written per second by an elementwise copy of ``n`` float32 (donated,
  in place, like the optimizer steps): from the profiler's kernel time where the trace has
  a device plane, else from the wall time of ``batches`` x ``steps`` calls."""
  import jax
  import jax.numpy as jnp
  x = jnp.arange(n, dtype=jnp.float32)
  f = jax.jit(lambda x: -x, donate_argnums=0)
  sec, x, _ = time_steps(f, x, warmup=warmup, batches=batches, per_batch=steps)
  kernel, _ = kernel_seconds_per_step(f, x, steps)
  return 2 * 4 * n / (kernel if kernel else sec)


def first_call(fn, *args):
  """(the first call's outputs, its wall seconds: trace, compile and run)."""
  t0 = time.perf_counter()
  out = fn(*args)
  block(out)
  return out, time.perf_counter() - t0


def first_call_parts(jitted, *args):
  """(the first call's outputs, its wall seconds of ``jitted.trace``, ``.lower()``,
  ``.compile()`` and the run, timed apart). ``jitted`` is a ``jax.jit`` function; its own
  cache is not filled, so a later call of it compiles again."""
  times = [time.perf_counter()]
  traced = jitted.trace(*args)
  times.append(time.perf_counter())
  lowered = traced.lower()
  times.append(time.perf_counter())
  compiled = lowered.compile()
  times.append(time.perf_counter())
  out = compiled(*args)
  block(out)
  times.append(time.perf_counter())
  return out, [b - a for a, b in itertools.pairwise(times)]


def step_memory(jitted, *args) -> int | None:
  """Arguments + outputs - aliased + temporaries of the compiled step, in bytes."""
  analysis = jitted.lower(*args).compile().memory_analysis()
  if analysis is None:
    return None
  return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
             - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)

"""The whole training step, measured: a GPT on the CPython standard library's source.

    python -m optirs_jax.bench.train [--model gpt2] [--configs optax,optirs-fused,...]
        [--steps 200] [--batch 8] [--eval-every 50] [--json out.json]
    python -m optirs_jax.bench.train --largest [--configs ...] [--ladder 12x768,...]

Each configuration (:mod:`optirs_jax.bench.steps`) runs in a process of its own (so its peak
memory is its own), trains ``--steps`` steps from the same initial model on the same
batches (byte-level tokens, :mod:`optirs_jax.bench.corpus`), evaluates the held-out loss
every ``--eval-every`` steps, then measures:

* ``first_call_s``: the first step's wall time (trace, compile, run);
* ``ms``: wall time per step (median of batches of steps on one device batch, as a training
  loop that prefetches its data sees it), and ``tokens_per_s`` from it;
* ``kernel_ms``: the device's busy time per step from the profiler (overlapping events count
  once); ``optimizer_kernel_ms``: the kernel time of the optimizer's update alone on the same
  state (its share of the step); ``None`` on a CPU; ``summed_kernel_ms`` (the events summed,
  overlaps twice) and ``top_kernels`` (the step's longest kernels: where the time goes);
* ``peak_bytes``: the device's ``peak_bytes_in_use`` (``None`` where it keeps no stats).

The processes share XLA's per-fusion autotuning cache, filled by one unrecorded step of the
first configuration: the model's matmul fusions then run with the same choices in every
configuration (each process would choose anew, differently from run to run).

A progress bar runs while it trains; a table and a JSON (``meta`` with the date, device,
versions and command; one result per configuration, keyed by its name) come at the end.

With ``--largest`` it finds instead, per configuration, the largest model of the family
that trains on the device (:mod:`optirs_jax.bench.largest`: a binary search over a ladder
of depths and widths, each attempt a fresh process training two steps of ``--batch``
sequences): its shape, parameters and peak memory.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from optirs_jax.bench import corpus, timing


def _args(argv=None) -> argparse.Namespace:
  from optirs_jax.bench.gpt import GPTConfig
  from optirs_jax.bench.steps import CONFIGS
  p = argparse.ArgumentParser(prog="python -m optirs_jax.bench.train",
                              description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="gpt2", choices=sorted(GPTConfig.PRESETS),
                 help="the model's shape (default gpt2: GPT-2 small, 124M parameters)")
  p.add_argument("--configs", default=",".join(CONFIGS),
                 help=f"comma list of {list(CONFIGS)} (default: all)")
  p.add_argument("--steps", type=int, default=200, help="training steps per configuration")
  p.add_argument("--batch", type=int, default=8, help="sequences per batch")
  p.add_argument("--context", type=int, default=None,
                 help="tokens per sequence (default: the model's context)")
  p.add_argument("--eval-every", type=int, default=50,
                 help="held-out loss every this many steps (and after the last)")
  p.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
  p.add_argument("--warmup", type=int, default=None,
                 help="the schedule's warm-up steps (default: a tenth of --steps)")
  p.add_argument("--timing-steps", type=int, default=10,
                 help="steps per timed batch and per profiler trace")
  p.add_argument("--top-kernels", type=int, default=12,
                 help="the step's longest kernels to record per configuration (the JSON)")
  p.add_argument("--corpus-bytes", type=int, default=None,
                 help="read at most about this many bytes of each split (default: all)")
  p.add_argument("--json", default=None, help="write the results here")
  p.add_argument("--largest", action="store_true",
                 help="find the largest model of the family each configuration trains")
  p.add_argument("--ladder", default=None,
                 help="the sizes --largest searches, LAYERSxWIDTH,... growing (default: "
                      "GPT-2 small, medium, large, XL, then up to 104x6144)")
  p.add_argument("--attempt-timeout", type=float, default=240.0,
                 help="seconds an attempt of --largest may take; past them it counts as not "
                      "fitting (over the device's memory, XLA's allocator retries every 10 s "
                      "instead of failing: a 7.2B-parameter attempt on an H100 ran on for "
                      "minutes)")
  p.add_argument("--memory-fraction", type=float, default=0.95,
                 help="the share of the device's memory an attempt of --largest may take "
                      "(XLA_PYTHON_CLIENT_MEM_FRACTION; JAX's default, 0.75, would leave a "
                      "quarter unused)")
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's configuration
  p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # a child's LAYERSxWIDTH
  args = p.parse_args(argv)
  from optirs_jax.bench.largest import LADDER, parse_ladder
  try:
    args.ladder = (parse_ladder(args.ladder) if args.ladder else LADDER)
  except ValueError as e:
    p.error(f"--ladder: {e}")
  from optirs_jax.bench.steps import check_configs
  try:
    args.configs = check_configs(args.configs.split(","))
  except ValueError as e:
    p.error(str(e))
  if args.top_kernels < 0:
    p.error(f"--top-kernels must be at least 0, got {args.top_kernels}")
  if not 0 < args.memory_fraction <= 1:
    p.error(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
  for name in ("steps", "batch", "eval_every", "eval_batches", "timing_steps"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
  return args


def measure(args) -> dict:
  """Trains and measures one configuration (``args.one``) in this process."""
  import jax
  import jax.numpy as jnp

  from optirs_jax.bench.gpt import GPTConfig
  from optirs_jax.bench.steps import Hyper, Run
  model = GPTConfig.preset(args.model)
  context = args.context or model.context
  if context > model.context:
    raise ValueError(f"--context {context} is longer than the model's {model.context}")
  hyper = Hyper(total=args.steps, warmup=args.warmup if args.warmup is not None
                else max(1, args.steps // 10))
  train, held = corpus.load(args.corpus_bytes)
  batches = corpus.batches(train, args.batch, context, seed=0)
  held_batches = [jnp.asarray(b) for b, _ in zip(corpus.batches(held, args.batch, context,
                                                                 seed=1),
                                                 range(args.eval_batches))]
  run = Run(args.one, model, hyper)
  bar = _bar(args.steps, args.one)
  losses, evals = [], []
  t0 = time.perf_counter()
  first = None
  for i in range(args.steps):
    value = run.step(jnp.asarray(next(batches)))
    if first is None:
      timing.block(value)
      first = time.perf_counter() - t0
    losses.append(value)
    if (i + 1) % args.eval_every == 0 or i + 1 == args.steps:
      held_loss = float(np.mean([float(run.held_out(b)) for b in held_batches]))
      evals.append({"step": i + 1, "seconds": time.perf_counter() - t0, "held_out": held_loss})
      bar.set_postfix_str(f"held-out {held_loss:.3f}")
    bar.update()
  bar.close()
  losses = [float(x) for x in losses]

  batch = jnp.asarray(next(batches))
  def step(_):  # the state after the step: waiting on it waits for the update too
    run.step(batch)
    return run.state

  ms, _, host = timing.time_steps(step, None, warmup=2, batches=3, per_batch=args.timing_steps)
  profile, _ = timing.profile_steps(step, None, args.timing_steps, top=args.top_kernels)
  grads = run.grads(batch)

  def opt(_):
    run.optimizer_only(grads)
    return run.state

  timing.block(opt(None))
  opt_kernel, _ = timing.kernel_seconds_per_step(opt, None, args.timing_steps)
  kernels = run.kernels(batch)
  stats = jax.devices()[0].memory_stats() or {}
  tokens = args.batch * context
  return {"config": args.one, "path": run.path, "parameters": run.parameters,
          "first_call_s": first, "ms": ms * 1e3, "host_ms": host * 1e3,
          "tokens_per_s": tokens / ms,
          "kernel_ms": None if profile["busy_s"] is None else profile["busy_s"] * 1e3,
          "summed_kernel_ms": None if profile["summed_s"] is None else profile["summed_s"] * 1e3,
          "top_kernels": [{"name": n, "ms": sec * 1e3, "calls": c}
                          for n, sec, c in profile["top"]],
          "optimizer_kernel_ms": None if opt_kernel is None else opt_kernel * 1e3,
          "compiled": kernels,
          "peak_bytes": stats.get("peak_bytes_in_use"), "losses": losses, "evals": evals}


def _bar(total: int, what: str):
  try:
    from tqdm import tqdm
  except ImportError:
    return _Quiet()
  return tqdm(total=total, desc=what, file=sys.stderr, unit="step", dynamic_ncols=True,
              leave=False)


class _Quiet:
  def update(self, n=1):
    pass

  def set_postfix_str(self, s):
    pass

  def close(self):
    pass


def _last_error(log: str) -> str:
  """A child's log's last line that names an error, or its last line (XLA's warnings say
  what a compile that runs too long is doing)."""
  lines = [line.strip() for line in log.splitlines() if line.strip()]
  errors = [line for line in lines if "Error" in line or "error:" in line]
  return (errors or lines or [""])[-1][:500]


def _child(args, name: str, argv, extra=(), timeout: float | None = None,
           env_extra: dict | None = None) -> dict:
  """One configuration in a fresh process; its result, or the error it ended with (or
  that it ran past ``timeout`` seconds). The
  processes share XLA's autotuning cache (``args.autotune_cache``): each would otherwise
  choose the model's matmul tilings anew, differently from run to run, and the step times
  would differ by more than the optimizer. A child with a ``timeout`` (an attempt of
  ``--largest``) has its log kept, and its error names the log's last error line."""
  cmd = [sys.executable, "-m", "optirs_jax.bench.train", *argv, "--one", name, *extra]
  env = dict(os.environ)
  if args.autotune_cache:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_per_fusion_autotune_cache_dir="
                        + args.autotune_cache).strip()
  env.update(env_extra or {})
  with tempfile.TemporaryFile("w+") as log:
    try:
      proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if timeout is None else log,
                            text=True, env=env, timeout=timeout)
      why = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
      proc, why = None, f"timed out after {timeout} s"
    log.seek(0)
    said = _last_error(log.read())
  if proc is None:
    return {"config": name, "error": why + (f"; last: {said}" if said else "")}
  lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
  if proc.returncode or not lines:
    return {"config": name, "error": f"{why}: {said or proc.stdout[-2000:]}"}
  return json.loads(lines[-1])


def _meta(argv, args) -> dict:
  import jax
  import optax
  train, held = corpus.load(args.corpus_bytes)
  device = jax.devices()[0]
  return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "device": f"{device.platform}: {device.device_kind}",
          "command": "python -m optirs_jax.bench.train " + " ".join(argv),
          "autotune": "XLA's per-fusion autotuning cache, shared by the configurations "
                      "(filled by a first, unrecorded step)",
          "versions": {"jax": jax.__version__, "optax": optax.__version__,
                       "python": platform.python_version()},
          "corpus": {"train_bytes": len(train), "held_out_bytes": len(held),
                     "train_sha256": corpus.fingerprint(train),
                     "held_out_sha256": corpus.fingerprint(held)}}


def _largest(args, name: str, argv) -> dict:
  """The largest rung of ``args.ladder`` that ``name`` trains, each attempt a process."""
  from optirs_jax.bench.largest import largest_fitting
  attempts = []

  def fits(k: int) -> bool:
    layers, width = args.ladder[k]
    r = _child(args, name, [a for a in argv if a != "--largest"],
               ("--probe", f"{layers}x{width}"), timeout=args.attempt_timeout,
               env_extra={"XLA_PYTHON_CLIENT_MEM_FRACTION": str(args.memory_fraction)})
    attempts.append(r | {"layers": layers, "width": width, "fits": "error" not in r})
    found = ("does not fit" if "error" in r else
             f"fits: {r['parameters']:,} parameters, peak "
             f"{(r['peak_bytes'] or 0) / 2**30:.2f} GiB")  # noted as it goes: a cut run keeps it
    print(f"  {name} {layers}x{width}: {found}", file=sys.stderr, flush=True)
    return "error" not in r

  k, _ = largest_fitting(len(args.ladder), fits)
  best = next((a for a in attempts if a["fits"] and (a["layers"], a["width"]) ==
               args.ladder[k]), None) if k >= 0 else None
  return {"config": name, "largest": best, "attempts": attempts}


def largest_table(results: dict) -> str:
  rows = [f"{'config':<18} {'layers x width':>15} {'parameters':>14} {'peak GiB':>9} "
          f"{'batch x context':>16}"]
  for name, r in results.items():
    b = r["largest"]
    if b is None:
      rows.append(f"{name:<18} {'none fits':>15}")
      continue
    peak = "-" if b["peak_bytes"] is None else f"{b['peak_bytes'] / 2**30:.2f}"
    shape = f"{b.get('batch', '?')}x{b.get('context', '?')}"  # (older results lack them)
    rows.append(f"{name:<18} {str(b['layers']) + 'x' + str(b['width']):>15} "
                f"{b['parameters']:>14,} {peak:>9} {shape:>16}")
  return "\n".join(rows)


def table(results: dict) -> str:
  """The results as a text table, optax's first configuration as the reference."""
  head = (f"{'config':<18} {'first s':>8} {'ms/step':>9} {'busy ms':>10} {'opt ms':>8} "
          f"{'tokens/s':>10} {'peak GiB':>9} {'held-out':>9}  path")
  rows = [head]
  # A missing value is a "-" right-aligned in its column's width.
  fmt = lambda x, f: format("-", f">{f.split('.')[0]}") if x is None else format(x, f)
  for name, r in results.items():
    if "error" in r:
      rows.append(f"{name:<18} failed: {r['error'].splitlines()[-1] if r['error'] else ''}")
      continue
    peak = None if r["peak_bytes"] is None else r["peak_bytes"] / 2**30
    rows.append(f"{name:<18} {r['first_call_s']:>8.1f} {r['ms']:>9.2f} "
                f"{fmt(r['kernel_ms'], '10.2f')} {fmt(r['optimizer_kernel_ms'], '8.3f')} "
                f"{r['tokens_per_s']:>10.0f} {fmt(peak, '9.2f')} "
                f"{r['evals'][-1]['held_out']:>9.4f}  {r['path']}")
  rows.append("# what XLA fuses into or adds around the optimizer inside the step: the "
              "compiled step's fusions + kernels minus the gradients' alone, against the "
              "optimizer's alone")
  for name, r in results.items():
    if "compiled" in r:
      k = r["compiled"]
      rows.append(f"{name:<18} in the step {k['step']['fusions'] - k['gradients']['fusions']:>5} "
                  f"fusions + {k['step']['custom_calls']:>3} kernels; alone "
                  f"{k['optimizer']['fusions']:>5} + {k['optimizer']['custom_calls']:>3}")
  rows += savings(results)
  return "\n".join(rows)


#: A step's saving counts as the optimizer's whole saving within this many milliseconds
#: (the busy time of two processes differs by about that much with the same program).
SAVING_SLACK_MS = 0.02


def savings(results: dict, reference: str = "optax") -> list[str]:
  """Per configuration, the kernel time its optimizer saves alone against ``reference``'s
  and what its whole step saves, and where the step saves less, why: from the compiled
  programs, how many of the reference optimizer's fusions XLA merged into the gradients'
  own (the update reading each gradient where the backward pass makes it, no float32
  gradient written and read back), which a kernel (a custom call) cannot take.

  >>> r = {"optax": {"kernel_ms": 3.53, "optimizer_kernel_ms": 0.40, "compiled": {
  ...          "step": {"fusions": 147, "custom_calls": 24},
  ...          "gradients": {"fusions": 100, "custom_calls": 24},
  ...          "optimizer": {"fusions": 106, "custom_calls": 0}}},
  ...      "fused": {"kernel_ms": 3.50, "optimizer_kernel_ms": 0.30}}
  >>> import textwrap
  >>> print(textwrap.fill(savings(r)[1], 88))
  fused: alone 0.100 ms less than optax's optimizer, in the whole step 0.030 ms: the step
  is 0.070 ms short of it: in the step XLA fuses 59 of optax's 106 optimizer fusions into
  the gradients' producers (no float32 gradient written and read back); a kernel cannot
  take producers
  """
  ref = results.get(reference)
  if not ref or "error" in ref or None in (ref.get("kernel_ms"), ref.get("optimizer_kernel_ms")):
    return []
  rows = [f"# the optimizer's saving against {reference}'s, alone and in the whole step "
          "(kernel ms per step)"]
  for name, r in results.items():
    if name == reference or "error" in r or None in (r.get("kernel_ms"),
                                                       r.get("optimizer_kernel_ms")):
      continue
    alone = ref["optimizer_kernel_ms"] - r["optimizer_kernel_ms"]
    step = ref["kernel_ms"] - r["kernel_ms"]
    row = (f"{name}: alone {abs(alone):.3f} ms {'less' if alone >= 0 else 'more'} than "
           f"{reference}'s optimizer, in the whole step {step:.3f} ms")
    if step >= alone - SAVING_SLACK_MS:
      rows.append(row + ": all of it")
      continue
    row += f": the step is {alone - step:.3f} ms short of it"
    k = ref.get("compiled")
    merged = k and k["optimizer"]["fusions"] - (k["step"]["fusions"] - k["gradients"]["fusions"])
    if merged and merged > 0:
      row += (f": in the step XLA fuses {merged} of {reference}'s "
              f"{k['optimizer']['fusions']} optimizer fusions into the gradients' producers "
              "(no float32 gradient written and read back); a kernel cannot take producers")
    else:
      row += (f": the compiled programs show none of {reference}'s optimizer fused into the "
              "gradients' producers: not explained here (see top_kernels)")
    rows.append(row)
  return rows


def _run_all(args, argv, results: dict) -> None:
  for k, name in enumerate(args.configs):
    print(f"[{k + 1}/{len(args.configs)}] {name}", file=sys.stderr, flush=True)
    results[name] = _largest(args, name, argv) if args.largest else _child(args, name, argv)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = _args(argv)
  if args.one is not None:
    if args.probe is not None:
      from optirs_jax.bench.largest import probe
      print(json.dumps(probe(args)), flush=True)
    else:
      print(json.dumps(measure(args)), flush=True)
    return 0
  results = {}
  with tempfile.TemporaryDirectory() as cache:
    args.autotune_cache = cache
    if not args.largest and len(args.configs) > 1:  # fill the cache: every first call alike
      print(f"[0/{len(args.configs)}] autotuning the model's fusions", file=sys.stderr)
      _child(args, args.configs[0], argv + ["--steps", "1", "--timing-steps", "1"])
    _run_all(args, argv, results)
  report = {"meta": _meta(argv, args), "model": args.model, "results": results}
  print(largest_table(results) if args.largest else table(results))
  for name, r in results.items():  # the step's longest kernels, also where the JSON is lost
    for k in r.get("top_kernels", [])[:6]:
      print(f"  {name:<18} {k['ms']:8.3f} ms {k['calls']:6.1f} calls  {k['name'][:90]}")
  if args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
  sys.exit(main())

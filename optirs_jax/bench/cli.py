"""The benchmark's command line: the jobs, their measurements, the report and its table."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import jax
import optax

import optirs_jax
from optirs_jax import fusion
from optirs_jax.bench import timing
from optirs_jax.bench.cases import (
  JAX_IMPLS,
  OPTIMIZERS,
  TREES,
  jax_step,
  make_grads,
  make_tree,
  param_count,
  tree_shapes,
)
from optirs_jax.pallas.options import LARGE_LEAF_POLICIES, SMALL_LEAF_POLICIES, ExecutorOptions

TORCH_IMPLS = ("torch-fused", "torch-foreach")


def bench_jax(impl, opt, shapes, args):
  tx, step = jax_step(impl, opt, args.executor_options)
  grads = make_grads(shapes, opt)
  params = make_tree(shapes, 0, opt.dtype)
  state = tx.init(params)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                          (params, state, grads))
  jitted = jax.jit(step, donate_argnums=(0, 1))
  (params, state), first_s = timing.first_call(jitted, params, state, grads)
  run = lambda ps: jitted(ps[0], ps[1], grads)
  sec, (params, state), host = timing.time_steps(run, (params, state), warmup=args.warmup,
                                                 batches=args.batches, per_batch=args.steps)
  kernel, (params, state) = timing.kernel_seconds_per_step(run, (params, state), args.steps)
  out = {"ms": sec * 1e3, "host_ms": host * 1e3, "first_call_s": first_s,
         "path": (fusion.explain(tx) if impl == "optirs-apply" else
                  "update + apply_updates"),
         "kernel_ms": None if kernel is None else kernel * 1e3,
         "step_memory_bytes": timing.step_memory(jitted, *abstract)}
  if args.loop_steps:  # K steps inside one jitted call (includes the while loop's overhead)
    k = args.loop_steps
    looped = jax.jit(lambda p, s, g: jax.lax.fori_loop(0, k, lambda i, ps: step(*ps, g), (p, s)),
                     donate_argnums=(0, 1))
    loop_sec, _, _ = timing.time_steps(lambda ps: looped(ps[0], ps[1], grads), (params, state),
                                       warmup=1, batches=args.batches, per_batch=1)
    out["loop_ms"] = loop_sec * 1e3 / k
  return out


def torch_device():
  try:
    import torch
  except ImportError:
    return None
  return "cuda" if torch.cuda.is_available() else None


def bench_torch(mode, opt, shapes, args):
  import torch
  dev = torch_device()
  gen = torch.Generator(device=dev).manual_seed(0)
  params = [torch.randn(s if s else (), device=dev, generator=gen, requires_grad=True)
            for s in shapes.values()]
  for p in params:
    p.grad = torch.randn(p.shape, device=dev, generator=gen)
  o = opt.torch(params, mode)
  sync = lambda _: torch.cuda.synchronize()
  _, first = timing.first_call(lambda: sync(o.step()))
  sec, _, host = timing.time_steps(lambda _: o.step(), None, warmup=args.warmup,
                                   batches=args.batches, per_batch=args.steps, wait=sync)
  return {"ms": sec * 1e3, "host_ms": host * 1e3, "first_call_s": first, "kernel_ms": None,
          "step_memory_bytes": None}


def progress(total: int):
  """A tqdm bar on stderr (a plain counter when tqdm is not installed)."""
  try:
    from tqdm import tqdm
    # leave=False: the finished bar is erased, so the table printed next stands alone.
    return tqdm(total=total, file=sys.stderr, unit="job", dynamic_ncols=True, leave=False)
  except ImportError:
    class Plain:
      done = 0

      def set_postfix_str(self, text):
        sys.stderr.write(f"[{self.done}/{total}] {text}\n")

      def update(self, n=1):
        self.done += n

      def close(self):
        pass
    return Plain()


def jobs_of(args, impls):
  jobs = []
  for tree in args.trees:
    for name in args.optimizers:
      opt = OPTIMIZERS[name]
      for impl in impls:
        if (impl.startswith("torch") and opt.torch is None) or (
            impl.startswith("optax") and opt.optax is None) or (
            impl == "optax-flatten" and tree in ("flat", "leaves-flat")):  # one leaf
          continue
        jobs.append((tree, name, impl))
  return jobs


def run(args) -> dict:
  on_cpu = jax.default_backend() == "cpu"
  scale = args.scale if args.scale is not None else (1 / 64 if on_cpu else 1.0)
  impls = list(JAX_IMPLS) + (list(TORCH_IMPLS) if torch_device() and not args.no_torch else [])
  impls = [i for i in impls if not args.impls or i in args.impls]
  jobs = jobs_of(args, impls)
  bar = progress(len(jobs) + 1)
  bar.set_postfix_str("copy bandwidth")
  copy_n = max(1 << 20, int((1 << 28) * scale))
  copy_bw = timing.copy_bandwidth(copy_n, warmup=args.warmup, batches=args.batches,
                                  steps=args.steps)
  bar.update()
  rows = []
  header = meta(args, scale, copy_bw, copy_n)
  for tree, name, impl in jobs:
    bar.set_postfix_str(f"{tree} {name} {impl}")
    shapes = tree_shapes(tree, scale)
    opt = OPTIMIZERS[name]
    try:
      r = (bench_torch(impl.split("-")[1], opt, shapes, args) if impl.startswith("torch")
           else bench_jax(impl, opt, shapes, args))
    except Exception as e:  # a failing implementation is reported, not fatal
      r = {"ms": None, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    n = param_count(shapes)
    r |= {"tree": tree, "optimizer": name, "impl": impl, "params": n, "leaves": len(shapes),
          "bytes_per_param": opt.bytes_per_param}
    minimal = opt.bytes_per_param * n
    for key in ("ms", "kernel_ms", "loop_ms"):
      if r.get(key):
        r[key.replace("ms", "pct_copy")] = 100 * minimal / (r[key] * 1e-3) / copy_bw
    rows.append(r)
    bar.update()
    if args.json:  # keep what is measured so far, in case the run is cut short
      _write(args.json, {"meta": header, "results": rows})
  bar.close()
  sys.stderr.flush()  # the bar's last output before the table on stdout
  for r in rows:
    base = next((b for b in rows if (b["tree"], b["optimizer"], b["impl"]) == (
        r["tree"], r["optimizer"], "optax")), None)
    for key in ("ms", "kernel_ms", "loop_ms"):
      if base and r.get(key) and base.get(key):
        r[key.replace("ms", "x_optax")] = base[key] / r[key]
  return {"meta": header, "results": rows}


def _write(path: str, report: dict) -> None:
  with open(path, "w") as f:
    json.dump(report, f, indent=1)


def meta(args, scale, copy_bw, copy_n) -> dict:
  dev = jax.devices()[0]
  versions = {"jax": jax.__version__, "jaxlib": jax.lib.__version__, "optax": optax.__version__,
              "optirs_jax": optirs_jax.__version__, "python": platform.python_version()}
  try:
    import torch
    versions["torch"] = torch.__version__
  except ImportError:
    pass
  return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
          "device": f"{dev.platform}: {dev.device_kind}", "versions": versions,
          "command": " ".join(["python -m optirs_jax.bench"] + sys.argv[1:]),
          "scale": scale, "copy_gbps": copy_bw / 1e9, "copy_elements": copy_n,
          "small_leaf_policy": args.executor_options.small_leaf_policy,
          "large_leaf_policy": args.executor_options.large_leaf_policy,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "timing": f"kernel: profiler trace of {args.steps} steps; per call: median of "
                    f"{args.batches} batches x {args.steps} steps, {args.warmup} warm-up"}


def table(report: dict) -> str:
  m = report["meta"]
  lines = [f"# {m['date']}  {m['device']}  jax {m['versions']['jax']}"
           + (f"  torch {m['versions']['torch']}" if "torch" in m["versions"] else ""),
           f"# copy bandwidth {m['copy_gbps']:.0f} GB/s (read + write); scale {m['scale']:g}",
           "# kernel: device time per step (profiler); call: wall time per step; x optax: "
           "optax's time over this one's (the same tree and optimizer)",
           f"{'tree':<12}{'optimizer':<19}{'impl':<15}{'kernel ms':>10}{'%copy':>7}"
           f"{'kernel x optax':>16}{'call ms':>9}{'host ms':>9}{'call x optax':>14}"
           f"{'first s':>9}"]
  cell = lambda v, width, spec: (format(v, spec) if isinstance(v, (int, float)) else "-").rjust(
      width)
  for r in report["results"]:
    head = f"{r['tree']:<12}{r['optimizer']:<19}{r['impl']:<15}"
    if not r.get("ms"):
      lines.append(head + f"  {r.get('error')}")
      continue
    lines.append(head + cell(r.get("kernel_ms"), 10, ".3f") + cell(r.get("kernel_pct_copy"), 7,
                                                                     ".1f")
                 + cell(r.get("kernel_x_optax"), 16, ".2f") + cell(r["ms"], 9, ".3f")
                 + cell(r.get("host_ms"), 9, ".3f") + cell(r.get("x_optax"), 14, ".2f")
                 + cell(r.get("first_call_s"), 9, ".2f"))
  paths = sorted({(r["optimizer"], r["path"]) for r in report["results"]
                  if r.get("path") and r["impl"] == "optirs-apply"})
  lines += [f"# optirs-apply on {name}: {path}" for name, path in paths]
  return "\n".join(lines)


def _positive(kind):
  def parse(text):
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
    if value <= 0:
      raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value
  return parse


def _names(valid, what):
  def parse(text):
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in valid]
    if bad or not names:
      raise argparse.ArgumentTypeError(f"unknown {what} {bad or text!r}; valid {what}s are "
                                       f"{sorted(valid)}")
    return names
  return parse


def parser() -> argparse.ArgumentParser:
  from optirs_jax import bench
  p = argparse.ArgumentParser(prog="python -m optirs_jax.bench", description=bench.__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--trees", type=_names(TREES, "tree"), default=["gpt2", "leaves", "flat"],
                 help=f"comma list of {sorted(TREES)} (default: gpt2,leaves,flat): GPT-2 "
                      "small's 148 leaves, 2000 leaves of 16K, one leaf of 268M (scaled)")
  p.add_argument("--optimizers", type=_names(OPTIMIZERS, "optimizer"), default=None,
                 help=f"comma list of {sorted(OPTIMIZERS)} (default: all on GPU/TPU, "
                      "adam,lamb,sgd on CPU)")
  p.add_argument("--impls", type=_names(JAX_IMPLS + TORCH_IMPLS, "impl"), default=None,
                 help=f"only these of {list(JAX_IMPLS + TORCH_IMPLS)}")
  p.add_argument("--scale", type=_positive(float), default=None,
                 help="tree size factor (default 1 on accelerators, 1/64 on CPU)")
  p.add_argument("--steps", type=_positive(int), default=10,
                 help="steps per timed batch and per profiled window")
  p.add_argument("--batches", type=_positive(int), default=5,
                 help="timed batches per job; the wall time is their median (default 5)")
  p.add_argument("--warmup", type=_positive(int), default=3,
                 help="untimed steps before timing, after the first call (default 3)")
  p.add_argument("--no-torch", action="store_true",
                 help="skip torch's fused and foreach optimizers (run where torch has a GPU)")
  p.add_argument("--loop-steps", type=_positive(int), default=None,
                 help="also time K steps inside one jitted call (lax.fori_loop)")
  p.add_argument("--json", default=None, help="write the report here")
  defaults = ExecutorOptions()
  p.add_argument("--small-leaves", choices=SMALL_LEAF_POLICIES,
                 default=defaults.small_leaf_policy,
                 help="the kernels' small-leaf policy (see optirs_jax.ExecutorOptions)")
  p.add_argument("--large-leaves", choices=LARGE_LEAF_POLICIES,
                 default=defaults.large_leaf_policy,
                 help="the kernels' large-leaf policy (see optirs_jax.ExecutorOptions)")
  return p


def main(argv=None) -> int:
  args = parser().parse_args(argv)
  args.executor_options = ExecutorOptions(small_leaf_policy=args.small_leaves,
                                          large_leaf_policy=args.large_leaves)
  if args.optimizers is None:
    args.optimizers = ["adam", "lamb", "sgd"] if jax.default_backend() == "cpu" else list(
        OPTIMIZERS)
  report = run(args)
  print(table(report), flush=True)
  if args.json:
    _write(args.json, report)
    print(f"wrote {args.json}", flush=True)
  return 0

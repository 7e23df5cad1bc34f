"""Benchmark: optirs_jax against optax (and torch's fused optimizers) on the local device.

    python -m optirs_jax.bench [--trees gpt2,leaves,flat] [--optimizers adam,lamb,...]
                               [--scale S] [--json out.json]

Times one jitted step (params and state donated) of each implementation on three trees --
GPT-2 small (148 leaves, 124M), many small leaves (2000 x 16K) and one flat leaf (268M) --
(and ``leaves-flat``: the 2000 leaves' parameters as one buffer, what an opt-in flat
parameter layout gives the optimizer) and, in the same run, the device's copy bandwidth.
Effective bandwidth is the algorithm's minimal bytes (Adam 28 B/param: read p, g, m, v;
write p, m, v) over the measured time.
On CPU the trees are scaled down (``--scale``) so the run takes a minute or two.

Implementations: ``optirs-apply`` (the fused apply path, :func:`optirs_jax.apply`),
``optirs-update`` (the optax contract: ``update`` then ``optax.apply_updates``), ``optax``
(the same pair with optax's optimizer), ``optax-flatten`` (optax wrapped in
``optax.flatten``), and ``torch-fused`` / ``torch-foreach`` when torch can run here.
Timing: a first call (compile time), warm-up, then batches of consecutive steps; the
median batch per step is reported, with the host's share (the time to enqueue the calls,
which bounds a step on trees of many leaves on an H200). With
``--loop-steps K`` each step is also timed K at a time inside one jitted call, which is what
the optimizer costs the device inside a training step jitted as a whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optirs_jax
from optirs_jax.pallas.options import LARGE_LEAF_POLICIES, SMALL_LEAF_POLICIES, ExecutorOptions

# ---------------------------------------------------------------------------------- trees


def gpt2_small_shapes(d: int = 768, vocab: int = 50257, ctx: int = 1024, layers: int = 12):
  """The 148 parameter shapes of GPT-2 small (124M parameters at d=768)."""
  shapes = {"wte": (vocab, d), "wpe": (ctx, d)}
  for i in range(layers):
    p = f"h{i}."
    shapes |= {p + "ln_1.g": (d,), p + "ln_1.b": (d,), p + "attn.w": (d, 3 * d),
               p + "attn.b": (3 * d,), p + "proj.w": (d, d), p + "proj.b": (d,),
               p + "ln_2.g": (d,), p + "ln_2.b": (d,), p + "fc.w": (d, 4 * d),
               p + "fc.b": (4 * d,), p + "mlp_proj.w": (4 * d, d), p + "mlp_proj.b": (d,)}
  return shapes | {"ln_f.g": (d,), "ln_f.b": (d,)}


TREES = ("gpt2", "leaves", "flat", "leaves-flat")


def tree_shapes(name: str, scale: float) -> dict[str, tuple[int, ...]]:
  """Shapes of a benchmark tree; ``scale`` < 1 shrinks it (sizes, and the leaf count)."""
  if name == "gpt2":
    d = max(128, int(768 * scale**0.5) // 128 * 128) if scale < 1 else 768
    return gpt2_small_shapes(d=d)
  if name == "leaves":
    n, size = (2000, 16384) if scale >= 1 else (max(50, int(2000 * scale**0.5)), 16384)
    return {f"l{i:04d}": (size,) for i in range(n)}
  if name == "flat":
    return {"flat": (max(1 << 16, int((1 << 28) * scale)),)}
  if name == "leaves-flat":  # the leaves tree's parameters in one buffer (opt-in flat layout)
    return {"flat": (sum(s[0] for s in tree_shapes("leaves", scale).values()),)}
  raise ValueError(f"unknown tree {name!r}; valid trees are {TREES}")


def make_tree(shapes, seed: int):
  key = jax.random.PRNGKey(seed)
  out = {}
  for i, (name, shape) in enumerate(shapes.items()):
    out[name] = jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32)
  return out


# ---------------------------------------------------------------------------------- optimizers


@dataclasses.dataclass(frozen=True)
class Opt:
  bytes_per_param: int  # minimal fp32 traffic of one fused update + apply
  optirs: Callable
  optax: Callable
  torch: Callable | None = None  # (params, fused) -> torch optimizer


def _torch(cls_name, **kw):
  def make(params, mode):
    import torch
    cls = getattr(torch.optim, cls_name)
    return cls(params, **kw, **({"fused": True} if mode == "fused" else {"foreach": True}))
  return make


OPTIMIZERS = {
    "adam": Opt(28, lambda **o: optirs_jax.adam(1e-3, **o), lambda: optax.adam(1e-3),
                _torch("Adam", lr=1e-3)),
    "adamw": Opt(28, lambda **o: optirs_jax.adamw(1e-3, weight_decay=1e-2, **o),
                 lambda: optax.adamw(1e-3, weight_decay=1e-2),
                 _torch("AdamW", lr=1e-3, weight_decay=1e-2)),
    "lamb": Opt(40, lambda **o: optirs_jax.lamb(1e-3, **o), lambda: optax.lamb(1e-3)),
    "lion": Opt(20, lambda **o: optirs_jax.lion(1e-4, **o), lambda: optax.lion(1e-4)),
    "sgd": Opt(20, lambda **o: optirs_jax.sgd(1e-3, momentum=0.9, **o),
               lambda: optax.sgd(1e-3, momentum=0.9), _torch("SGD", lr=1e-3, momentum=0.9)),
    "rmsprop": Opt(20, lambda **o: optirs_jax.rmsprop(1e-3, **o), lambda: optax.rmsprop(1e-3),
                   _torch("RMSprop", lr=1e-3, alpha=0.9)),
    "rmsprop_centered": Opt(28, lambda **o: optirs_jax.rmsprop(1e-3, centered=True, **o),
                            lambda: optax.rmsprop(1e-3, centered=True),
                            _torch("RMSprop", lr=1e-3, alpha=0.9, centered=True)),
    "adagrad": Opt(20, lambda **o: optirs_jax.adagrad(1e-3, **o), lambda: optax.adagrad(1e-3),
                   _torch("Adagrad", lr=1e-3)),
}

JAX_IMPLS = ("optirs-apply", "optirs-update", "optax", "optax-flatten")


def jax_step(impl: str, opt: Opt, options: ExecutorOptions | None = None):
  """(transformation, step(params, state, grads) -> (params, state)) for one implementation
  (``options``: the optirs_jax executor options).

  The donated arguments come in the order of the outputs: JAX pairs each donated buffer
  with the first unclaimed output of its shape and dtype, so ``step(g, s, p) -> (p, s)``
  would pair the first moment with the new params and make XLA copy every state buffer.
  """
  if impl == "optirs-apply":
    tx = opt.optirs(executor_options=options)
    return tx, lambda p, s, g: optirs_jax.apply(tx, g, s, p)
  tx = {"optirs-update": lambda: opt.optirs(executor_options=options), "optax": opt.optax,
        "optax-flatten": lambda: optax.flatten(opt.optax())}[impl]()

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return tx, step


# ---------------------------------------------------------------------------------- timing


def _block(tree):
  for x in jax.tree.leaves(tree):
    x.block_until_ready()


def time_steps(run_step, state, *, warmup: int, batches: int, per_batch: int, block):
  """Median seconds per step over ``batches`` batches of ``per_batch`` consecutive steps,
  and the median seconds per step the host took to enqueue them (before the wait)."""
  for _ in range(warmup):
    state = run_step(state)
  block(state)
  times, host = [], []
  for _ in range(batches):
    t0 = time.perf_counter()
    for _ in range(per_batch):
      state = run_step(state)
    host.append((time.perf_counter() - t0) / per_batch)
    block(state)
    times.append((time.perf_counter() - t0) / per_batch)
  return statistics.median(times), state, statistics.median(host)


def _compile(fn, *args):
  """(compiled fn donating its first two arguments, seconds to compile, step memory)."""
  t0 = time.perf_counter()
  compiled = jax.jit(fn, donate_argnums=(0, 1)).lower(*args).compile()
  seconds = time.perf_counter() - t0
  analysis = compiled.memory_analysis()
  mem = None
  if analysis is not None:
    mem = int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
              - analysis.alias_size_in_bytes + analysis.temp_size_in_bytes)
  return compiled, seconds, mem


def bench_jax(impl, opt, shapes, args):
  tx, step = jax_step(impl, opt, args.executor_options)
  grads = make_tree(shapes, 1)
  params = make_tree(shapes, 0)
  state = tx.init(params)
  t0 = time.perf_counter()
  compiled, _, mem = _compile(step, params, state, grads)
  params, state = compiled(params, state, grads)
  _block(params)
  compile_s = time.perf_counter() - t0
  timing = dict(warmup=args.warmup, batches=args.batches, block=_block)
  sec, (params, state), host = time_steps(lambda ps: compiled(ps[0], ps[1], grads),
                                          (params, state), per_batch=args.steps, **timing)
  out = {"ms": sec * 1e3, "host_ms": host * 1e3, "compile_s": compile_s,
         "step_memory_bytes": mem}
  if args.loop_steps:
    # K steps inside one jitted call: what the step costs the device once the host's
    # per-call work is paid once per K steps, as in a training step that jits the forward
    # pass, backward pass and optimizer together.
    k = args.loop_steps
    many = lambda p, s, g: jax.lax.fori_loop(0, k, lambda i, ps: step(*ps, g), (p, s))
    looped, _, _ = _compile(many, params, state, grads)
    loop_sec, _, _ = time_steps(lambda ps: looped(ps[0], ps[1], grads), (params, state),
                                per_batch=1, **timing)
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
  t0 = time.perf_counter()
  o.step()
  torch.cuda.synchronize()
  first = time.perf_counter() - t0
  sec, _, host = time_steps(lambda _: o.step(), None, warmup=args.warmup, batches=args.batches,
                            per_batch=args.steps, block=lambda _: torch.cuda.synchronize())
  return {"ms": sec * 1e3, "host_ms": host * 1e3, "compile_s": first, "step_memory_bytes": None}


def copy_bandwidth(n: int, args) -> float:
  """Bytes read plus written per second by an elementwise copy of ``n`` float32."""
  x = jnp.arange(n, dtype=jnp.float32)
  f = jax.jit(lambda x: -x, donate_argnums=0)  # in place, like the donated optimizer steps
  sec, _, _ = time_steps(f, x, warmup=args.warmup, batches=args.batches, per_batch=args.steps,
                         block=lambda y: y.block_until_ready())
  return 2 * 4 * n / sec


# ---------------------------------------------------------------------------------- driver


class Progress:
  def __init__(self, total: int, stream=sys.stderr):
    self.total, self.done, self.stream, self.t0 = total, 0, stream, time.perf_counter()

  def step(self, label: str):
    self.done += 1
    width = 30
    filled = int(width * self.done / self.total)
    elapsed = time.perf_counter() - self.t0
    end = "\n" if not self.stream.isatty() else ""
    self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                      f"{elapsed:6.1f}s {label:<48}{end}")
    self.stream.flush()
    if self.done == self.total:
      self.stream.write("\n")


def run(args) -> dict:
  on_cpu = jax.default_backend() == "cpu"
  scale = args.scale if args.scale is not None else (1 / 64 if on_cpu else 1.0)
  impls = list(JAX_IMPLS)
  if torch_device() and not args.no_torch:
    impls += ["torch-fused", "torch-foreach"]
  if args.impls:
    impls = [i for i in impls if i in args.impls]
  jobs = []
  for tree in args.trees:
    for name in args.optimizers:
      for impl in impls:
        if impl.startswith("torch") and OPTIMIZERS[name].torch is None:
          continue
        if impl == "optax-flatten" and tree in ("flat", "leaves-flat"):
          continue  # one leaf: flatten is optax itself
        jobs.append((tree, name, impl))
  progress = Progress(len(jobs) + 1)
  copy_n = max(1 << 20, int((1 << 28) * scale))
  copy_bw = copy_bandwidth(copy_n, args)
  progress.step("copy bandwidth")
  rows = []
  header = meta(args, scale, copy_bw, copy_n)
  for tree, name, impl in jobs:
    shapes = tree_shapes(tree, scale)
    n = sum(int(np.prod(s)) for s in shapes.values())
    opt = OPTIMIZERS[name]
    try:
      if impl.startswith("torch"):
        r = bench_torch(impl.split("-")[1], opt, shapes, args)
      else:
        r = bench_jax(impl, opt, shapes, args)
    except Exception as e:  # a failing implementation is reported, not fatal
      r = {"ms": None, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    r |= {"tree": tree, "optimizer": name, "impl": impl, "params": n, "leaves": len(shapes),
          "bytes_per_param": opt.bytes_per_param}
    if r.get("ms"):
      r["gbps"] = opt.bytes_per_param * n / (r["ms"] * 1e-3) / 1e9
      r["pct_copy"] = 100 * r["gbps"] * 1e9 / copy_bw
    if r.get("loop_ms"):
      r["loop_pct_copy"] = 100 * opt.bytes_per_param * n / (r["loop_ms"] * 1e-3) / copy_bw
    rows.append(r)
    progress.step(f"{tree} {name} {impl}")
    if args.json:  # keep what is measured so far, in case the run is cut short
      _write(args.json, {"meta": header, "results": rows})
  for r in rows:
    base = next((b for b in rows if b["tree"] == r["tree"] and b["optimizer"] == r["optimizer"]
                 and b["impl"] == "optax" and b.get("ms")), None)
    if base and r.get("ms"):
      r["speedup_vs_optax"] = base["ms"] / r["ms"]
    if base and r.get("loop_ms") and base.get("loop_ms"):
      r["loop_speedup_vs_optax"] = base["loop_ms"] / r["loop_ms"]
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
  return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "device": f"{dev.platform}: {dev.device_kind}", "versions": versions,
          "command": " ".join(["python -m optirs_jax.bench"] + sys.argv[1:]),
          "scale": scale, "copy_gbps": copy_bw / 1e9, "copy_elements": copy_n,
          "small_leaf_policy": args.executor_options.small_leaf_policy,
          "large_leaf_policy": args.executor_options.large_leaf_policy,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "timing": f"median of {args.batches} batches x {args.steps} steps, "
                    f"{args.warmup} warm-up"}


def table(report: dict) -> str:
  m = report["meta"]
  loop = any(r.get("loop_ms") for r in report["results"])
  lines = [f"# {m['date']}  {m['device']}  jax {m['versions']['jax']}"
           + (f"  torch {m['versions']['torch']}" if "torch" in m["versions"] else ""),
           f"# copy bandwidth {m['copy_gbps']:.0f} GB/s (read + write); scale {m['scale']:g}",
           f"{'tree':<12}{'optimizer':<17}{'impl':<15}{'ms':>9}{'GB/s':>8}{'%copy':>7}"
           f"{'x optax':>9}{'host ms':>9}{'compile s':>10}"
           + (f"{'loop ms':>9}{'%copy':>7}{'x optax':>9}" if loop else "")]
  for r in report["results"]:
    if not r.get("ms"):
      lines.append(f"{r['tree']:<12}{r['optimizer']:<17}{r['impl']:<15}  {r.get('error')}")
      continue
    line = (f"{r['tree']:<12}{r['optimizer']:<17}{r['impl']:<15}{r['ms']:9.3f}"
            f"{r['gbps']:8.0f}{r['pct_copy']:6.1f}%{r.get('speedup_vs_optax', 0):9.2f}"
            f"{r.get('host_ms', 0):9.3f}{r['compile_s']:10.2f}")
    if r.get("loop_ms"):
      line += (f"{r['loop_ms']:9.3f}{r['loop_pct_copy']:6.1f}%"
               f"{r.get('loop_speedup_vs_optax', 0):9.2f}")
    lines.append(line)
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m optirs_jax.bench", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  split = lambda s: [x for x in s.split(",") if x]
  parser.add_argument("--trees", type=split, default=["gpt2", "leaves", "flat"])
  parser.add_argument("--optimizers", type=split, default=None,
                      help=f"comma list of {sorted(OPTIMIZERS)} (default: all on GPU/TPU, "
                           "adam,lamb,sgd on CPU)")
  parser.add_argument("--scale", type=float, default=None,
                      help="tree size factor (default 1 on accelerators, 1/64 on CPU)")
  parser.add_argument("--steps", type=int, default=10, help="steps per timed batch")
  parser.add_argument("--batches", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument("--impls", type=split, default=None,
                      help=f"only these of {list(JAX_IMPLS) + ['torch-fused', 'torch-foreach']}")
  parser.add_argument("--loop-steps", type=int, default=0,
                      help="also time K steps inside one jitted call (lax.fori_loop), which "
                           "takes the host's per-call cost out (column 'loop ms')")
  parser.add_argument("--json", default=None, help="write the report here")
  defaults = ExecutorOptions()
  parser.add_argument("--small-leaves", choices=SMALL_LEAF_POLICIES,
                      default=defaults.small_leaf_policy,
                      help="what the kernel backend does with leaves too small to run in "
                           f"place (default: {defaults.small_leaf_policy!r}); see "
                           "benchmarks/policy_variants.sh")
  parser.add_argument("--large-leaves", choices=LARGE_LEAF_POLICIES,
                      default=defaults.large_leaf_policy,
                      help="what the kernel backend does with leaves large enough to run in "
                           f"place (default: {defaults.large_leaf_policy!r}); 'group' takes "
                           "effect with --small-leaves group")
  args = parser.parse_args(argv)
  args.executor_options = ExecutorOptions(small_leaf_policy=args.small_leaves,
                                          large_leaf_policy=args.large_leaves)
  if args.optimizers is None:
    args.optimizers = ["adam", "lamb", "sgd"] if jax.default_backend() == "cpu" else list(
        OPTIMIZERS)
  for name in args.optimizers:
    if name not in OPTIMIZERS:
      parser.error(f"unknown optimizer {name!r}; valid optimizers are {sorted(OPTIMIZERS)}")
  for tree in args.trees:
    tree_shapes(tree, 1.0)  # validates the name
  report = run(args)
  print(table(report))
  if args.json:
    _write(args.json, report)
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

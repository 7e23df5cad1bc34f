"""Muon on GPT-2 small's params: optax.contrib.muon against optirs_jax.muon (the momentum's
precision, and bfloat16 Newton–Schulz), with optax.adamw for scale, side by side on the
local GPU; and the GPU's matrix-product peak in the same run. ``muon-bf16-stepwise`` and
``muon-bf16-expanded`` are ``muon-bf16`` with its earlier forms (the long embedding's chain
step by step instead of the Gram form; and the factor expanded instead of the square
form), for an A/B in one process.

    PYTHONPATH=. python3 benchmarks/muon_step.py [--json out.json] [--hlo DIR] [--steps N]

Per configuration: one jitted step (update + apply_updates, params and state donated) on
fixed gradients; first call (trace, compile, run), kernel time per step from the profiler
(summed and busy), kernels per step (the top 60 by time in the JSON, by the names of the
compiled HLO's fusions, which ``--hlo`` saves per configuration; each kernel's name followed
by the HLO op that launched it, with ``XLA_FLAGS=--xla_gpu_enable_command_buffer=``: by
default the step runs as CUDA graphs and the op is the graph's), the kernel time of the
matrix products (cuBLAS's and XLA's GEMM kernels) against the rest, and the Newton–Schulz
products' achieved TFLOP/s (their
operations, ``optirs_jax.orthogonal.flops``, over the step's busy kernel time: the
operations of optax's chain, so a rate at optax's work, below the products' own where the
step's elementwise work counts against it, above it where the Gram form does fewer
operations: bfloat16's embedding). The peak: a square product of
8192 in TF32 and in bfloat16 (``optirs_jax.planning.tensor_cores.gemm``), timed the same way.
"""

import argparse
import contextlib
import datetime
import json
import os
import re
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import optax
from optax import contrib

import optirs_jax
from optirs_jax.bench import timing
from optirs_jax.bench.cases import gpt2_small_shapes, make_tree
from optirs_jax.orthogonal import _gram_form, _muon, flops
from optirs_jax.planning.tensor_cores import gemm

CONFIGS = {
    "optax-muon": lambda: contrib.muon(0.02),  # optax.contrib.muon
    "muon": lambda: optirs_jax.muon(0.02),  # optirs_jax.muon, the momentum's precision
    "muon-bf16": lambda: optirs_jax.muon(0.02, ns_dtype=jnp.bfloat16),
    # bfloat16 without the Gram form (the embedding's chain step by step), and without the
    # square form too (the factor expanded): the earlier forms, for an A/B in one process
    "muon-bf16-stepwise": lambda: optirs_jax.muon(0.02, ns_dtype=jnp.bfloat16),
    "muon-bf16-expanded": lambda: optirs_jax.muon(0.02, ns_dtype=jnp.bfloat16),
    "optax-adamw": lambda: optax.adamw(1e-3),
}
#: What each variant sets while it is built and traced: (module, name) -> value.
VARIANTS = {
    "muon-bf16-stepwise": {(_gram_form, "RATIO"): sys.maxsize},
    "muon-bf16-expanded": {(_gram_form, "RATIO"): sys.maxsize,
                           (_muon, "_nonzero_c2"): lambda ns_coeffs: False},
}


def measure(tx, params, grads, steps, hlo=None):
  def step(state):
    p, s = state
    u, s = tx.update(grads, s, p)
    return optax.apply_updates(p, u), s

  jitted = jax.jit(step, donate_argnums=0)
  params = jax.tree.map(jnp.copy, params)  # each configuration donates its own
  state, first = timing.first_call(jitted, (params, tx.init(params)))
  if hlo is not None:  # the compiled program whose fusions the profile names
    with open(hlo, "w") as f:
      f.write(jitted.lower(state).compile().as_text())
  for _ in range(3):
    state = jitted(state)
  prof, state = timing.profile_steps(jitted, state, steps, top=100_000, by_op=True)
  return first, prof


#: Kernels that are matrix products: cuBLAS's (nvjet, xmma, cutlass) and XLA's Triton GEMMs.
PRODUCTS = re.compile(r"nvjet|xmma|cutlass|gemm")


def products_seconds(top) -> float:
  """Kernel seconds per step of the matrix products among ``top`` (name, s, calls)."""
  return sum(sec for name, sec, _ in top if PRODUCTS.search(name.split(" @ ")[0]))


def peak(n: int, steps: int) -> dict:
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n))
  out = {}
  for precision in ("tf32", "bf16"):
    f = jax.jit(lambda x, p=precision: (gemm(x, a, p) * (1.0 / n)).astype(jnp.float32))
    timing.block(f(f(a)))  # compiled and autotuned before the trace (its trials run on the GPU)
    prof, _ = timing.profile_steps(f, a, steps)
    if prof["busy_s"]:
      out[precision] = 2 * n**3 / prof["busy_s"] / 1e12
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--steps", type=int, default=10, help="steps per profiler trace")
  p.add_argument("--scale", type=int, default=768, help="GPT-2's width (768: small)")
  p.add_argument("--layers", type=int, default=12)
  p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
  p.add_argument("--json", default=None)
  p.add_argument("--hlo", default=None, help="a folder: each configuration's compiled HLO")
  args = p.parse_args(argv)
  shapes = gpt2_small_shapes(d=args.scale, layers=args.layers)
  params, grads = make_tree(shapes, 0), make_tree(shapes, 1)
  ns_flops = sum(flops(s, 5) for s in shapes.values() if len(s) == 2)
  dev = jax.devices()[0]
  print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%dT%H:%M:%S}Z {dev.device_kind}, jax "
        f"{jax.__version__}, optax {optax.__version__}; GPT-2 width {args.scale}, "
        f"{args.layers} layers, {len(shapes)} leaves; Newton-Schulz {ns_flops / 1e12:.3f} "
        "TFLOP a step (5 steps)", flush=True)
  peaks = peak(8192 if dev.platform == "gpu" else 256, args.steps)
  print("# matmul peak (8192^3): " + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in peaks.items()),
        flush=True)
  rows = []
  print(f"{'config':<20}{'first s':>9}{'busy ms':>10}{'summed ms':>11}{'products':>10}"
        f"{'kernels':>9}{'x optax':>9}{'NS TFLOP/s':>12}", flush=True)
  base = None
  for name in args.configs.split(","):
    if name not in CONFIGS:
      sys.exit(f"unknown config {name!r}; valid: {list(CONFIGS)}")
    hlo = None
    if args.hlo:
      os.makedirs(args.hlo, exist_ok=True)
      hlo = os.path.join(args.hlo, f"{name}.hlo.txt")
    with contextlib.ExitStack() as patches:
      for (module, attr), value in VARIANTS.get(name, {}).items():
        patches.enter_context(mock.patch.object(module, attr, value))
      first, prof = measure(CONFIGS[name](), params, grads, args.steps, hlo)
    busy = prof["busy_s"]
    base = busy if name == "optax-muon" else base
    tflops = ns_flops / busy / 1e12 if busy and "muon" in name else None
    row = dict(config=name, first_s=first, busy_ms=busy and busy * 1e3,
               summed_ms=prof["summed_s"] and prof["summed_s"] * 1e3,
               products_ms=products_seconds(prof["top"]) * 1e3 if prof["top"] else None,
               x_optax=(base / busy) if base and busy else None, ns_tflops=tflops,
               kernels=sum(c for _, _, c in prof["top"]) or None, top=prof["top"][:60])
    rows.append(row)
    fmt = lambda v, f: format(v, f) if v is not None else format("-", ">" + f.split(".")[0])
    print(f"{name:<20}{first:9.2f}{fmt(row['busy_ms'], '10.3f')}{fmt(row['summed_ms'], '11.3f')}"
          f"{fmt(row['products_ms'], '10.3f')}{fmt(row['kernels'], '9.0f')}"
          f"{fmt(row['x_optax'], '9.2f')}{fmt(tflops, '12.1f')}", flush=True)
    if args.json:  # after each row: a run cut short keeps what it measured
      with open(args.json, "w") as f:
        json.dump(dict(device=dev.device_kind, jax=jax.__version__, optax=optax.__version__,
                       width=args.scale, layers=args.layers, ns_tflop=ns_flops / 1e12,
                       peak_tflops=peaks, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()

"""8-bit Adam against bitsandbytes' ``Adam8bit`` on GPT-2 small's parameter tree, one GPU.

    PYTHONPATH=. python3 benchmarks/bnb_adam8bit.py [steps] [--json PATH]

Kernel time per step from the profilers (JAX: the device plane of a ``jax.profiler`` trace;
torch: the CUDA time of ``torch.profiler``'s kernels) of ``optirs_jax.adam8bit`` (the
"dynamic8" and "fp8" state formats) through the fused apply, float32 ``optirs_jax.adam``
and ``optax.adam``, ``bitsandbytes.optim.Adam8bit`` and torch's fused float32 Adam. Then
the numbers: 10 steps of each 8-bit Adam and of float32 Adam from the same params on the
same gradients (drawn by ``jax.random`` and handed to torch through DLPack), and the
distance between their updates, ``|p_a - p_b| / |p_f32 - p_0|`` over the whole tree.

bitsandbytes' defaults are the same format as ``adam8bit``'s "dynamic8" (blocks of 256, the
signed dynamic map for the first moment and the unsigned one for the second, leaves under
4096 elements in float32), so the two should differ by rounding, not by design.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optirs_jax
from optirs_jax.bench import timing
from optirs_jax.bench.cases import gpt2_small_shapes

LR = 1e-3


def _grads(shapes, step: int):
  key = jax.random.fold_in(jax.random.PRNGKey(1), step)
  return {n: 1e-2 * jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32)
          for i, (n, s) in enumerate(shapes.items())}


def _params(shapes):
  key = jax.random.PRNGKey(0)
  return {n: 0.02 * jax.random.normal(jax.random.fold_in(key, i), s, jnp.float32)
          for i, (n, s) in enumerate(shapes.items())}


def _jax_step(tx, fused: bool):
  if fused:
    return jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p), donate_argnums=(0, 1))

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return jax.jit(step, donate_argnums=(0, 1))


def jax_kernel_ms(tx, shapes, steps, fused=True):
  params = _params(shapes)
  grads = _grads(shapes, 0)
  fn = _jax_step(tx, fused)
  state = (params, tx.init(params))
  run = lambda st: fn(st[0], st[1], grads)
  for _ in range(3):
    state = run(state)
  prof, state = timing.profile_steps(run, state, steps)
  return (prof["summed_s"] or float("nan")) * 1e3


def jax_run(tx, shapes, n_steps, fused=True):
  fn = _jax_step(tx, fused)
  p = _params(shapes)
  s = tx.init(p)
  for k in range(n_steps):
    p, s = fn(p, s, _grads(shapes, k))
  return {n: np.asarray(x) for n, x in p.items()}


def _torch_params(shapes):
  import torch
  return [torch.nn.Parameter(torch.from_dlpack(x).clone()) for x in _params(shapes).values()]


def torch_kernel_ms(make_opt, shapes, steps):
  import torch
  from torch.profiler import ProfilerActivity, profile
  params = _torch_params(shapes)
  for p, g in zip(params, _grads(shapes, 0).values()):
    p.grad = torch.from_dlpack(g).clone()
  opt = make_opt(params)
  for _ in range(3):
    opt.step()
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
      opt.step()
    torch.cuda.synchronize()
  kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
  return sum(e.device_time for e in kernels) * 1e-3 / steps


def torch_run(make_opt, shapes, n_steps):
  import torch
  params = _torch_params(shapes)
  opt = make_opt(params)
  for k in range(n_steps):
    for p, g in zip(params, _grads(shapes, k).values()):
      p.grad = torch.from_dlpack(g).clone()
    opt.step()
  torch.cuda.synchronize()
  return {n: p.detach().cpu().numpy() for n, p in zip(shapes, params)}


def _distance(a, b, ref, p0):
  num = math.sqrt(sum(float(np.sum((a[n] - b[n]).astype(np.float64) ** 2)) for n in a))
  den = math.sqrt(sum(float(np.sum((ref[n] - p0[n]).astype(np.float64) ** 2)) for n in a))
  return num / den


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("steps", nargs="?", type=int, default=20, help="profiled steps")
  ap.add_argument("--json", help="write the results here")
  args = ap.parse_args(argv)
  import bitsandbytes as bnb
  import torch
  shapes = gpt2_small_shapes()
  n = sum(math.prod(s) for s in shapes.values())
  print(f"# {jax.devices()[0].device_kind}; jax {jax.__version__}, torch {torch.__version__}, "
        f"bitsandbytes {bnb.__version__}; GPT-2 small, {len(shapes)} leaves, {n:,} params",
        flush=True)
  jax_cases = {
    "optirs adam8bit dynamic8 (apply)": lambda: optirs_jax.adam8bit(LR),
    "optirs adam8bit fp8 (apply)": lambda: optirs_jax.adam8bit(LR, state_quantization="fp8"),
    "optirs adam float32 (apply)": lambda: optirs_jax.adam(LR),
  }
  torch_cases = {
    "bitsandbytes Adam8bit": lambda ps: bnb.optim.Adam8bit(ps, lr=LR),
    "torch Adam fused float32": lambda ps: torch.optim.Adam(ps, lr=LR, fused=True),
  }
  ms = {}
  for name, make in jax_cases.items():
    ms[name] = jax_kernel_ms(make(), shapes, args.steps)
    print(f"{name:<36}{ms[name]:>9.3f} ms", flush=True)
  ms["optax adam float32"] = jax_kernel_ms(optax.adam(LR), shapes, args.steps, fused=False)
  print(f"{'optax adam float32':<36}{ms['optax adam float32']:>9.3f} ms", flush=True)
  for name, make in torch_cases.items():
    ms[name] = torch_kernel_ms(make, shapes, args.steps)
    print(f"{name:<36}{ms[name]:>9.3f} ms", flush=True)
  base = ms["optirs adam8bit dynamic8 (apply)"]
  print(f"{'kernel time per step':<36}{'ms':>9}{'x optirs 8-bit':>16}")
  for name, t in ms.items():
    print(f"{name:<36}{t:>9.3f}{t / base:>16.2f}")

  p0 = {k: np.asarray(v) for k, v in _params(shapes).items()}
  runs = {"optirs dynamic8": jax_run(optirs_jax.adam8bit(LR), shapes, 10),
          "optirs fp8": jax_run(optirs_jax.adam8bit(LR, state_quantization="fp8"), shapes, 10),
          "optax float32": jax_run(optax.adam(LR), shapes, 10, fused=False),
          "bitsandbytes": torch_run(torch_cases["bitsandbytes Adam8bit"], shapes, 10)}
  ref = runs["optax float32"]
  dist = {f"{a} vs {b}": _distance(runs[a], runs[b], ref, p0)
          for a, b in [("optirs dynamic8", "bitsandbytes"), ("optirs dynamic8", "optax float32"),
                       ("bitsandbytes", "optax float32"), ("optirs fp8", "optax float32")]}
  print("# after 10 steps: |p_a - p_b| / |p_float32 - p_0| over the whole tree")
  for k, v in dist.items():
    print(f"{k:<40}{v:>10.2e}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": jax.devices()[0].device_kind, "versions": {
        "jax": jax.__version__, "torch": torch.__version__, "bitsandbytes": bnb.__version__},
        "kernel_ms_per_step": ms, "update_distance_after_10_steps": dist}, f, indent=1)


if __name__ == "__main__":
  main()

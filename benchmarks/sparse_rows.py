"""Row-sparse Adam on an embedding table: optirs_jax's fused sparse step, torch's SparseAdam
and dense optax Adam, side by side on the local GPU.

    PYTHONPATH=. python3 benchmarks/sparse_rows.py [rows] [width] [ids] [steps]

Defaults: a 1,000,000 x 128 float32 table, 4096 looked-up ids a step (drawn with
replacement, so some repeat, as in a batch), 20 profiled steps. Kernel time per step from
the profilers (JAX: the device plane of a ``jax.profiler`` trace; torch: the CUDA time of
``torch.profiler``'s kernels), the kernels a step launches, and the ratios.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optirs_jax
from optirs_jax.bench import timing
from optirs_jax.sparse import RowSparse, sparse_adam


def _jax_kernels(step, state, steps):
  """(kernel ms per step, kernels per step) of ``state = step(state)``."""
  import glob
  import os
  import tempfile

  from jax.profiler import ProfileData
  for _ in range(3):
    state = step(state)
  timing.block(state)
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d):
      for _ in range(steps):
        state = step(state)
      timing.block(state)
    data = ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"),
                                           recursive=True)[0])
  plane = data.find_plane_with_name("/device:GPU:0")
  if plane is None:  # no GPU (a dry run on the CPU): no kernel time
    return float("nan"), float("nan")
  events = [e for line in plane.lines if line.name.startswith("Stream") for e in line.events]
  return sum(e.duration_ns for e in events) * 1e-6 / steps, len(events) / steps


def optirs_sparse(table, ids, grads, steps):
  tx = sparse_adam(1e-3)
  fn = jax.jit(lambda p, s, i, g: optirs_jax.apply(
      tx, RowSparse(i, g, p.shape[0]), s, p), donate_argnums=(0, 1))
  return _jax_kernels(lambda st: fn(st[0], st[1], ids, grads), (table, tx.init(table)), steps)


def optax_dense(table, ids, grads, steps):
  """Dense Adam on the table given the same gradient as a dense array (what a model's
  dense embedding gradient is)."""
  tx = optax.adam(1e-3)
  dense = jnp.zeros_like(table).at[ids].add(grads)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  fn = jax.jit(step, donate_argnums=(0, 1))
  return _jax_kernels(lambda st: fn(st[0], st[1], dense), (table, tx.init(table)), steps)


def torch_sparse(rows, width, ids, grads, steps):
  import torch
  from torch.profiler import ProfilerActivity, profile
  dev = "cuda"
  table = torch.nn.Parameter(torch.randn(rows, width, device=dev))
  idx = torch.as_tensor(np.asarray(ids), device=dev, dtype=torch.int64)[None]
  vals = torch.as_tensor(np.asarray(grads), device=dev)
  opt = torch.optim.SparseAdam([table], lr=1e-3)

  def step():
    table.grad = torch.sparse_coo_tensor(idx, vals, (rows, width))  # uncoalesced, as autograd's
    opt.step()

  for _ in range(3):
    step()
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
      step()
    torch.cuda.synchronize()
  kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
  total_us = sum(e.device_time for e in kernels)
  return total_us * 1e-3 / steps, len(kernels) / steps


def main(argv):
  rows, width, n, steps = [int(a) for a in argv[1:]] + [1_000_000, 128, 4096, 20][len(argv) - 1:]
  rng = np.random.default_rng(0)
  ids = jnp.asarray(rng.integers(0, rows, n), jnp.int32)
  grads = jnp.asarray(rng.standard_normal((n, width)), jnp.float32)
  table = jnp.asarray(rng.standard_normal((rows, width)), jnp.float32)
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; table {rows} x {width} "
        f"float32, {n} ids a step ({len(np.unique(np.asarray(ids)))} distinct)")
  results = {"optirs sparse_adam (apply)": optirs_sparse(table, ids, grads, steps)}
  table = jnp.asarray(rng.standard_normal((rows, width)), jnp.float32)  # the last was donated
  results["optax adam (dense)"] = optax_dense(table, ids, grads, steps)
  try:
    results["torch SparseAdam"] = torch_sparse(rows, width, ids, grads, steps)
  except Exception as e:  # no torch, or no CUDA for it
    print(f"# torch: {type(e).__name__}: {e}")
  ours = results["optirs sparse_adam (apply)"][0]
  print(f"{'implementation':<28}{'kernel ms':>10}{'kernels':>9}{'x optirs':>10}")
  for name, (ms, count) in results.items():
    print(f"{name:<28}{ms:>10.4f}{count:>9.1f}{ms / ours:>10.2f}")


if __name__ == "__main__":
  main(sys.argv)

"""Flax's training-loop classes on GPT-2 small's params: the stock ``nnx.Optimizer`` and linen
``TrainState`` against ``optirs_jax.flax``'s, side by side on the local GPU.

    PYTHONPATH=. python3 benchmarks/flax_steps.py [steps]

For each class and transformation (bare ``optirs_jax.adamw``, and inside
``optax.chain(optax.clip_by_global_norm(1.0), ...)``, and optax's ``adamw`` chain for
reference), one jitted step (state donated) that updates the params with fixed gradients:
kernel time per step from the profiler and the kernels launched.
"""

import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.training import train_state
from jax.profiler import ProfileData

import optirs_jax
import optirs_jax.flax as oflax
from optirs_jax.bench import timing
from optirs_jax.bench.cases import gpt2_small_shapes, make_tree


def _kernels(step, state, steps):
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
  if plane is None:
    return float("nan"), float("nan")
  events = [e for line in plane.lines if line.name.startswith("Stream") for e in line.events]
  return sum(e.duration_ns for e in events) * 1e-6 / steps, len(events) / steps


class _Tree(nnx.Module):
  def __init__(self, leaves):
    self.leaves = nnx.List([nnx.Param(x) for x in leaves])


def nnx_case(cls, tx, leaves, grads, steps):
  model = _Tree(leaves)
  optimizer = cls(model, tx, wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  g = nnx.state(_Tree(grads), nnx.Param)

  def step(state):
    model, optimizer = nnx.merge(graphdef, state)
    optimizer.update(model, g)
    return nnx.split((model, optimizer))[1]

  step = jax.jit(step, donate_argnums=0)
  return _kernels(step, state, steps)


def train_state_case(cls, tx, leaves, grads, steps):
  state = cls.create(apply_fn=None, params=list(leaves), tx=tx)
  step = jax.jit(lambda s: s.apply_gradients(grads=list(grads)), donate_argnums=0)
  return _kernels(step, state, steps)


def main(argv):
  steps = int(argv[1]) if len(argv) > 1 else 10
  shapes = gpt2_small_shapes() if jax.default_backend() == "gpu" else gpt2_small_shapes(
      d=128, vocab=1000, ctx=128, layers=2)  # a dry run on the CPU
  leaves = list(make_tree(shapes, 0).values())
  grads = list(make_tree(shapes, 1).values())
  clip = lambda inner: optax.chain(optax.clip_by_global_norm(1.0), inner)
  txs = {"optirs adamw": lambda: optirs_jax.adamw(1e-3, weight_decay=1e-2),
         "chain(clip, optirs adamw)": lambda: clip(optirs_jax.adamw(1e-3, weight_decay=1e-2)),
         "chain(clip, optax adamw)": lambda: clip(optax.adamw(1e-3, weight_decay=1e-2))}
  print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, GPT-2 small "
        f"({len(leaves)} leaves); kernel ms per step (kernels per step)")
  print(f"{'transformation':<28}{'nnx.Optimizer':>18}{'optirs.Optimizer':>19}"
        f"{'TrainState':>16}{'optirs.TrainState':>19}")
  for name, tx in txs.items():
    cells = []
    for case, cls in ((nnx_case, nnx.Optimizer), (nnx_case, oflax.Optimizer),
                      (train_state_case, train_state.TrainState),
                      (train_state_case, oflax.TrainState)):
      fresh = [jnp.array(x) for x in leaves]  # each case donates its own copy
      ms, count = case(cls, tx(), fresh, grads, steps)
      cells.append(f"{ms:.3f} ({count:.0f})")
    print(f"{name:<28}{cells[0]:>18}{cells[1]:>19}{cells[2]:>16}{cells[3]:>19}")


if __name__ == "__main__":
  main(sys.argv)

"""Shared test material: the option matrix, ragged pytrees and an optax-side runner."""

from __future__ import annotations

import collections

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src.state.types import AccumEffect, ReadEffect, WriteEffect

import optirs_jax
from optirs_jax.transforms import REGISTRY

RAGGED_SHAPES = {"one": (1,), "seven": (7,), "forty_two": (42,), "thousand": (1000,),
                 "cube": (3, 5, 7), "scalar": (), "block": (4096,), "rows": (33, 128)}

# (optimizer name, keyword arguments) covering every option of every optimizer: the
# registry's cases (optirs_jax/transforms/<name>.py declares them beside the optimizer).
CASES = [(name, dict(kw)) for name, entry in REGISTRY.items() for kw in entry.cases]
# One case per optimizer that exercises every state field.
TYPICAL = [(name, dict(entry.typical)) for name, entry in REGISTRY.items()]
NAMES = list(REGISTRY)
# Every case on the jnp reference; on the (slow, interpret-mode) kernels every case of the
# core optimizers and the typical one of each other.


# The slowest suites (8 devices, every mesh and layout) run their whole matrix on these, one
# of each kind of rule (moments, momentum, per-leaf norms, sign), and one placement of it on
# every other optimizer of the registry.
CORE = ("adam", "adamw", "lamb", "lion", "sgd", "rmsprop", "adagrad")
# The 8-device placement matrix (every mesh, layout and axis type) runs on one optimizer of
# each executor path: elementwise with a decay mask, and per-leaf norms with a second pass.
PLACEMENT_MATRIX = ("adamw", "lamb")


def backend_cases(backends=("jnp", "pallas"), *, sampled=False) -> list:
  """``(case, backend)`` pairs: every case on ``jnp``; on the kernels every case of the core
  optimizers and the typical case of each other. ``sampled``: that choice on ``jnp`` too
  (for the long suites, where the one-step suite already holds every case to optax)."""
  chosen = ([case for case in CASES if case[0] in CORE]
            + [case for case in TYPICAL if case[0] not in CORE])
  out = []
  for backend in backends:
    out += [(case, backend) for case in (CASES if backend == "jnp" and not sampled else chosen)]
  return out


def backend_ids(pairs) -> list[str]:
  """Test ids of :func:`backend_cases`' pairs: ``name[options]-backend``."""
  return [f"{case_id(c)}-{b}" for c, b in pairs]


def takes_schedule(name: str) -> bool:
  """Whether the optimizer's learning rate may be a schedule (Rprop's is a number)."""
  return dict(REGISTRY[name].spec.arguments)["learning_rate"] in ("schedule",
                                                                  "optional schedule")
ELEMENTWISE = [name for name, entry in REGISTRY.items() if not entry.norms]
# Optimizers that add random noise to the gradients before their rule (noisy_sgd): drawn per
# leaf as optax draws it, in the gradients' dtype.
NOISY = [name for name, entry in REGISTRY.items() if entry.spec.noise]


def case_id(case) -> str:
  name, kw = case
  parts = [f"{k}={getattr(v, '__name__', v) if not callable(v) else 'fn'}" for k, v in kw.items()]
  return name + ("[" + ",".join(parts) + "]" if parts else "")


def leaf_policy(small: str, large: str, **kw) -> optirs_jax.ExecutorOptions:
  """Executor options with the given small- and large-leaf policies."""
  return optirs_jax.ExecutorOptions(small_leaf_policy=small, large_leaf_policy=large, **kw)


def ragged_tree(seed: int, dtype=jnp.float32, shapes=RAGGED_SHAPES):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return {name: jax.random.normal(k, shape, jnp.float32).astype(dtype)
          for k, (name, shape) in zip(keys, shapes.items())}


def pair(name: str, kw: dict, backend: str, lr=1e-2, options=None):
  """(optirs_jax transformation, optax transformation) for one case (a noisy optimizer's
  key 0 unless the case names one: both warn without a key, as optax does)."""
  entry = REGISTRY[name]
  if entry.spec.noise:
    kw = {"key": 0, **kw}
  return (entry.make(lr, **kw, backend=backend, executor_options=options),
          entry.optax(lr, **kw))


def pallas_matches_jnp(name: str, params, options=None) -> tuple:
  """Asserts one ``update`` of ``name`` on the Pallas backend (with ``options``) equals the
  jnp reference's on ``params`` (gradients derived from them); returns ``(pallas opt, grads,
  ref updates, ref state)`` for further checks."""
  grads = jax.tree.map(lambda x: 0.5 * x + 0.1, params)
  ours = getattr(optirs_jax, name)(1e-2, backend="pallas", executor_options=options)
  ref = getattr(optirs_jax, name)(1e-2, backend="jnp")
  u, s = jax.jit(ours.update)(grads, ours.init(params), params)
  ru, rs = jax.jit(ref.update)(grads, ref.init(params), params)
  chex.assert_trees_all_close(u, ru, rtol=1e-6, atol=1e-9)
  chex.assert_trees_all_close(s, rs, rtol=1e-6, atol=1e-9)
  return ours, grads, ru, rs


def loss(params):
  """A smooth loss whose gradient depends on the params: a step that differs shows up."""
  return sum(jnp.sum(0.5 * x * x + 0.25 * jnp.cos(x) - 0.3 * x) for x in jax.tree.leaves(params))


def trajectory(opt, params, steps: int):
  """Params after ``steps`` jitted steps of ``opt`` on :func:`loss`."""

  @jax.jit
  def step(params, state):
    grads = jax.grad(loss)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  state = opt.init(params)
  for _ in range(steps):
    params, state = step(params, state)
  return params, state


def assert_close(a, b, **tol):
  """``chex.assert_trees_all_close`` on trees that may hold random keys (noisy_sgd's
  state), compared by their data."""
  chex.assert_trees_all_close(*(optax.tree.unwrap_random_key_data(t) for t in (a, b)), **tol)


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def kernel_memory(closed) -> list[tuple[int, int]]:
  """Per Pallas kernel of a jaxpr, how many buffers its masked loads read and its masked
  stores write, branches included: a masked load or store names one buffer, a leaf table's
  (``optirs_jax.pallas.leaf_table``) names every leaf's buffer of each of its operands."""
  totals = []
  for counts in kernel_primitives(closed, refs=True):
    totals.append((counts["masked_load"] + counts["optirs_leaf_load"],
                   counts["masked_swap"] + counts["optirs_leaf_store"]))
  return totals


RW_EFFECTS = (ReadEffect, WriteEffect, AccumEffect)


def _effect_ref(effect, eqn):
  """The ref a read or write effect of ``eqn`` names: a var inside a jaxpr, else the
  operand at its index."""
  ref = getattr(effect, "input", None)
  return ref if ref is not None else eqn.invars[effect.input_index]


def kernel_primitives(closed, refs: bool = False) -> list[collections.Counter]:
  """Per Pallas kernel of a jaxpr (on a GPU ``backend="pallas"`` traces the Triton branch
  and the interpret-mode default), the names of its primitives, branches included; with
  ``refs``, each counted once per ref operand it takes (a leaf table's load or store once
  per buffer)."""
  kernels = []

  def walk(jx, counts):
    for eqn in jx.eqns:
      inner = counts
      if eqn.primitive.name == "pallas_call":
        kernels.append(inner := collections.Counter())
      elif counts is not None:
        # The refs it reads or writes (a leaf table's load also takes the output refs
        # whose pointers it finds, unread).
        touched = len({id(_effect_ref(e, eqn)) for e in eqn.effects
                       if isinstance(e, RW_EFFECTS)})
        counts[eqn.primitive.name] += touched if refs and touched else 1
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub, inner)

  walk(closed.jaxpr, None)
  return kernels

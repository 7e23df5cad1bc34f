"""Parity with optax itself on ragged pytrees, for every optimizer and option.

The same cases run on the reference (``jnp``) and on the kernels (``pallas``, interpret
mode on CPU). On the reference float32 results are bit-identical to optax. The kernels run
the same rule inside another XLA computation, where the compiler may contract a multiply
and an add differently, and LAMB's norms are reduced blockwise in another order: they are
held to rtol 1e-6 for one step (most cases come out bit-identical anyway).
"""

import chex
import jax
import jax.numpy as jnp
import pytest

from optirs_jax.transforms import REGISTRY
from tests import cases

BACKENDS = ["jnp", "pallas"]


def _tol(backend, name=""):
  if backend == "jnp" and name and REGISTRY[name].norms and jax.default_backend() == "gpu":
    # XLA on a GPU sums per-leaf norms (LAMB's, LARS's trust ratios) in an order that
    # depends on the program's fusions: one ulp of the ratio (test_dtypes likewise), a few
    # where an update nearly cancels (fromage: 2.3e-6 relative on a 1.6e-6 element, run 49).
    return {"rtol": 1e-6, "atol": 1e-11}
  return {"rtol": 0.0, "atol": 0.0} if backend == "jnp" else {"rtol": 1e-6, "atol": 1e-9}


PARITY = cases.backend_cases(BACKENDS)
PARITY_IDS = cases.backend_ids(PARITY)
# A hundred steps: every case of the core optimizers and the typical one of each other, on
# both backends. On the reference a step is bit-identical to optax's for every case (the
# one-step suite above), so the rest would run the same operations longer.
TRAJECTORY = cases.backend_cases(BACKENDS, sampled=True)
TRAJECTORY_IDS = cases.backend_ids(TRAJECTORY)


@pytest.mark.parametrize("case, backend", PARITY, ids=PARITY_IDS)
def test_one_step_matches_optax(case, backend):
  name, kw = case
  ours, ref = cases.pair(name, kw, backend)
  params = cases.ragged_tree(0)
  grads = cases.ragged_tree(1)
  state, ref_state = ours.init(params), ref.init(params)
  for _ in range(3):  # a few steps, so bias corrections and counts move
    u, state = jax.jit(ours.update)(grads, state, params)
    with jax.numpy_dtype_promotion("standard"):
      ru, ref_state = jax.jit(ref.update)(grads, ref_state, params)
    chex.assert_trees_all_close(u, ru, **_tol(backend, name))
    chex.assert_trees_all_equal_dtypes(u, ru)
    chex.assert_trees_all_equal_shapes(u, ru)


@pytest.mark.parametrize("case, backend", TRAJECTORY, ids=TRAJECTORY_IDS)
def test_hundred_step_trajectory_matches_optax(case, backend):
  name, kw = case
  # lr 1e-3: 100 steps stay clear of the minimum, where sign-like methods (RMSprop, Adam)
  # oscillate and any rounding difference flips single elements. RMSprop with momentum 0.9
  # moves about ten times as far per step, so it gets 1e-4.
  lr = 1e-4 if name == "rmsprop" and kw.get("momentum") else 1e-3
  ours, ref = cases.pair(name, kw, backend, lr=lr)
  params = cases.ragged_tree(2)
  got, state = cases.trajectory(ours, params, 100)
  with jax.numpy_dtype_promotion("standard"):
    want, _ = cases.trajectory(ref, params, 100)
  # Centered RMSprop divides by sqrt(nu - mu^2): when the gradient barely changes that
  # difference cancels to a few ulps of nu and a one-ulp change in an FMA contraction moves
  # single elements by ~1e-5 absolute. The per-leaf relative error below still holds.
  # Yogi moves nu by the sign of nu - g^2: where the two are within an ulp, a one-ulp
  # difference flips that sign and single elements part by ~1e-5 over 100 steps.
  ill_conditioned = backend != "jnp" and (kw.get("centered", False) or name == "yogi")
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-4 if ill_conditioned else 1e-6)
  for key in got:
    assert cases.rel_err(got[key], want[key]) <= 1e-5, key
  assert int(state.count) == 100


@pytest.mark.parametrize("name", cases.NAMES)
def test_state_matches_optax_moments(name):
  """The moments themselves, not only the updates, equal optax's after several steps (the
  registry says where optax keeps each: ``Entry.moments``)."""
  entry = REGISTRY[name]
  ours, ref = cases.pair(name, dict(entry.typical), "pallas")
  params, grads = cases.ragged_tree(3), cases.ragged_tree(4)
  s, rs = ours.init(params), ref.init(params)
  for _ in range(4):
    _, s = jax.jit(ours.update)(grads, s, params)
    with jax.numpy_dtype_promotion("standard"):
      _, rs = jax.jit(ref.update)(grads, rs, params)
  fields = {k for k, v in s._asdict().items() if k != "count" and v is not None}
  assert {m[0] for m in entry.moments} == fields, f"{name}: the registry's moments miss some"
  pairs = [(getattr(s, field), getattr(rs[index], theirs))
           for field, index, theirs in entry.moments]
  # Bit-identical but for the last ulp or two of a multiply-add XLA contracts into an FMA
  # in one program and not in the other (RMSprop's trace in the grouped kernel's interpret
  # mode: up to 2e-7 relative after four steps).
  # On a GPU the Triton kernel and optax's XLA program contract and sum in their own
  # orders (and per-leaf norms feed LARS's momentum): float32 rounding, over four steps.
  rtol = 4e-7 if jax.default_backend() == "cpu" else 1e-5
  # A field the second pass updates from the per-leaf norms (NovoGrad's first moment,
  # LARS's trace) inherits the last bit of a norm the kernels sum block by block, not in
  # jnp.linalg.norm's order: where the field's terms cancel, ~2e-8 absolute after four
  # steps (NovoGrad's, 512-element blocks on a 1000-element leaf).
  atol = 5e-8 if entry.norms and entry.spec.reduction.fields else 0
  for a, b in pairs:  # (a random key as its data: noisy_sgd's)
    cases.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_large_leaves_run_in_place_and_match(name):
  """Leaves of 64+ blocks get their own launch (no packing copy); a ragged one's last
  partial block is computed beside the kernel and written in place."""
  params = {"aligned": jax.random.normal(jax.random.PRNGKey(5), (512, 1024)),
            "ragged": jax.random.normal(jax.random.PRNGKey(6), (2049, 128)),
            "small": jnp.arange(5.0)}
  grads = jax.tree.map(lambda x: jnp.cos(x), params)
  ours, ref = cases.pair(name, {}, "pallas")
  s, rs = ours.init(params), ref.init(params)
  for _ in range(2):
    u, s = jax.jit(ours.update)(grads, s, params)
    with jax.numpy_dtype_promotion("standard"):
      ru, rs = jax.jit(ref.update)(grads, rs, params)
  chex.assert_trees_all_close(u, ru, rtol=1e-6, atol=1e-9)
  chex.assert_trees_all_close(s.nu, rs[0].nu, rtol=1e-6, atol=0)


def test_single_array_and_empty_leaves():
  x = jnp.linspace(-1.0, 1.0, 11)
  for backend in BACKENDS:
    ours, ref = cases.pair("adamw", {}, backend)
    u, _ = ours.update(x, ours.init(x), x)
    with jax.numpy_dtype_promotion("standard"):
      ru, _ = ref.update(x, ref.init(x), x)
    chex.assert_trees_all_close(u, ru, rtol=0, atol=0)
    empty = {"e": jnp.zeros((0, 3)), "x": x}
    u, _ = ours.update(empty, ours.init(empty), empty)
    assert u["e"].shape == (0, 3)

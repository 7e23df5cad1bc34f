"""Muon's momentum and Newton–Schulz stack in one kernel (``orthogonal._momentum_stack``):
the kernel (interpret mode here, Triton on a GPU) against the momentum's arithmetic written
out in numpy, and Muon through it against optax.contrib.muon (momentum state and updates).

This suite's process has 4 CPU devices, where the kernel stands aside (a ``pallas_call`` is
opaque to XLA's partitioner): the tests here take it as a process of one device would.

Tolerances: the kernel's float32 arithmetic against numpy's float64, 2 float32 ulps (XLA and
Triton may fuse a multiply and an add); a bfloat16 stack, one bfloat16 rounding. Muon's
updates: the stacks' 5e-6 relative per leaf of tests/test_muon.py; its momentum, 1e-6.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

import optirs_jax
from optirs_jax.orthogonal import _momentum_stack
from optirs_jax.orthogonal._momentum_stack import fusable, momentum_stack

KEY = jax.random.PRNGKey(3)


@pytest.fixture(autouse=True)
def one_device(monkeypatch):
  monkeypatch.setattr(_momentum_stack, "one_device", lambda: True)
# Matrices 16 x 300 in leaves of 3, 1 and 2: 4800 elements a matrix, so every leaf ends
# inside a block of 4096 (its loads and stores masked there).
SHAPES = [(3, 16, 300), (16, 300), (2, 16, 300)]
# Tall matrices 300 x 40 written wide (transposed, zero past their 300 rows to 384): tiles
# of 64 x 64, the last rows' tile and every columns' tile masked.
TALL, WIDE = [(3, 300, 40), (300, 40), (2, 300, 40)], (300, 40, 384)


def _numpy(gs, ms, beta, t, nesterov, wide=None, transpose=True):
  news, hats = [], []
  for g, m in zip(gs, ms):
    g, m = np.asarray(g, np.float64), np.asarray(m, np.float64)
    new = beta * m + (1 - beta) * g
    if nesterov:
      hat = beta * new / (1 - beta ** (t + 1)) + (1 - beta) * g / (1 - beta**t)
    else:
      hat = new / (1 - beta**t)
    news.append(new)
    if wide is not None:  # each matrix transposed (or not), zeros past its rows
      rows, cols, width = wide
      mats = hat.reshape(-1, rows, cols)
      padded = np.zeros((len(mats), width, cols))
      padded[:, :rows] = mats
      hat = np.swapaxes(padded, 1, 2) if transpose else padded
    hats.append(hat.ravel())
  return news, np.concatenate(hats)


@pytest.mark.parametrize("backend", ["pallas", "jnp"])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["flat", "wide", "padded"])
def test_momentum_and_stack_equal_the_arithmetic(backend, nesterov, dtype, layout):
  # padded: tall matrices kept tall, zero past their rows (a 16-bit stack the chain pads)
  shapes, wide = (SHAPES, None) if layout == "flat" else (TALL, WIDE)
  transpose = layout == "wide"
  keys = jax.random.split(KEY, 2 * len(shapes))
  gs = [jax.random.normal(k, s) for k, s in zip(keys, shapes)]
  ms = [jax.random.normal(k, s) for k, s in zip(keys[len(shapes):], shapes)]
  beta, t = 0.95, 3
  h = jnp.array([1 - beta, beta, 1 - beta**t, 1 - beta ** (t + 1)], jnp.float32)
  run = jax.jit(lambda gs, ms: momentum_stack(gs, ms, h, nesterov=nesterov,
                                              stack_dtype=dtype, wide=wide,
                                              transpose=transpose, backend=backend))
  if backend == "pallas":
    assert "muon_momentum_stack" in str(jax.make_jaxpr(run)(gs, ms))
  news, stack = run(gs, ms)
  want_news, want_stack = _numpy(gs, ms, beta, t, nesterov, wide, transpose)
  assert stack.dtype == dtype and stack.shape == want_stack.shape
  for got, want, m in zip(news, want_news, ms):
    assert got.shape == m.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=2.4e-7, atol=1e-7)
  rtol = 2.4e-7 if dtype == jnp.float32 else 2**-8
  np.testing.assert_allclose(np.asarray(stack, np.float64), want_stack, rtol=rtol, atol=1e-6)


def test_a_wide_layout_that_does_not_fit_the_leaves_is_named():
  g = [jnp.zeros((300, 40))]
  h = jnp.ones(4)
  for wide in [(40, 300, 300), (300, 40, 200), (301, 40, 384)]:
    with pytest.raises(ValueError, match=re.escape(f"wide={wide}")):
      momentum_stack(g, g, h, nesterov=True, stack_dtype=jnp.float32, wide=wide)


def test_fusable_takes_float32_leaves():
  f, b = jnp.zeros((64, 64)), jnp.zeros((64, 64), jnp.bfloat16)
  assert fusable([f, f], [f, f]) and fusable([jnp.zeros((7, 9))], [jnp.zeros((7, 9))])
  assert not fusable([f], [b])  # a bfloat16 momentum (mu_dtype)
  assert not fusable([f], [jnp.zeros((32, 128))])


def _tree():
  shapes = ({f"up{i}": (64, 80) for i in range(3)} | {f"down{i}": (80, 64) for i in range(2)}
            | {"vocab": (4200, 8), "b": (16,), "odd": (7, 9)})
  return {k: jax.random.normal(jax.random.fold_in(KEY, i), s)
          for i, (k, s) in enumerate(shapes.items())}


@pytest.mark.parametrize("kw", [{}, {"nesterov": False}, {"beta": 0.9, "ns_coeffs": "dion"}],
                         ids=["default", "no-nesterov", "dion"])
def test_muon_through_the_kernel_matches_optax(kw, standard_promotion):
  # A stack of three matrices, a tall stack of two and a long one take the kernel (each
  # ending inside a block; the tall ones written wide, the long one padded to 4224);
  # 7 x 9 (a leaf alone: optax's program) and the vector do not. Three steps: the momentum
  # carried in the state.
  params = _tree()
  ours, ref = optirs_jax.muon(0.02, backend="pallas", **kw), contrib.muon(0.02, **kw)
  grads = lambda t: jax.tree.map(lambda v: jnp.sin(v * (t + 1)), params)
  step = lambda tx: jax.jit(tx.update)
  assert str(jax.make_jaxpr(ours.update)(grads(0), ours.init(params), params)).count(
    "name=muon_momentum_stack") == 3
  with jax.default_matmul_precision("highest"):
    states = [ours.init(params), ref.init(params)]
    for t in range(3):
      (u, s), (u_ref, s_ref) = [step(tx)(grads(t), st, params)
                                for tx, st in zip((ours, ref), states)]
      states = [s, s_ref]
      for k in params:
        rel = float(jnp.linalg.norm(u[k] - u_ref[k]) / jnp.linalg.norm(u_ref[k]))
        assert rel < 5e-6, (t, k, rel)
  mu = lambda s: s.inner_states["muon"].inner_state[0].mu
  for k in ("up0", "up2", "down1", "vocab", "odd"):
    np.testing.assert_allclose(mu(states[0])[k], mu(states[1])[k], rtol=1e-6, atol=1e-7)


def test_bfloat16_muon_through_the_kernel_writes_the_long_stack_padded(standard_promotion):
  # In bfloat16 the long leaf's stack is written padded to 4224 rows by the kernel (no pad
  # of its own), then takes the Gram form: within 0.01 of optax at float32's precision
  # (the other stacks' chains step by step: 0.1, the bfloat16 tolerance). Four stacks:
  # 7 x 9 alone takes the fast form too in bfloat16 (optax's program only at its precision).
  params = _tree()
  ours, ref = optirs_jax.muon(0.02, backend="pallas", ns_dtype=jnp.bfloat16), contrib.muon(0.02)
  grads = jax.tree.map(jnp.sin, params)
  jaxpr = str(jax.make_jaxpr(ours.update)(grads, ours.init(params), params))
  assert jaxpr.count("name=muon_momentum_stack") == 4 and " pad[" not in jaxpr
  u, _ = jax.jit(ours.update)(grads, ours.init(params), params)
  with jax.default_matmul_precision("highest"):
    u_ref, _ = jax.jit(ref.update)(grads, ref.init(params), params)
  for k in params:
    rel = float(jnp.linalg.norm(u[k] - u_ref[k]) / jnp.linalg.norm(u_ref[k]))
    assert rel < (0.01 if k == "vocab" else 0.1), (k, rel)


def test_under_inject_hyperparams_through_the_kernel(standard_promotion):
  # ns_steps traced: the wide stacks' chains transpose after the loop instead of writing
  # the last product tall.
  params = _tree()
  inject = lambda muon, **kw: optax.inject_hyperparams(muon)(learning_rate=0.02, **kw)
  ours, ref = inject(optirs_jax.muon, backend="pallas"), inject(contrib.muon)
  grads = jax.tree.map(jnp.sin, params)
  with jax.default_matmul_precision("highest"):
    u, _ = jax.jit(ours.update)(grads, ours.init(params), params)
    u_ref, _ = jax.jit(ref.update)(grads, ref.init(params), params)
  for k in params:
    rel = float(jnp.linalg.norm(u[k] - u_ref[k]) / jnp.linalg.norm(u_ref[k]))
    assert rel < 5e-6, (k, rel)


def test_a_bfloat16_momentum_keeps_xlas_two_passes(standard_promotion):
  params = _tree()
  tx = optirs_jax.muon(0.02, mu_dtype=jnp.bfloat16, backend="pallas")
  jaxpr = str(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
  assert "muon_momentum_stack" not in jaxpr


def test_several_devices_keep_xlas_two_passes(monkeypatch):
  monkeypatch.setattr(_momentum_stack, "one_device", lambda: False)
  f = jnp.zeros((64, 64))
  assert not fusable([f], [f])


def test_bad_backend_is_named():
  with pytest.raises(ValueError, match="backend='cuda' is not a known backend"):
    optirs_jax.muon(0.02, backend="cuda")
  with pytest.raises(ValueError, match="valid backends"):
    optirs_jax.orthogonal.scale_by_muon(backend="triton")
  assert isinstance(optirs_jax.muon(0.02, backend="jnp"), optax.GradientTransformation)

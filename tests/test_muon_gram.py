"""The Gram form of 16-bit Newton–Schulz chains on long matrices
(``optirs_jax/orthogonal/_gram_form.py``) against optax's chain written out in float64
numpy, and through Muon against ``optax.contrib.muon``.

Tolerances: the form's result is a bfloat16 matrix (2^-9 relative rounding); against
optax's chain in float64 it errs by about 0.003 on Gaussian matrices, where the 16-bit
chain step by step errs by about 0.05 after five steps (so the bounds below fail if the
form is not taken, or its small side loses float32's precision).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

import optirs_jax
from optirs_jax.orthogonal import orthogonalize_stack
from optirs_jax.orthogonal._gram_form import bf16x3
from optirs_jax.orthogonal._newton_schulz import PRESETS
from tests.test_muon import _numpy_chain

KEY = jax.random.PRNGKey(3)
STANDARD = jnp.asarray(PRESETS["standard"])


def _rel(got, want) -> float:
  got = np.asarray(got, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _long_products(fn, size: int) -> int:
  """The matrix products in ``fn``'s program with an operand of at least ``size``
  elements (the whole stack's: products over the long side)."""
  eqns = jax.make_jaxpr(fn)().eqns
  return sum(e.primitive.name == "dot_general"
             and any(v.aval.size >= size for v in e.invars) for e in eqns)


@pytest.mark.parametrize("steps", [5, 2, 1])
@pytest.mark.parametrize("shape, transposed", [
    ((2, 48, 1000), False), ((2, 1000, 48), False), ((2, 48, 1000), True),
    ((1, 4200, 48), False)], ids=["wide", "tall", "given-transposed", "padded-split"])
def test_gram_form_against_optaxs_chain_in_float64(steps, shape, transposed):
  # Three products of the long side in all (A_0, and Q_n X_0 in two parts), where the
  # chain step by step takes two a step; closer to float64 than bfloat16's own chain.
  x = np.asarray(jax.random.normal(KEY, shape))
  want = _numpy_chain(np.swapaxes(x, 1, 2) if transposed else x, "frobenius", steps)
  run = lambda: orthogonalize_stack(jnp.asarray(x), STANDARD, steps, ns_dtype=jnp.bfloat16,
                                    transposed=transposed)
  assert _long_products(run, x.size) == 3
  got = run()
  assert got.shape == want.shape and got.dtype == jnp.float32
  assert _rel(got, want) < 0.005, _rel(got, want)


@pytest.mark.parametrize("kind", ["rank-30", "decaying", "tiny", "zero"])
def test_gram_form_on_ill_conditioned_matrices(kind):
  # An embedding's momentum has rows of tokens never seen (zero) and a decaying spectrum.
  # The iterate's factor grows like c0^5 on small singular values: rounded to bfloat16
  # at the end it would err by 0.13 on the rank-30 matrix (the two-part product: 0.005).
  m, n = 64, 2048
  x = np.asarray(jax.random.normal(KEY, (m, n)), np.float64)
  u, s, vt = np.linalg.svd(x, full_matrices=False)
  x = {"rank-30": x * (np.arange(n) < 30), "decaying": (u * np.arange(1, m + 1.0) ** -1.5) @ vt,
       "tiny": x * 1e-6, "zero": 0 * x}[kind][None]
  got = orthogonalize_stack(jnp.asarray(x, jnp.float32), STANDARD, 5, ns_dtype=jnp.bfloat16)
  if kind == "zero":
    assert not np.asarray(got).any()
    return
  bound = {"rank-30": 0.01, "decaying": 0.062, "tiny": 0.005}[kind]  # step by step:
  assert _rel(got, _numpy_chain(x, "frobenius")) < bound  # 0.048, 0.066, 0.03


def test_gram_form_with_a_schedule_and_spectral_preconditioning():
  x = np.asarray(jax.random.normal(KEY, (1, 32, 700)))
  for kw, pre in [({"coeffs": jnp.asarray(PRESETS["dion"])}, "frobenius"),
                  ({"coeffs": STANDARD}, "spectral")]:
    got = orthogonalize_stack(jnp.asarray(x), ns_steps=5, ns_dtype=jnp.bfloat16,
                              preconditioning=pre, **kw)
    want = []
    for m in x:  # optax's chain in float64, each step's row
      w = m / (np.linalg.norm(m, "fro" if pre == "frobenius" else 2) + 1e-8)
      rows = np.asarray(kw["coeffs"], np.float64).reshape(-1, 3)
      for i in range(5):
        c, a = rows[min(i, len(rows) - 1)], w @ w.T
        w = c[0] * w + (c[1] * a + c[2] * a @ a) @ w
      want.append(w)
    assert _rel(got, np.stack(want)) < 0.005, (pre, _rel(got, np.stack(want)))


def test_bf16x3_products_keep_sixteen_bits():
  a = jax.random.normal(KEY, (2, 40, 56))
  b = jax.random.normal(jax.random.fold_in(KEY, 1), (2, 56, 24))
  want = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  one = jax.lax.dot_general(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                            (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
  assert _rel(bf16x3(a, b), want) < 2e-5 < 1e-3 < _rel(one, want)


def _muon_tree():
  return {"vocab": jax.random.normal(KEY, (1100, 32)),  # Gram form in bfloat16
          "w": jax.random.normal(jax.random.fold_in(KEY, 1), (2, 32, 48)),
          "b": jnp.ones(48)}


@pytest.mark.parametrize("inject, kw", [(False, {}), (True, {}),
                                        (False, {"preconditioning": "spectral"})],
                         ids=["static", "inject_hyperparams", "spectral"])
def test_muon_in_bfloat16_takes_the_gram_form_near_optax(inject, kw, standard_promotion):
  # optax.contrib.muon at full float32 precision against ours in bfloat16 over two steps:
  # the long leaf near optax's numbers (bfloat16's chain step by step: about 0.05); under
  # inject_hyperparams the step count is traced (the form's loop from the identity). The
  # spectral norm of a 16-bit stack is taken in float32 (there is no 16-bit SVD).
  params = _muon_tree()
  dims = {"vocab": contrib.MuonDimensionNumbers(), "w": contrib.MuonDimensionNumbers(1, 2),
          "b": None}

  def run(make, **ours):
    tx = (optax.inject_hyperparams(make) if inject else make)(
        learning_rate=0.02, muon_weight_dimension_numbers=dims, **kw, **ours)
    p, state = params, tx.init(params)
    for t in range(2):
      g = jax.tree.map(lambda v, t=t: jnp.cos(v * (t + 2)), params)
      u, state = jax.jit(tx.update)(g, state, p)
      p = optax.apply_updates(p, u)
    return jax.tree.map(lambda a, b: a - b, p, params)  # the two steps' updates

  with jax.default_matmul_precision("highest"):
    want = run(contrib.muon)
  got = run(optirs_jax.muon, ns_dtype=jnp.bfloat16)
  assert _rel(got["vocab"], np.asarray(want["vocab"], np.float64)) < 0.01
  assert _rel(got["w"], np.asarray(want["w"], np.float64)) < 0.1  # the chain step by step

"""optirs_jax.muon against optax.contrib.muon: the same numbers for every argument, the
batched Newton–Schulz chains, and optax's own Muon tests (``optax/contrib/_muon_test.py``)
written out for ours.

Tolerances: a tree of one matrix (and one vector for AdamW) compiles the same program as
optax's, and the numbers are equal bit for bit. Trees of several matrices are compared
with a relative Frobenius error per leaf of 5e-6 in float32: XLA compiles each library's
whole step as one program and fuses it by its own choices, and optax's numbers for a leaf
already differ by that much depending on which other leaves share its tree (its update of
one 8x16 leaf alone and beside a second one differ by 6e-7 on this CPU). Batched
bfloat16 Newton–Schulz (``ns_dtype``) against optax's float32 chain: 0.1 per leaf.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

import optirs_jax
from optirs_jax.orthogonal import MuonDimensionNumbers as D
from optirs_jax.orthogonal import (
  coefficients,
  flops,
  gram_splits,
  orthogonalize,
  orthogonalize_stack,
)
from optirs_jax.orthogonal._newton_schulz import PRESETS

CASES = [
    {}, {"nesterov": False}, {"adaptive": True}, {"preconditioning": "aol"},
    {"preconditioning": "schatten"}, {"preconditioning": "spectral"}, {"ns_coeffs": "dion"},
    {"ns_coeffs": ((3.4445, -4.7750, 2.0315),) * 3, "ns_steps": 4}, {"ns_steps": 3},
    {"beta": 0.9, "eps": 1e-6}, {"weight_decay": 0.1},
    {"weight_decay": 0.1, "weight_decay_mask": {"w": False, "b": True}},
    {"consistent_rms": 0.2}, {"mu_dtype": jnp.bfloat16},
    {"adam_b1": 0.8, "adam_b2": 0.99, "adam_eps_root": 1e-8, "adam_weight_decay": 0.1,
     "adam_learning_rate": 0.1},
    {"learning_rate": optax.linear_schedule(0.1, 0.0, 5)},
]
KEY = jax.random.PRNGKey(0)
MATRIX = {"w": jax.random.normal(KEY, (6, 10)), "b": jnp.ones(10)}
STACKED = {"w": jax.random.normal(KEY, (3, 6, 10)), "b": jnp.ones(10)}
OD = contrib.MuonDimensionNumbers  # optax's, which both take
DIMS = [
    ("2d", MATRIX, None),
    ("batch-axis", STACKED, {"w": OD(1, 2), "b": None}),
    ("callable-two-reduction-axes", STACKED, lambda p: {"w": OD((0, 1), 2), "b": None}),
]


def _run(tx, params, steps=3):
  state = tx.init(params)
  step = jax.jit(tx.update)
  for t in range(steps):
    grads = jax.tree.map(lambda v, t=t: jnp.sin(v * (t + 1)), params)
    updates, state = step(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _both(kw, params, dims, **ours):
  kw = dict(kw)
  lr = kw.pop("learning_rate", 0.02)
  if dims is not None:
    kw["muon_weight_dimension_numbers"] = dims
  return _run(contrib.muon(lr, **kw), params), _run(optirs_jax.muon(lr, **kw, **ours), params)


def _rel(a, b) -> float:
  return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


# Every case on a 2-D matrix; the reshaped layouts with the cases that read the shape.
MATRIX_CASES = [(kw, *DIMS[0]) for kw in CASES] + [
    (kw, *layout) for layout in DIMS[1:]
    for kw in (CASES[0], CASES[3], CASES[4], CASES[12], CASES[15])]


@pytest.mark.parametrize("kw, layout, params, dims", MATRIX_CASES,
                         ids=[f"{','.join(c[0]) or 'default'}-{c[1]}" for c in MATRIX_CASES])
def test_one_matrix_equals_optax_bit_for_bit(kw, layout, params, dims, standard_promotion):
  with jax.default_matmul_precision("highest"):
    (ref, ref_state), (got, state) = _both(kw, params, dims)
  chex.assert_trees_all_equal(got, ref)
  # The Muon partition's state is optax's, field for field.
  chex.assert_trees_all_equal(state[0]["muon"][0][0][1], ref_state[0]["muon"][0][0][1])


def _layers_tree():
  shapes = ({f"attn{i}": (16, 48) for i in range(4)} | {f"up{i}": (16, 64) for i in range(3)}
            | {f"down{i}": (64, 16) for i in range(3)} | {"emb": (100, 16), "b": (16,)})
  return {k: jax.random.normal(jax.random.fold_in(KEY, i), s)
          for i, (k, s) in enumerate(shapes.items())}


@pytest.mark.parametrize("kw", [{}, {"preconditioning": "aol", "adaptive": True},
                                {"ns_coeffs": "dion", "weight_decay": 0.1}],
                         ids=["default", "aol-adaptive", "dion-decay"])
def test_layers_batched_match_optax(kw, standard_promotion):
  params = _layers_tree()
  with jax.default_matmul_precision("highest"):
    (ref, _), (got, _) = _both(kw, params, None)
  for k in params:
    assert _rel(got[k], ref[k]) < 5e-6, (k, _rel(got[k], ref[k]))


def _dots(tx, params) -> int:
  grads = jax.tree.map(jnp.sin, params)
  return str(jax.make_jaxpr(tx.update)(grads, tx.init(params), params)).count("dot_general")


def test_one_chain_per_matrix_shape(standard_promotion):
  # attn (16x48), up (16x64), down (64x16: tall, taken transposed in place by its products)
  # and emb (100x16): four chains here, one per leaf (eleven) in optax's; three products a
  # step each. A stack's chain has its first step apart (3 products) and its loop's body
  # (3); emb alone takes optax's program (its loop's body).
  params = _layers_tree()
  assert _dots(optirs_jax.muon(0.02), params) == 3 * (3 + 3) + 3
  assert _dots(contrib.muon(0.02), params) == 11 * 3


def _ops(fn, *args) -> str:
  return str(jax.make_jaxpr(fn)(*args))


def test_stacks_take_tall_matrices_in_place_and_one_product_a_step():
  # A stack of several tall matrices: no transpose, one product per step beyond the two of
  # the polynomial (c0 folded into it); a long side above 4096 padded once, not per step;
  # the Frobenius norm read off the first Gram matrix (no pass over the stack divides it).
  coeffs = coefficients("standard", 5)
  tall = jnp.ones((3, 4100, 8))
  jaxpr = _ops(lambda x: orthogonalize_stack(x, coeffs, 5), tall)
  assert "transpose" not in jaxpr
  assert jaxpr.count("dot_general") == 3 + 3  # the first step, the unrolled loop's body
  assert jaxpr.count(" pad[") == 1 and "4224" in jaxpr
  # What makes a stack-sized array: its padding (in jnp.pad's jit), the first step's
  # product, the loop (a scan) and its body's product; nothing elementwise.
  stack_sized = [line for line in jaxpr.split("\n") if "f32[3,4224,8] =" in line]
  ops = sorted(line.split("=")[1].split("[")[0].strip() for line in stack_sized)
  assert ops == ["dot_general", "dot_general", "jit", "pad", "scan"], stack_sized
  # optax's program (exact): transposed there and back, c0 X + B X, no padding.
  jaxpr = _ops(lambda x: orthogonalize_stack(x, coeffs, 5, exact=True), tall)
  assert jaxpr.count("transpose") == 3 and " pad[" not in jaxpr  # in, out, the Gram's


def _numpy_chain(x, preconditioning, steps=5):
  """optax's chain on each matrix of ``x`` (rows > columns: taken transposed), in numpy."""
  c = np.array(PRESETS["standard"])
  ref = []
  for m in x:
    tall = m.shape[0] > m.shape[1]
    w = m.T if tall else m
    if preconditioning in ("frobenius", "spectral"):
      norm = np.linalg.norm(w, "fro" if preconditioning == "frobenius" else 2)
      w = w / (norm + 1e-8)
    for i in range(steps):
      a = w @ w.conj().T if preconditioning != "schatten" or i else w @ w.T
      if i == 0 and preconditioning == "aol":
        s = 1 / np.sqrt(np.maximum(np.abs(a).sum(-1), 1e-8))
        w, a = w * s[:, None], a * s[:, None] * s[None, :]
      if i == 0 and preconditioning == "schatten":
        s = 1 / np.sqrt(max(np.linalg.norm(a), 1e-8))
        w, a = w * s, a * s**2
      w = c[0] * w + (c[1] * a + c[2] * a @ a) @ w
    ref.append(w.T if tall else w)
  return np.stack(ref)


@pytest.mark.parametrize("preconditioning", ["frobenius", "aol", "schatten", "spectral"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.complex64])
def test_in_place_tall_and_folded_steps_equal_the_transposed_chain(preconditioning, dtype):
  # The fast form against optax's program, written out in numpy on the transposes.
  if preconditioning == "schatten" and dtype == jnp.complex64:
    pytest.skip("optax's Schatten step takes X X^T unconjugated: it diverges on complex X")
  x = np.asarray(jax.random.normal(KEY, (2, 9, 5), dtype))
  with jax.default_matmul_precision("highest"):
    got = orthogonalize_stack(jnp.asarray(x), jnp.asarray(PRESETS["standard"]), 5,
                              preconditioning=preconditioning)
  np.testing.assert_allclose(np.asarray(got), _numpy_chain(x, preconditioning), rtol=2e-5,
                             atol=2e-5)


@pytest.mark.parametrize("preconditioning", ["frobenius", "aol", "schatten", "spectral"])
@pytest.mark.parametrize("steps", [5, 2, 1])
def test_a_tall_stack_given_transposed_is_iterated_wide(preconditioning, steps):
  # Muon's kernel writes a float32 tall stack as its transposes (zero past the rows): the
  # chain runs wide and its last product writes the matrices tall (no transpose after it).
  x = np.asarray(jax.random.normal(KEY, (2, 9, 5)))
  given = jnp.pad(jnp.swapaxes(jnp.asarray(x), 1, 2), ((0, 0), (0, 0), (0, 3)))
  run = lambda y: orthogonalize_stack(y, jnp.asarray(PRESETS["standard"]), steps,
                                      preconditioning=preconditioning, transposed=True)
  last = jax.make_jaxpr(run)(given).jaxpr.eqns[-1]
  assert last.primitive.name == "dot_general" and last.outvars[0].aval.shape == (2, 12, 5)
  with jax.default_matmul_precision("highest"):
    got = run(given)
  assert got.shape == (2, 12, 5)
  np.testing.assert_allclose(np.asarray(got[:, :9]), _numpy_chain(x, preconditioning, steps),
                             rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(np.asarray(got[:, 9:]), 0)  # the zero rows stay zero
  with pytest.raises(ValueError, match="transposed takes a wide stack"):
    orthogonalize_stack(jnp.asarray(x), jnp.asarray(PRESETS["standard"]), 5, transposed=True)


@pytest.mark.parametrize("preconditioning", ["frobenius", "aol", "schatten"])
@pytest.mark.parametrize("shape, dtype", [((1, 4200, 6), jnp.float32),
                                          ((1, 6, 4200), jnp.float32),
                                          ((1, 4200, 6), jnp.complex64)])
def test_a_long_matrix_splits_its_gram_product(preconditioning, shape, dtype):
  # One matrix with a long side above 4096: padded to 4224 once, and its Gram product (one
  # 128 x 128 tile) split in four along the long side, each part >= 1024 rows; a wide one
  # is transposed once for it. The numbers: optax's chain in numpy, to float32 rounding.
  if preconditioning == "schatten" and dtype == jnp.complex64:
    pytest.skip("optax's Schatten step takes X X^T unconjugated: it diverges on complex X")
  assert gram_splits(1, 6, 4224) == 4 and gram_splits(1, 6, 2048) == 2
  assert gram_splits(1, 6, 2046) == 1 and gram_splits(132, 6, 8192) == 1
  # GPT-2's embedding: 36 tiles, in 32 parts in float32, in 8 in bfloat16 (264 tiles)
  assert gram_splits(1, 768, 50304) == 32 and gram_splits(1, 768, 50304, itemsize=2) == 8
  x = np.asarray(jax.random.normal(KEY, shape, dtype))
  coeffs = jnp.asarray(PRESETS["standard"])
  run = lambda x: orthogonalize_stack(x, coeffs, 5, preconditioning=preconditioning)
  jaxpr = _ops(run, jnp.asarray(x))
  assert jaxpr.count(" pad[") == 1 and jaxpr.count("transpose") == (2 if shape[1] < 7 else 0)
  assert "[4,6,6]" in jaxpr.replace(" ", "")  # the four parts' Gram matrices, then summed
  with jax.default_matmul_precision("highest"):
    got = run(jnp.asarray(x))
  np.testing.assert_allclose(np.asarray(got), _numpy_chain(x, preconditioning), rtol=1e-4,
                             atol=2e-5)


def test_one_long_matrix_is_close_to_optax(standard_promotion):
  # A leaf alone whose long side is above 4096 takes the fast form, not optax's program.
  params = {"emb": jax.random.normal(KEY, (4200, 8)), "b": jnp.ones(8)}
  with jax.default_matmul_precision("highest"):
    (ref, _), (got, _) = _both({}, params, None)
  assert _rel(got["emb"], ref["emb"]) < 5e-6, _rel(got["emb"], ref["emb"])
  chex.assert_trees_all_equal(got["b"], ref["b"])


@pytest.mark.parametrize("kw", [{}, {"ns_coeffs": "dion"}], ids=["standard", "dion"])
def test_under_inject_hyperparams_as_optax(kw, standard_promotion):
  # optax.inject_hyperparams passes ns_steps (a number) to the update as a traced int32:
  # the loop runs that many steps, as optax's does; a stack, a long leaf and AdamW's vector.
  params = _layers_tree() | {"vocab": jax.random.normal(KEY, (4200, 16))}
  inject = lambda muon: optax.inject_hyperparams(muon)(learning_rate=0.02, **kw)
  with jax.default_matmul_precision("highest"):
    ref, _ = _run(inject(contrib.muon), params, steps=2)
    got, state = _run(inject(optirs_jax.muon), params, steps=2)
  assert int(state.hyperparams["ns_steps"]) == 5
  for k in params:
    assert _rel(got[k], ref[k]) < 5e-6, (k, _rel(got[k], ref[k]))


@pytest.mark.parametrize("preconditioning", ["frobenius", "spectral"])
def test_bfloat16_newton_schulz_is_close_to_optax(preconditioning, standard_promotion):
  # The spectral norm of a 16-bit stack is taken in float32 (there is no 16-bit SVD).
  params = _layers_tree()
  grads = jax.tree.map(jnp.sin, params)
  ref_tx = contrib.muon(0.02, preconditioning=preconditioning)
  with jax.default_matmul_precision("highest"):
    ref, _ = jax.jit(ref_tx.update)(grads, ref_tx.init(params), params)
  tx = optirs_jax.muon(0.02, ns_dtype=jnp.bfloat16, preconditioning=preconditioning)
  got, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  for k in params:
    assert got[k].dtype == ref[k].dtype
    assert _rel(got[k], ref[k]) < 0.1, (k, _rel(got[k], ref[k]))
  assert _rel(got["b"], ref["b"]) == 0.0  # AdamW's leaves do not see ns_dtype


@pytest.mark.parametrize("steps", [5, 2, 1])
@pytest.mark.parametrize("shape, transposed", [((3, 48, 200), False), ((3, 200, 48), False),
                                               ((3, 48, 200), True)],
                         ids=["wide", "tall", "given-transposed"])
def test_bfloat16_square_form_against_optaxs_chain_in_float64(steps, shape, transposed):
  # c0 I + c1 A + c2 A^2 = c2 (A + aI)^2 + bI: the 16-bit chain's two diagonal updates
  # instead of the factor's elementwise passes. Against optax's chain in float64 numpy:
  # closer than the expanded form in bfloat16 (within bfloat16's rounding of each).
  x = np.asarray(jax.random.normal(KEY, shape))
  want = _numpy_chain(np.swapaxes(x, 1, 2) if transposed else x, "frobenius", steps)
  run = lambda square: orthogonalize_stack(
      jnp.asarray(x), jnp.asarray(PRESETS["standard"]), steps, ns_dtype=jnp.bfloat16,
      square=square, transposed=transposed)
  assert "scatter-add" in _ops(lambda: run(True)) or steps == 1
  assert "scatter-add" not in _ops(lambda: run(False))
  err = {sq: np.linalg.norm(np.asarray(run(sq), np.float64) - want) / np.linalg.norm(want)
         for sq in (True, False)}
  assert err[True] < 0.08 and err[True] < 1.5 * err[False], err


def test_square_form_needs_one_row_with_a_nonzero_c2(standard_promotion):
  # A cubic (c2 = 0) and Dion's schedule keep the expanded form; both stay close to optax.
  params = _layers_tree()
  grads = jax.tree.map(jnp.sin, params)
  for kw in [{"ns_coeffs": (1.5, -0.5, 0.0)}, {"ns_coeffs": "dion"}]:
    ref_tx, tx = contrib.muon(0.02, **kw), optirs_jax.muon(0.02, ns_dtype=jnp.bfloat16, **kw)
    assert "scatter-add" not in str(jax.make_jaxpr(tx.update)(grads, tx.init(params), params))
    with jax.default_matmul_precision("highest"):
      ref, _ = jax.jit(ref_tx.update)(grads, ref_tx.init(params), params)
    got, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    for k in params:
      assert _rel(got[k], ref[k]) < 0.1, (kw, k, _rel(got[k], ref[k]))
  tx = optirs_jax.muon(0.02, ns_dtype=jnp.bfloat16)  # the standard row takes the square
  assert "scatter-add" in str(jax.make_jaxpr(tx.update)(grads, tx.init(params), params))
  # ns_steps traced (inject_hyperparams): the square's loop, its scale after it
  tx = optax.inject_hyperparams(optirs_jax.muon)(learning_rate=0.02, ns_dtype=jnp.bfloat16)
  got, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  with jax.default_matmul_precision("highest"):
    ref, _ = jax.jit(contrib.muon(0.02).update)(grads, contrib.muon(0.02).init(params), params)
  for k in params:
    assert _rel(got[k], ref[k]) < 0.1, (k, _rel(got[k], ref[k]))


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e3])
@pytest.mark.parametrize("preconditioning", ["frobenius", "spectral"])
@pytest.mark.parametrize("shape", [(3, 48, 200), (3, 200, 48), (2, 32, 1024)],
                         ids=["wide", "tall", "long"])
def test_float16_chain_holds_far_from_a_unit_norm(shape, preconditioning, scale):
  # float16 spans 6e-8 to 65504: the Gram product of a stack of 1e3s overflowed (-inf),
  # one of 1e-6s lost its bits. Against optax's chain in float64 numpy, at every scale
  # (the 32 x 1024 stack takes the Gram form): within float16's rounding (0.011 measured).
  x = np.asarray(jax.random.normal(KEY, shape)) * scale
  want = _numpy_chain(x, preconditioning)
  got = orthogonalize_stack(jnp.asarray(x, jnp.float32), jnp.asarray(PRESETS["standard"]), 5,
                            ns_dtype=jnp.float16, preconditioning=preconditioning)
  err = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
  assert err < 0.02, err


def test_newton_schulz_orthogonalizes():
  # optax's test_newton_schulz: 20 steps of (2, -1.5, 0.5) give an orthonormal matrix,
  # for a real and a complex one; here both in one call, with a numpy check of the Gram.
  real = jax.random.normal(jax.random.key(0), (4, 3), dtype=jnp.float32)
  cplx = jax.random.normal(jax.random.key(0), (4, 3), dtype=jnp.complex64)
  c = jnp.array([2.0, -1.5, 0.5])
  for x in (real, cplx):
    with jax.default_matmul_precision("highest"):  # a GPU's default rounds to TF32
      (o,) = orthogonalize([x], [D()], c, 20, eps=1e-12)
    o = np.asarray(o)
    np.testing.assert_allclose(o.conj().T @ o, np.eye(3), atol=1e-5, rtol=1e-5)
    assert o.shape == x.shape


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adaptive", [True, False])
def test_complex_target(adaptive, nesterov):
  # optax's test_complex_mixed_target.
  final = jnp.array([[1.0 + 2.0j, 0.0], [-1.0 + 1.0j, 1.0 - 3.0j]], jnp.complex64)
  loss = lambda p: jnp.sum(jnp.abs(p - final) ** 2)
  opt = optirs_jax.muon(1e-2, adaptive=adaptive, nesterov=nesterov)

  @jax.jit
  def step(carry, _):
    params, state = carry
    grads = jax.tree.map(jnp.conj, jax.grad(loss)(params))
    updates, state = opt.update(grads, state, params)
    return (optax.apply_updates(params, updates), state), None

  params = jnp.zeros((2, 2), jnp.complex64)
  (params, _), _ = jax.lax.scan(step, (params, opt.init(params)), length=1000)
  chex.assert_trees_all_close(params, final, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("preconditioning", ["frobenius", "aol", "schatten"])
def test_orthogonality(preconditioning):
  # optax's test_orthogonality.
  params = {"w": jnp.eye(8) * 2.0}
  opt = optirs_jax.muon(0.1, preconditioning=preconditioning)
  w = opt.update(params, opt.init(params), params)[0]["w"]
  gram = w.T @ w
  assert float(jnp.linalg.norm(gram / jnp.max(gram) - jnp.eye(8))) < 1e-3


def test_dimension_numbers_send_leaves_where_optax_does():
  # optax's test_dim_nums_combinations: which leaves hold Muon's momentum.
  masked = lambda x: isinstance(x, optax.MaskedNode)
  mu = lambda params, dims=None: optirs_jax.muon(
      1e-3, muon_weight_dimension_numbers=dims).init(params)[0]["muon"][0][0][1]
  dn = D(1, 2)
  got = mu({"w1": jnp.ones((1, 2, 3)), "w2": jnp.ones((2, 3, 4))}, {"w1": dn, "w2": dn})
  assert not masked(got["w1"]) and not masked(got["w2"])
  got = mu({"w1": jnp.ones((1, 2, 3)), "w2": jnp.ones((3, 4))})
  assert masked(got["w1"]) and not masked(got["w2"])
  params = {"w1": {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 3))},
            "w2": {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 3))}}
  got = mu(params, {"w1": None, "w2": {"a": D(), "b": None}})
  assert [masked(got[k][j]) for k in ("w1", "w2") for j in "ab"] == [True, True, False, True]
  got = mu(params, {"w1": D(), "w2": None})
  assert [masked(got[k][j]) for k in ("w1", "w2") for j in "ab"] == [False, False, True, True]
  # and the update runs with each
  opt = optirs_jax.muon(1e-3, muon_weight_dimension_numbers={"w1": None,
                                                              "w2": {"a": D(), "b": None}})
  updates, _ = opt.update(params, opt.init(params), params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)


def test_flops_count_the_products():
  # (m <= n after the transpose): 2 m^2 n + 2 m^3 + 2 m^2 n per step and matrix.
  assert flops((3, 5), 1) == 4 * 9 * 5 + 2 * 27
  assert flops((5, 3), 2) == 2 * (4 * 9 * 5 + 2 * 27)
  assert flops((4, 3, 5), 1, D(1, 2)) == 4 * (4 * 9 * 5 + 2 * 27)


@pytest.mark.parametrize("kw, match", [
    ({"ns_coeffs": "fast"}, "not a preset"),
    ({"preconditioning": "qr"}, "not one of"),
    ({"ns_steps": 2.5}, "ns_steps"),
    ({"ns_coeffs": (1.0, 2.0)}, r"shape \(3,\) or \(n, 3\)"),
    ({"ns_coeffs": ((1.0, 2.0, 3.0),) * 4, "ns_steps": 3}, "more than ns_steps"),
    ({"beta": 1.5}, "beta"),
    ({"ns_dtype": jnp.int32}, "ns_dtype"),
])
def test_bad_arguments_name_the_value(kw, match):
  with pytest.raises((ValueError, TypeError), match=match):
    optirs_jax.muon(0.02, **kw)


def test_rank_one_leaf_named_as_a_matrix_fails_clearly():
  opt = optirs_jax.muon(0.02, muon_weight_dimension_numbers={"b": D()})
  params = {"b": jnp.ones(4)}
  with pytest.raises(ValueError, match="rank >= 2"):
    opt.update(params, opt.init(params), params)


def test_coefficients_keep_the_last_rows():
  assert coefficients("standard", 5).shape == (3,)
  assert coefficients("dion", 5).shape == (5, 3)
  assert coefficients("dion", 7).shape == (5, 3)

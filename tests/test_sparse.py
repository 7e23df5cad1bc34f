"""Row-sparse Adam and SGD against numpy references of their stated semantics."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify
from jax.experimental import sparse as jsparse

import optirs_jax
from optirs_jax.sparse import RowSparse, sparse_adam, sparse_sgd, value_and_row_grad

ROWS, WIDTH = 50, 3


class NpSparseAdam:
  """torch.optim.SparseAdam's semantics with optax's eps, and the catch-up decay, in numpy."""

  def __init__(self, p, lr, b1, b2, eps, catch_up):
    self.p = np.array(p, np.float32)
    self.mu, self.nu = np.zeros_like(self.p), np.zeros_like(self.p)
    self.last = np.zeros(len(self.p), np.int64)
    self.t, self.lr, self.b1, self.b2, self.eps, self.catch_up = 0, lr, b1, b2, eps, catch_up

  def step(self, idx, vals):
    self.t += 1
    rows, inv = np.unique(idx, return_inverse=True)
    g = np.zeros((len(rows), *vals.shape[1:]), np.float32)
    np.add.at(g, inv, vals)
    b1, b2, t = np.float32(self.b1), np.float32(self.b2), self.t
    if self.catch_up:
      k = (t - self.last[rows] - 1)[:, None]
      self.mu[rows] *= b1**k
      self.nu[rows] *= b2**k
    self.mu[rows] = b1 * self.mu[rows] + (1 - b1) * g
    self.nu[rows] = b2 * self.nu[rows] + (1 - b2) * g * g
    m_hat = self.mu[rows] / (1 - b1**t)
    v_hat = self.nu[rows] / (1 - b2**t)
    self.p[rows] -= np.float32(self.lr) * m_hat / (np.sqrt(v_hat) + np.float32(self.eps))
    self.last[rows] = t


def _batches(steps, n=12, seed=0):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    idx = rng.integers(0, ROWS // 2, n)  # half the rows: many stay untouched for a while
    idx[1] = idx[0]  # a duplicate in every step
    yield idx.astype(np.int32), rng.standard_normal((n, WIDTH)).astype(np.float32)


@pytest.mark.parametrize("catch_up", [False, True])
@pytest.mark.parametrize("path", ["apply", "update"])
def test_sparse_adam_matches_numpy_reference(catch_up, path):
  p0 = np.random.default_rng(1).standard_normal((ROWS, WIDTH)).astype(np.float32)
  ref = NpSparseAdam(p0, 0.01, 0.9, 0.99, 1e-8, catch_up)
  tx = sparse_adam(0.01, b1=0.9, b2=0.99, catch_up=catch_up)
  params = {"emb": jnp.asarray(p0)}
  state = tx.init(params)

  @jax.jit
  def step(params, state, idx, vals):
    g = {"emb": RowSparse(idx, vals, ROWS)}
    if path == "apply":
      return optirs_jax.apply(tx, g, state, params)
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  touched = set()
  for idx, vals in _batches(15):
    params, state = step(params, state, idx, vals)
    ref.step(idx, vals)
    touched |= set(idx.tolist())
  np.testing.assert_allclose(np.asarray(params["emb"]), ref.p, rtol=2e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(state.mu["emb"]), ref.mu, rtol=2e-6, atol=1e-7)
  untouched = sorted(set(range(ROWS)) - touched)
  assert untouched  # rows never touched are bit for bit as they were
  np.testing.assert_array_equal(np.asarray(params["emb"])[untouched], p0[untouched])
  assert step._cache_size() == 1  # a fixed number of rows compiles once


@pytest.mark.parametrize("name", ["adam", "sgd", "sgd_nesterov"])
def test_every_row_every_step_equals_the_dense_optimizer(name, standard_promotion):
  """Equal to optirs_jax's dense optimizer bit for bit, and to optax's to float32 rounding
  (optax raises b1 to the integer count, optirs_jax to the count as a float)."""
  rng = np.random.default_rng(2)
  params = {"emb": jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32),
            "vec": jnp.asarray(rng.standard_normal(7), jnp.float32)}
  tx, dense, otx = {
      "adam": (sparse_adam(1e-2), optirs_jax.adam(1e-2, backend="jnp"), optax.adam(1e-2)),
      "sgd": (sparse_sgd(0.1, momentum=0.9), optirs_jax.sgd(0.1, momentum=0.9, backend="jnp"),
              optax.sgd(0.1, momentum=0.9)),
      "sgd_nesterov": (sparse_sgd(0.1, momentum=0.9, nesterov=True),
                       optirs_jax.sgd(0.1, momentum=0.9, nesterov=True, backend="jnp"),
                       optax.sgd(0.1, momentum=0.9, nesterov=True)),
  }[name]
  s, ds, os_ = tx.init(params), dense.init(params), otx.init(params)
  p, dp, op = params, params, params
  for _ in range(4):
    g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
    as_rows = {"emb": RowSparse(jnp.arange(ROWS), g["emb"], ROWS), "vec": g["vec"]}
    u, s = tx.update(as_rows, s, p)
    du, ds = dense.update(g, ds, dp)
    ou, os_ = otx.update(g, os_, op)
    chex.assert_trees_all_close(u, du, rtol=0, atol=0)
    chex.assert_trees_all_close(u, ou, rtol=1e-6, atol=1e-9)
    p, dp, op = (optax.apply_updates(p, u), optax.apply_updates(dp, du),
                 optax.apply_updates(op, ou))


def test_catch_up_gives_dense_adams_moments_on_revisited_rows(standard_promotion):
  rng = np.random.default_rng(3)
  params = {"emb": jnp.zeros((ROWS, WIDTH))}
  tx, dense = sparse_adam(1e-2, catch_up=True), optax.adam(1e-2)
  s, ds = tx.init(params), dense.init(params)
  for step, rows in enumerate([[0, 1, 2], [3], [4], [0, 3], [5], [5], [1, 2, 4]]):
    vals = rng.standard_normal((len(rows), WIDTH)).astype(np.float32)
    g = RowSparse(jnp.asarray(rows), jnp.asarray(vals), ROWS)
    _, s = tx.update({"emb": g}, s, params)
    _, ds = dense.update({"emb": g.to_dense()}, ds, params)
    for field in ("mu", "nu"):
      ours = np.asarray(getattr(s, field)["emb"])[rows]
      theirs = np.asarray(getattr(ds[0], field)["emb"])[rows]
      np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=1e-8, err_msg=f"step {step}")


def _inputs(dense: np.ndarray, rows):
  """The same gradient four ways (rows: the present rows, each once)."""
  d = jnp.asarray(dense)
  out = {"RowSparse": RowSparse(jnp.asarray(rows, jnp.int32), d[jnp.asarray(rows)], ROWS),
         "BCOO": jsparse.BCOO.fromdense(d, n_dense=1),
         "BCSR": jsparse.BCSR.fromdense(d)}
  if len(rows) == ROWS:
    out["dense"] = d
  return out


@pytest.mark.parametrize("all_rows", [False, True])
def test_rowsparse_bcoo_bcsr_and_dense_inputs_agree(all_rows):
  rng = np.random.default_rng(4)
  rows = list(range(ROWS)) if all_rows else [1, 4, 7, 30]
  dense = np.zeros((ROWS, WIDTH), np.float32)
  dense[rows] = rng.standard_normal((len(rows), WIDTH)) + 3.0  # no zeros inside a row
  params = {"emb": jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32)}
  results = {}
  for kind, g in _inputs(dense, rows).items():
    for tx in (sparse_adam(1e-2, catch_up=True), sparse_sgd(0.1, momentum=0.9)):
      out = optirs_jax.apply(tx, {"emb": g}, tx.init(params), params)
      results.setdefault(type(out[1]).__name__, {})[kind] = out
  for per_kind in results.values():
    first = next(iter(per_kind.values()))
    for out in per_kind.values():
      chex.assert_trees_all_close(out, first, rtol=0, atol=0)


def test_jit_with_donation_writes_in_place_and_drops_out_of_range_rows():
  tx = sparse_adam(0.1)
  params = {"emb": jnp.zeros((ROWS, WIDTH))}
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p), donate_argnums=(0, 1))
  old = params["emb"]
  g = {"emb": RowSparse(jnp.array([2, ROWS + 5, -1]), jnp.ones((3, WIDTH)), ROWS)}
  params, state = step(params, state, g)  # traced: the indices cannot be checked first
  assert old.is_deleted()  # donated
  changed = np.nonzero(np.any(np.asarray(params["emb"]) != 0, axis=1))[0]
  assert changed.tolist() == [2]  # row 2 only; -1 does not wrap to the last row
  assert np.all(np.asarray(state.mu["emb"])[np.arange(ROWS) != 2] == 0)


def test_checkify_reports_out_of_range_rows_under_jit():
  tx = sparse_adam(0.1, check_indices=True)
  params = {"emb": jnp.zeros((ROWS, WIDTH))}
  step = jax.jit(checkify.checkify(lambda p, s, g: optirs_jax.apply(tx, g, s, p)))
  good = {"emb": RowSparse(jnp.array([1, 2]), jnp.ones((2, WIDTH)), ROWS)}
  bad = {"emb": RowSparse(jnp.array([1, ROWS]), jnp.ones((2, WIDTH)), ROWS)}
  assert step(params, tx.init(params), good)[0].get() is None
  message = step(params, tx.init(params), bad)[0].get()
  assert "leaf ['emb']: a row index is out of range 0..49" in message


@pytest.mark.parametrize("grad, error, match", [
    (RowSparse(jnp.array([3, ROWS]), jnp.ones((2, WIDTH)), ROWS), ValueError,
     r"leaf \['emb'\]: row index 50 is out of range; valid rows are 0..49"),
    (RowSparse(jnp.array([-1]), jnp.ones((1, WIDTH)), ROWS), ValueError, "row index -1"),
    (RowSparse(jnp.array([1.0, 2.0]), jnp.ones((2, WIDTH)), ROWS), TypeError,
     r"leaf \['emb'\]: the row indices have dtype float32; they must be integers"),
    (RowSparse(jnp.array([1, 2]), jnp.ones((2, WIDTH + 1)), ROWS), ValueError,
     r"leaf \['emb'\]: the gradient's rows have shape \(4,\) of 50 rows, but the param has "
     r"shape \(50, 3\)"),
    (RowSparse(jnp.array([1]), jnp.ones((1, WIDTH)), ROWS + 1), ValueError, "of 51 rows"),
    (jnp.ones((ROWS, WIDTH + 1)), ValueError, r"dense gradient has shape \(50, 4\)"),
    (jsparse.BCOO.fromdense(jnp.ones((ROWS, WIDTH))), ValueError, "n_sparse=2; give it row"),
])
def test_bad_gradients_are_rejected_and_change_nothing(grad, error, match):
  params = {"emb": jnp.ones((ROWS, WIDTH))}
  for tx in (sparse_adam(0.1), sparse_sgd(0.1, momentum=0.9)):
    state = tx.init(params)
    before = jax.tree.map(np.asarray, (params, state))
    with pytest.raises(error, match=match):
      optirs_jax.apply(tx, {"emb": grad}, state, params)
    with pytest.raises(error, match=match):
      tx.update({"emb": grad}, state, params)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, (params, state)), before)


def test_partially_filled_bcsr_rows_are_rejected():
  dense = jnp.zeros((ROWS, WIDTH)).at[3].set(1.0).at[5, 0].set(2.0)
  with pytest.raises(ValueError, match="not a whole number of rows"):
    sparse_adam(0.1).update({"emb": jsparse.BCSR.fromdense(dense)}, sparse_adam(0.1).init(
        {"emb": dense}), {"emb": dense})
  dense = jnp.zeros((ROWS, WIDTH)).at[3].set(1.0).at[5, :2].set(2.0).at[6, 2].set(1.0)
  with pytest.raises(ValueError, match="BCSR row 5 holds 2 of 3 entries"):
    sparse_sgd(0.1).update({"emb": jsparse.BCSR.fromdense(dense)}, sparse_sgd(0.1).init(
        {"emb": dense}), {"emb": dense})


def test_sparse_sgd_lazy_momentum_against_numpy():
  rng = np.random.default_rng(5)
  p = rng.standard_normal((ROWS, WIDTH)).astype(np.float32)
  trace = np.zeros_like(p)
  ref = p.copy()
  tx = sparse_sgd(0.1, momentum=0.9, nesterov=True)
  params = {"emb": jnp.asarray(p)}
  state = tx.init(params)
  for idx, vals in _batches(8, seed=6):
    params, state = optirs_jax.apply(tx, {"emb": RowSparse(idx, vals, ROWS)}, state, params)
    rows, inv = np.unique(idx, return_inverse=True)
    g = np.zeros((len(rows), WIDTH), np.float32)
    np.add.at(g, inv, vals)
    trace[rows] = g + np.float32(0.9) * trace[rows]  # only present rows decay
    ref[rows] -= np.float32(0.1) * (g + np.float32(0.9) * trace[rows])
  np.testing.assert_allclose(np.asarray(params["emb"]), ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(state.trace["emb"]), trace, rtol=1e-6, atol=1e-6)


def test_value_and_row_grad_equals_the_dense_gradient_without_forming_it():
  rng = np.random.default_rng(7)
  table = jnp.asarray(rng.standard_normal((1000, 8)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((8, 2)), jnp.float32)
  ids = jnp.array([[3, 7, 3], [999, 0, 7]])

  def dense_loss(table, ids, w):
    return jnp.sum(jnp.tanh(table[ids] @ w) ** 2)

  def row_loss(rows, ids, w):
    return jnp.sum(jnp.tanh(rows @ w) ** 2)

  fn = value_and_row_grad(row_loss, 0, 1, argnums=(2,))
  (value, (g_table, g_w)) = fn(table, ids, w)
  ref_value, (ref_table, ref_w) = jax.value_and_grad(dense_loss, argnums=(0, 2))(table, ids, w)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  np.testing.assert_allclose(g_table.to_dense(), ref_table, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(g_w, ref_w, rtol=1e-5)
  assert g_table.indices.tolist() == [3, 7, 3, 999, 0, 7]
  # No intermediate of the table's size: the gradient program only touches looked-up rows.
  jaxpr = jax.make_jaxpr(fn)(table, ids, w).jaxpr
  shapes = [v.aval.shape for eqn in jaxpr.eqns for v in eqn.outvars]
  assert table.shape not in shapes


def test_out_of_range_ids_follow_one_rule_in_the_forward_pass_and_the_update():
  """Eagerly an out-of-range id is an error; under jit its row reads as zeros and its
  gradient is dropped, so forward and update agree (a numpy model of the valid ids)."""
  rng = np.random.default_rng(8)
  table = jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32)
  weights = 1.0 + np.arange(WIDTH, dtype=np.float32)
  loss = lambda rows, ids: jnp.sum(jnp.sin(rows) * jnp.asarray(weights)[None])
  fn = value_and_row_grad(loss, 0, 1)
  for bad in (-1, ROWS):
    with pytest.raises(ValueError, match=rf"id {bad} \(at flat position 1, one of 1 out of "
                                         rf"range\) is not a row of the table: valid ids are "
                                         rf"0..{ROWS - 1}"):
      fn(table, jnp.array([4, bad, 9]))
  tx = sparse_adam(0.1)

  @jax.jit
  def step(table, state, ids):
    value, g = fn(table, ids)
    table, state = optirs_jax.apply(tx, g, state, table)
    return table, state, value

  ids = jnp.array([4, -1, 9, ROWS])
  new, _, value = step(table, tx.init(table), ids)
  rows = np.asarray(table)[[4, 9]]
  np.testing.assert_allclose(value, np.sum(np.sin(rows) * weights), rtol=1e-6)  # zeros read
  ref = NpSparseAdam(table, 0.1, 0.9, 0.999, 1e-8, catch_up=False)
  ref.step(np.array([4, 9]), np.cos(rows) * weights)  # XLA's and numpy's cos differ by ulps
  np.testing.assert_allclose(new, ref.p, rtol=1e-5, atol=1e-6)  # the last row untouched


def test_flax_embedding_model_trains_with_row_gradients(standard_promotion):
  nn = pytest.importorskip("flax.linen")

  class Tower(nn.Module):
    @nn.compact
    def __call__(self, rows):  # rows: [batch, 2, dim] (user, item)
      return nn.Dense(1)(rows.reshape(rows.shape[0], -1))[:, 0]

  rng = np.random.default_rng(8)
  num, dim = 500, 8
  ids = jnp.asarray(rng.integers(0, num, (64, 2)), jnp.int32)
  target = jnp.asarray(rng.standard_normal(64), jnp.float32)
  tower = Tower()
  params = {"table": jnp.asarray(rng.standard_normal((num, dim)) * 0.1, jnp.float32),
            "tower": tower.init(jax.random.key(0), jnp.zeros((1, 2, dim)))}

  def loss(rows, ids, tower_params):
    return jnp.mean((tower.apply(tower_params, rows) - target) ** 2)

  tx_rows, tx_dense = sparse_adam(1e-2), optax.adam(1e-2)
  s_rows, s_dense = tx_rows.init({"t": params["table"]}), tx_dense.init(params["tower"])
  grad_fn = jax.jit(value_and_row_grad(loss, 0, 1, argnums=(2,)))
  losses = []
  for _ in range(100):
    value, (g_table, g_tower) = grad_fn(params["table"], ids, params["tower"])
    table, s_rows = optirs_jax.apply(tx_rows, {"t": g_table}, s_rows, {"t": params["table"]})
    u, s_dense = tx_dense.update(g_tower, s_dense, params["tower"])
    params = {"table": table["t"], "tower": optax.apply_updates(params["tower"], u)}
    losses.append(float(value))
  assert losses[-1] < 0.5 * losses[0]


def test_arguments_are_checked_and_extra_args_ignored():
  with pytest.raises(ValueError, match=r"b1=1.0 must be in \[0, 1\)"):
    sparse_adam(0.1, b1=1.0)
  with pytest.raises(TypeError, match="catch_up=1 must be True or False"):
    sparse_adam(0.1, catch_up=1)
  with pytest.raises(ValueError, match="nesterov=True needs a momentum"):
    sparse_sgd(0.1, nesterov=True)
  with pytest.raises(ValueError, match="params are required"):
    sparse_adam(0.1).update({"e": jnp.ones((2, 2))}, sparse_adam(0.1).init({"e": jnp.ones((2, 2))}))
  with pytest.raises(ValueError, match="table_argnum and ids_argnum must differ"):
    value_and_row_grad(lambda r: r, 0, 0)
  tx = sparse_adam(optax.linear_schedule(0.1, 0.0, 10))
  params = {"e": jnp.ones((4, 2))}
  u, s = tx.update({"e": RowSparse(jnp.array([1]), jnp.ones((1, 2)), 4)}, tx.init(params),
                   params, value=jnp.float32(1.0))
  assert u["e"].shape == (4, 2) and int(s.count) == 1
  with pytest.raises(ValueError, match=r"state leaf \['e'\] \(mu\) has shape \(4, 2\)"):
    tx.update({"e": jnp.ones((5, 2))}, s, {"e": jnp.ones((5, 2))})


@pytest.mark.parametrize("tx", [sparse_adam(0.1, catch_up=True), sparse_sgd(0.1, momentum=0.9)],
                         ids=["adam-catch-up", "sgd-momentum"])
def test_donated_apply_copies_no_table(tx):
  """The lazy path scatters into the donated params and state: XLA copies no buffer of the
  table's size (a copy would read and write every row)."""
  params = {"emb": jnp.zeros((100_000, 16))}
  g = {"emb": RowSparse(jnp.arange(32), jnp.ones((32, 16)), 100_000)}
  step = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p), donate_argnums=(0, 1))
  text = step.lower(params, tx.init(params), g).compile().as_text()
  copies = [line for line in text.splitlines() if " copy(" in line and "100000" in line]
  assert not copies, copies

"""Lazy (row-sparse) Adam and SGD: only the rows a gradient holds are read and written."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.experimental import checkify

from optirs_jax.pallas.op import Hyper
from optirs_jax.sparse._rowsparse import (
  as_row_sparse,
  coalesce,
  is_sparse,
  out_of_range_to_sentinel,
)
from optirs_jax.transforms._checks import (
  check_flag,
  check_number,
  check_number_or_schedule,
  check_unit_interval,
  structure_mismatch,
)
from optirs_jax.transforms._checks import learning_rate as lr_at
from optirs_jax.transforms.adam import adam_rule, adam_scalars
from optirs_jax.transforms.sgd import sgd_rule


class SparseAdamState(NamedTuple):
  """State of :func:`sparse_adam`: moments shaped like the params, and with ``catch_up``
  the step each row was last updated at (``int32[num_rows]`` per leaf; else ``None``)."""

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  last_seen: Any


class SparseSgdState(NamedTuple):
  """State of :func:`sparse_sgd`: the step count (for schedules) and the momentum buffer
  (``None`` without momentum)."""

  count: jax.Array
  trace: Any


def _leaves(fn: str, grads, params):
  """Per leaf: (path, param, RowSparse gradient, rows known unique)."""
  if params is None:
    raise ValueError(f"{fn}: params are required (the row-sparse update reads and writes "
                     "rows of the params' shapes)")
  p_with_paths, p_def = jax.tree_util.tree_flatten_with_path(params)
  g_leaves, g_def = jax.tree.flatten(grads, is_leaf=is_sparse)
  if g_def != p_def:
    paths = [jax.tree_util.keystr(kp) or "<root>" for kp, _ in p_with_paths]
    raise ValueError(structure_mismatch(fn, "the gradients", grads, paths, "params", p_def,
                                        is_leaf=is_sparse))
  out = []
  for (kp, p), g in zip(p_with_paths, g_leaves):
    path = jax.tree_util.keystr(kp) or "<root>"
    if not jnp.issubdtype(p.dtype, jnp.floating):
      raise TypeError(f"{fn}: params leaf {path} has dtype {p.dtype}; it must be floating")
    rs, unique = as_row_sparse(fn, path, g, p)
    out.append((path, p, rs, unique))
  return out, p_def


def _rows(g, unique: bool, check: bool, path: str):
  if check:
    checkify.check(jnp.all((g.indices >= 0) & (g.indices < g.num_rows)),
                   f"leaf {path}: a row index is out of range 0..{g.num_rows - 1}")
  if unique:
    return out_of_range_to_sentinel(g.indices, g.num_rows).astype(jnp.int32), g.values
  return coalesce(g)


def _get(x, rows):
  return x.at[rows].get(mode="fill", fill_value=0)


def _check_state(fn: str, what: str, leaves, state_leaves, tree=None):
  if len(state_leaves) != len(leaves):
    paths = [path for path, *_ in leaves]
    if tree is not None:
      raise ValueError(structure_mismatch(fn, f"state.{what}", tree, paths, "params"))
    raise ValueError(f"{fn}: the state's {what} has {len(state_leaves)} leaves but the params "
                     f"have {len(leaves)}; it was made by init() for other params")
  for (path, p, _, _), s in zip(leaves, state_leaves):
    if s.shape != p.shape:
      raise ValueError(f"{fn}: state leaf {path} ({what}) has shape {s.shape} but the param "
                       f"has shape {p.shape}")


def _finish(leaves, treedef, results, fused: bool):
  """Dense updates (zero in untouched rows) or, fused, the params with the rows written."""
  out = []
  for (_, p, _, _), (rows, u_rows) in zip(leaves, results):
    if fused:
      new = (_get(p, rows) + u_rows).astype(p.dtype)
      out.append(p.at[rows].set(new, mode="drop"))
    else:
      out.append(jnp.zeros(p.shape, u_rows.dtype).at[rows].set(u_rows, mode="drop"))
  return jax.tree.unflatten(treedef, out)


def _with_fused(update):
  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    return update(updates, state, params, False)

  update_fn.fused_apply = lambda grads, state, params: update(grads, state, params, True)
  return update_fn


def _per_row(factor, like):
  return factor.reshape(factor.shape + (1,) * (like.ndim - 1)).astype(like.dtype)


def sparse_adam(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
                eps: float = 1e-8, *, catch_up: bool = False, check_indices: bool = False
                ) -> optax.GradientTransformationExtraArgs:
  r"""Lazy Adam for row-sparse gradients (``torch.optim.SparseAdam``'s semantics).

  Only the rows present in the gradient update their moments and their params; the bias
  correction uses the global step count :math:`t`:

  .. math::
    m_r \leftarrow \beta_1 m_r + (1-\beta_1) g_r,\quad
    v_r \leftarrow \beta_2 v_r + (1-\beta_2) g_r^2,\quad
    u_r = -\eta\,\frac{m_r / (1-\beta_1^t)}{\sqrt{v_r / (1-\beta_2^t)} + \epsilon}

  for each present row :math:`r` (duplicate indices are summed first). The ``eps`` is
  optax's (added to :math:`\sqrt{\hat v}`), so with every row present every step this is
  ``optax.adam`` exactly; torch's SparseAdam adds ``eps`` to :math:`\sqrt{v}` before the
  bias correction, i.e. scales it by :math:`1/\sqrt{1-\beta_2^t}`.

  With ``catch_up=True`` (the seed's dormancy decay) a row last updated at step :math:`s`
  and present again at step :math:`t` first has its moments multiplied by
  :math:`\beta_1^{t-s-1}` and :math:`\beta_2^{t-s-1}`: the moments a dense Adam, which
  sees zero gradients in between, would hold. The params are not caught up.

  Gradients: :class:`RowSparse`, ``jax.experimental.sparse.BCOO`` with row indices
  (``n_sparse=1``), ``BCSR`` holding whole rows, or dense arrays (all rows present), leaf by
  leaf. ``update`` returns dense updates (zero in untouched rows) so ``optax.apply_updates``
  works; :func:`optirs_jax.apply` is the lazy path: it writes only the present rows of the
  params and the state (in place when donated). Indices out of range are an error when they
  are concrete; under ``jit`` they cannot be checked before the step runs, and their rows are
  dropped (nothing is written out of bounds), unless ``check_indices=True`` and the step is
  wrapped in ``jax.experimental.checkify.checkify``, which then reports them.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> from optirs_jax.sparse import RowSparse, sparse_adam
    >>> params = {"emb": jnp.zeros((1000, 8))}
    >>> tx = sparse_adam(1e-2)
    >>> state = tx.init(params)
    >>> grads = {"emb": RowSparse(jnp.array([3, 7]), jnp.ones((2, 8)), num_rows=1000)}
    >>> params, state = optirs_jax.apply(tx, grads, state, params)
    >>> [round(v, 4) for v in params["emb"][jnp.array([3, 4, 7]), 0].tolist()]
    [-0.01, 0.0, -0.01]
  """
  fn = "sparse_adam"
  lr = learning_rate
  check_number_or_schedule(fn, "learning_rate", lr)
  check_unit_interval(fn, "b1", b1)
  check_unit_interval(fn, "b2", b2)
  check_number(fn, "eps", eps)
  check_flag(fn, "catch_up", catch_up)
  check_flag(fn, "check_indices", check_indices)

  def init_fn(params):
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    last = (jax.tree.map(lambda p: jnp.zeros(p.shape[:1], jnp.int32), params) if catch_up
            else None)
    return SparseAdamState(jnp.zeros([], jnp.int32), zeros(), zeros(), last)

  def update(grads, state, params, fused):
    leaves, treedef = _leaves(fn, grads, params)
    mus, nus = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
    _check_state(fn, "mu", leaves, mus, state.mu)
    _check_state(fn, "nu", leaves, nus, state.nu)
    lasts = jax.tree.leaves(state.last_seen) if catch_up else [None] * len(leaves)
    count_inc = optax.safe_increment(state.count)
    neg_lr, cast_lr = lr_at(lr, state.count)
    h = Hyper(adam_scalars(dict(b1=b1, b2=b2, eps=eps, eps_root=0.0), state.count),
              neg_lr=neg_lr, wd=0.0)
    results, new_mu, new_nu, new_last = [], [], [], []
    for (path, _, g, unique), mu, nu, last in zip(leaves, mus, nus, lasts):
      rows, vals = _rows(g, unique, check_indices, path)
      mu_r, nu_r = _get(mu, rows), _get(nu, rows)
      if catch_up:
        last_r = _get(last, rows)
        k = (count_inc - last_r - 1).astype(jnp.float32)
        mu_r = mu_r * _per_row(jnp.float32(b1) ** k, mu_r)
        nu_r = nu_r * _per_row(jnp.float32(b2) ** k, nu_r)
        # max(last_r, t) is t; writing it makes the scatter wait for the gather, so XLA
        # updates the donated buffer in place instead of copying it first.
        new_last.append(last.at[rows].set(jnp.maximum(last_r, count_inc), mode="drop"))
      u_r, mu_r, nu_r = adam_rule(h, vals, p=None, mu=mu_r, nu=nu_r, nesterov=False,
                                        decay=False, scale=True, cast_lr=cast_lr)
      new_mu.append(mu.at[rows].set(mu_r.astype(mu.dtype), mode="drop"))
      new_nu.append(nu.at[rows].set(nu_r.astype(nu.dtype), mode="drop"))
      results.append((rows, u_r))
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    new_state = SparseAdamState(count_inc, unflat(new_mu), unflat(new_nu),
                                unflat(new_last) if catch_up else None)
    return _finish(leaves, treedef, results, fused), new_state

  return optax.GradientTransformationExtraArgs(init_fn, _with_fused(update))


def sparse_sgd(learning_rate: optax.ScalarOrSchedule, momentum: float | None = None,
               nesterov: bool = False, *, check_indices: bool = False
               ) -> optax.GradientTransformationExtraArgs:
  r"""Lazy SGD, with optional (Nesterov) momentum, for row-sparse gradients.

  For each present row :math:`r` (duplicates summed):

  .. math::
    t_r \leftarrow g_r + \mu\,t_r,\qquad u_r = -\eta\,(g_r + \mu\,t_r \text{ if nesterov
    else } t_r)

  (``optax.sgd``'s rule); without momentum :math:`u_r = -\eta g_r`. The momentum is lazy
  too: only present rows decay and update theirs (torch's SGD on sparse gradients keeps a
  dense buffer that decays everywhere). With every row present every step it is
  ``optax.sgd`` exactly. Inputs, outputs and index checks as :func:`sparse_adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> from optirs_jax.sparse import RowSparse, sparse_sgd
    >>> tx = sparse_sgd(0.5, momentum=0.9)
    >>> params = {"emb": jnp.ones((4, 2))}
    >>> g = {"emb": RowSparse(jnp.array([1, 1]), jnp.ones((2, 2)), num_rows=4)}
    >>> params, state = optirs_jax.apply(tx, g, tx.init(params), params)
    >>> params["emb"][:, 0]
    Array([1., 0., 1., 1.], dtype=float32)
  """
  fn = "sparse_sgd"
  lr = learning_rate
  check_number_or_schedule(fn, "learning_rate", lr)
  check_number(fn, "momentum", momentum, allow_none=True)
  check_flag(fn, "nesterov", nesterov)
  check_flag(fn, "check_indices", check_indices)
  if nesterov and momentum is None:
    raise ValueError(f"{fn}: nesterov=True needs a momentum")

  def init_fn(params):
    trace = jax.tree.map(jnp.zeros_like, params) if momentum is not None else None
    return SparseSgdState(jnp.zeros([], jnp.int32), trace)

  def update(grads, state, params, fused):
    leaves, treedef = _leaves(fn, grads, params)
    traces = [None] * len(leaves)
    if momentum is not None:
      traces = jax.tree.leaves(state.trace)
      _check_state(fn, "trace", leaves, traces, state.trace)
    neg_lr, cast_lr = lr_at(lr, state.count)
    h = Hyper(neg_lr=neg_lr, momentum=momentum)
    results, new_traces = [], []
    for (path, _, g, unique), tr in zip(leaves, traces):
      rows, vals = _rows(g, unique, check_indices, path)
      if tr is None:
        (u_r,) = sgd_rule(h, vals, p=None, trace=None, nesterov=False, cast_lr=cast_lr)
      else:
        u_r, t_r = sgd_rule(h, vals, p=None, trace=_get(tr, rows), nesterov=nesterov,
                                  cast_lr=cast_lr)
        new_traces.append(tr.at[rows].set(t_r.astype(tr.dtype), mode="drop"))
      results.append((rows, u_r))
    trace = jax.tree.unflatten(treedef, new_traces) if momentum is not None else None
    new_state = SparseSgdState(optax.safe_increment(state.count), trace)
    return _finish(leaves, treedef, results, fused), new_state

  return optax.GradientTransformationExtraArgs(init_fn, _with_fused(update))

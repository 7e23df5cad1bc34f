"""Factored second moments (:class:`optirs_jax.spec.Factored`, Adafactor's): the state of
row and column statistics, checked against the tree, and a factored leaf's first pass.

A factored leaf's statistics are row and column means of ``|g|^2``: reductions along an
axis, which XLA's reduction emitter computes at the bandwidth limit and an elementwise
kernel cannot express. Its first pass (:attr:`~optirs_jax.spec.Factored.precondition`) and
its sums of squares therefore run in jnp, and the reduction's second pass on the reference,
where XLA fuses the preconditioned gradient into it instead of writing it out. The leaves
that are not factored (vectors, small matrices) run the spec's rule in the kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optirs_jax import rules
from optirs_jax.spec import NotFused, OptimizerSpec
from optirs_jax.transforms import _checks as c


def _without(x, axis: int):
  """Zeros shaped (and, under sharding in types, sharded) like ``x`` without ``axis`` (as
  optax's ``_zeros_like_no_axis``)."""
  return jnp.zeros_like(jax.eval_shape(lambda x: jnp.sum(x, axis=axis), x))


def init(spec: OptimizerSpec, options, params) -> dict:
  """The factored fields' initial trees: per leaf, the row and column statistics (or
  ``zeros((1,))``) and the unfactored statistics (or ``zeros((1,))``), in its dtype."""
  fac = spec.factored
  one = lambda x: jnp.zeros((1,), x.dtype)

  def leaf(x):
    dims = fac.dims(options, x.shape)
    if dims is None:
      return one(x), one(x), jnp.zeros_like(x)
    d1, d0 = dims
    return _without(x, d0), _without(x, d1), one(x)

  leaves, treedef = jax.tree.flatten(params)
  per_leaf = [leaf(x) for x in leaves]
  return {name: jax.tree.unflatten(treedef, [t[k] for t in per_leaf])
          for k, name in enumerate((fac.row, fac.col, fac.full))}


def columns(fn: str, spec: OptimizerSpec, options, state, g, paths, treedef):
  """``(dims per leaf, {field: leaves})`` of the factored fields of ``state``, each leaf
  checked to have the shape this leaf's statistics take (errors name the leaf)."""
  fac = spec.factored
  dims = [fac.dims(options, x.shape) for x in g]
  out = {}
  for name in (fac.row, fac.col, fac.full):
    leaves, tdef = jax.tree.flatten(getattr(state, name))
    if tdef != treedef:
      raise ValueError(c.structure_mismatch(fn, f"state.{name}", getattr(state, name), paths,
                                            "updates", treedef))
    for x, ref, d, path in zip(leaves, g, dims, paths):
      want = _shape(fac, name, ref.shape, d)
      if getattr(x, "shape", None) != want:
        raise ValueError(f"{fn}: state.{name} leaf {path} has shape {getattr(x, 'shape', None)}"
                         f" but the updates leaf of shape {ref.shape} keeps it as {want}")
    out[name] = leaves
  return dims, out


def _shape(fac, name: str, shape, dims) -> tuple[int, ...]:
  if dims is None:
    return tuple(shape) if name == fac.full else (1,)
  if name == fac.full:
    return (1,)
  drop = dims[1] if name == fac.row else dims[0]
  return tuple(n for k, n in enumerate(shape) if k != drop)


def first_pass(spec: OptimizerSpec, h, g, p, row, col, dims, *, full_dtype):
  """A factored leaf's ``(r, new row, new col, new full placeholder, norms)``: its
  preconditioned gradient, statistics, and the norms (or mean squares) its reduction asks
  for (inputs ``g`` or ``p``, then the output ``u``)."""
  with jax.numpy_dtype_promotion("standard"):
    r, new_row, new_col = spec.factored.precondition(h, g, row=row, col=col, dims=dims)
    named = {"g": g, "p": p, "u": r}
    red = spec.reduction
    reduce = (lambda x: jnp.mean(rules.abs_sq(x))) if red.means else (
        lambda x: jnp.sqrt(jnp.sum(rules.abs_sq(x))))
    values = tuple(reduce(named[x]) for x in (*red.inputs, *red.outputs))
  return r, new_row, new_col, jnp.zeros((1,), full_dtype), values


def check_plain(fn: str, *, master, inv_scale, finite, prologue) -> None:
  """Factored leaves take no folded links, loss scaling or master weights: NotFused, and
  the callers fall back to ``update`` then ``apply_updates``."""
  if master is not None or inv_scale is not None or finite is not None or prologue:
    raise NotFused(f"{fn} keeps factored statistics in XLA: links, loss scaling and master "
                   "weights are not folded in")

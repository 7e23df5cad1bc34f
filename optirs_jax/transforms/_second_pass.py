"""A reduction's second pass (:class:`optirs_jax.spec.Reduction`): the scalar step between
the passes, per leaf, and the elementwise finish through the executors."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from optirs_jax.pallas.dispatch import execute
from optirs_jax.pallas.op import ElementwiseOp
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.pallas.sharding import varying_axes
from optirs_jax.spec import BoundRule, OptimizerSpec


@dataclasses.dataclass(frozen=True)
class Rerun:
  """How the second pass reruns the spec's rule on the gradient (where the first only
  measured): the rule's static keywords (``decay`` is added per leaf where the spec has
  weight decay), and what the first pass did to the gradient before it (the unscale, the
  optax links)."""

  static: tuple
  unscale: bool
  prologue: tuple


@dataclasses.dataclass(frozen=True)
class _WithNorms:
  """A reduction's ``finish`` as a rule ``(h, r, *, p, cast_lr, <fields>) -> (update,
  *fields)``: the leaf's norms are the per-leaf scalars ``h.norm_0``, ``h.norm_1``, ...;
  with ``rule`` (and its static keywords), ``r`` is the gradient the rule first makes the
  update of."""

  finish: Any
  n: int
  has_fields: bool = False
  rule: Any = None
  rule_static: tuple = ()

  def __call__(self, h, g, *, p, cast_lr, **fields_and_static):
    if self.rule is not None:
      g = self.rule(h, g, p=p, cast_lr=cast_lr, **dict(self.rule_static))[0]
    out = self.finish(h, g, p, *(h[f"norm_{k}"] for k in range(self.n)), cast_lr=cast_lr,
                      **fields_and_static)
    return tuple(out) if self.has_fields else (out,)


def finish_op(spec: OptimizerSpec, n_norms: int, late: tuple, *, fused: bool, master: bool,
              guard: bool, rounding: bool, param_rounding: bool, cast_lr: bool,
              masked: bool | None = None, static: tuple = (), rerun: Rerun | None = None,
              decay: bool = False) -> ElementwiseOp:
  """The reduction's second pass as an elementwise op over ``(r, *late fields, p[,
  p_low])``: the update, or on the fused apply the new params in place (and the new master),
  and the late fields in place, with the guard and the rounding (of the late fields and of
  the new params); the norms are per-leaf scalars. ``static``: the reduction's own static
  keywords, as ``(name, value)`` pairs. With ``rerun``, ``r`` is the gradient (``decay``:
  the leaf's weight decay flag)."""
  names = tuple(f.name for f in late)
  static = (("cast_lr", cast_lr),) + ((("masked", masked),) if masked is not None else ()) + (
      tuple(static))
  with_norms = _WithNorms(spec.reduction.finish, n_norms, bool(names))
  links = dict(unscale=False, prologue=())
  if rerun is not None:
    rule_static = rerun.static + ((("decay", decay),) if spec.weight_decay else ())
    with_norms = dataclasses.replace(with_norms, rule=spec.rule,
                                     rule_static=tuple(sorted(rule_static)))
    links = dict(unscale=rerun.unscale, prologue=rerun.prologue)
  rule = BoundRule(with_norms, names, True, static, apply=fused and not master, master=master,
                   guard=guard, rounding=rounding and bool(names),
                   param_rounding=param_rounding, **links)
  n = len(names)
  aliases = tuple((1 + k, 1 + k) for k in range(n))  # the late fields in place
  if master:  # (r, *fields, master, p_low) -> (p_low, *fields, master)
    aliases += ((2 + n, 0), (1 + n, 1 + n))
  else:  # (r, *fields, p) -> the new params in p's buffer, or the update in r's
    aliases += ((1 + n, 0),) if fused else ((0, 0),)
  pads = (0.0, *(f.pad for f in late)) + (0.0,) * (1 + master)
  return ElementwiseOp(rule, rule.hyper(spec.hyper), pads, aliases, name=f"{spec.name}_finish",
                       indexed=rule.indexed, mixed_on_kernels=rule.widens_mixed,
                       leaf_hyper=tuple(f"norm_{k}" for k in range(n_norms)),
                       unguarded=rule.unguarded())


def between(between, h, norms, leafwise, leaf_columns, *, guard: bool):
  """A reduction's scalar step between its passes, per leaf: the values its finish reads in
  place of the norms, and the new per-leaf fields (in their dtypes; kept on a skipped
  step)."""
  values = []
  new = [[None] * len(norms) for _ in leafwise]
  for i, leaf_norms in enumerate(norms):
    with jax.numpy_dtype_promotion("standard"):
      v, fresh = between(h, *leaf_norms, **{f.name: col[i] for f, col in zip(leafwise,
                                                                              leaf_columns)})
    values.append(tuple(v))
    for k, (x, col) in enumerate(zip(fresh, leaf_columns)):
      x = jnp.asarray(x).astype(col[i].dtype)
      new[k][i] = jnp.where(jnp.asarray(h.finite) > 0, x, col[i]) if guard else x
  return values, new


def finish(spec: OptimizerSpec, h, first, weights, p, m, norms, uses_master, late,
           late_columns, masked, *, fused: bool, guard: bool, rounding: bool,
           param_rounding: bool, cast_lr: bool, backend: str, options: ExecutorOptions,
           static: tuple = (), on_reference=None, rerun: Rerun | None = None, decays=None):
  """The reduction's second pass, one elementwise op per variant (with or without a master
  copy; masked or not) through the executors: on the GPU one grouped launch reads each
  leaf's norms from its hyper-parameter vector; on the reference XLA fuses it per leaf.
  ``on_reference[i]``: leaf ``i`` runs on the reference whatever ``backend`` says (a
  factored leaf, whose first output XLA then fuses in). ``rerun``: ``first`` holds the
  gradients, which the rule makes updates of first (``decays[i]``: leaf ``i``'s weight
  decay flag). Returns the updates (or new params), the new masters and the ``late``
  fields' columns."""
  on_reference = on_reference or [False] * len(first)
  decays = decays if rerun is not None else [False] * len(first)
  outs: list[Any] = [None] * len(first)
  masters = list(m) if m is not None else None
  late_out = [[None] * len(first) for _ in late_columns]
  n_norms = len(norms[0]) if norms else 0  # the norms, or what between() made of them
  # Inside a shard_map a leaf's norms vary over the axes its shards do (unless summed over
  # them): leaves whose norms vary alike share one array of norms, so a replicated leaf's
  # update stays replicated.
  kinds = [frozenset().union(*(varying_axes(x) for x in norms[i])) for i in range(len(first))]
  keys = list(zip(uses_master, kinds, masked, on_reference, decays))
  for key in sorted(set(keys), key=lambda v: (v[0], sorted(v[1]), *v[2:])):
    in_master, _, mask, ref, decay = key
    idx = [i for i in range(len(first)) if keys[i] == key]
    op = finish_op(spec, n_norms, late, fused=fused, master=in_master, guard=guard,
                   rounding=rounding, param_rounding=fused and param_rounding, cast_lr=cast_lr,
                   masked=mask if spec.reduction.mask is not None else None, static=static,
                   rerun=rerun, decay=decay)
    leaves = [(first[i], *(col[i] for col in late_columns), weights[i])
              + ((p[i],) if in_master else ()) for i in idx]
    # One row of norms per leaf, in the widest of their dtypes (float64 norms of float64
    # leaves stay exact; float32 ones convert back exactly).
    with jax.numpy_dtype_promotion("standard"):
      dtype = jnp.result_type(*(x for i in idx for x in norms[i]))
    values = [tuple(norms[i][k].astype(dtype) for k in range(n_norms)) for i in idx]
    o, _ = execute(op, h, leaves, backend="jnp" if ref else backend, options=options,
                   fused_apply=fused,
                   leaf_values=values)
    for j, i in enumerate(idx):
      outs[i] = o[j][0]
      for k in range(len(late_columns)):
        late_out[k][i] = o[j][1 + k]
      if in_master:
        masters[i] = o[j][-1]
  return outs, masters, late_out

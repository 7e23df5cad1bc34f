"""The one builder: an optax transformation, its reference, kernels and fused apply from a spec.

:func:`build` checks the optimizer's arguments by the kinds its spec declares, and returns
an :class:`optax.GradientTransformationExtraArgs` whose ``update`` flattens the trees,
checks them (errors name the leaf's key path), computes this step's scalars as optax does,
and runs the spec's rule through :func:`optirs_jax.pallas.dispatch.execute` (the jnp
reference or the Pallas kernels, chosen per platform at lowering time). The fused apply
path (:func:`optirs_jax.apply`) is the same step with the rule returning ``p + u``: it
hangs on ``update.fused_apply``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optirs_jax.pallas.dispatch import check_pallas_dtypes, execute
from optirs_jax.pallas.op import ElementwiseOp, Hyper
from optirs_jax.spec import BoundRule, OptimizerSpec
from optirs_jax.transforms import _checks as c

# What each kind of argument a spec declares must be.
_CHECKS = {
    "schedule": c.check_number_or_schedule,
    "number": c.check_number,
    "optional number": lambda fn, name, v: c.check_number(fn, name, v, allow_none=True),
    "flag": c.check_flag,
    "dtype": None,  # canonicalized below
    "mask": None,  # a tree of bools, a callable or None: checked against the tree in update
}


def _check_arguments(fn: str, spec: OptimizerSpec, arguments: Mapping[str, Any]) -> dict:
  options = {}
  for name, kind in spec.arguments:
    value = arguments[name]
    if kind == "dtype":
      value = c.canonical_dtype(fn, name, value)
    elif _CHECKS[kind] is not None:
      _CHECKS[kind](fn, name, value)
    options[name] = value
  if spec.validate is not None:
    spec.validate(fn, options)
  return options


def build(spec: OptimizerSpec, arguments: Mapping[str, Any]) -> optax.GradientTransformationExtraArgs:
  """The optimizer ``spec`` describes, with ``arguments`` (its public function's arguments,
  ``backend`` and ``executor_options`` included)."""
  fn = f"optirs_jax.{spec.name}"
  options = _check_arguments(fn, spec, arguments)
  backend = c.check_backend(fn, arguments["backend"])
  executor_options = c.check_executor_options(fn, arguments["executor_options"])
  fields = tuple(f for f in spec.fields if f.exists(options))
  names = tuple(f.name for f in fields)

  def init_fn(params):
    c.flatten(fn, "params", params)

    def init(field):
      value = options[field.init] if isinstance(field.init, str) else field.init
      dtype = options.get(field.dtype) if field.dtype else None
      return optax.tree.full_like(params, value, dtype=dtype)

    return spec.state(count=jnp.zeros([], jnp.int32),
                      **{f.name: init(f) if f.exists(options) else None for f in spec.fields})

  def step(updates, state, params, fused: bool):
    g, paths, treedef = c.flatten(fn, "updates", updates)
    columns = [c.match(fn, f"state.{f.name}", getattr(state, f.name), treedef, g, paths)
               for f in fields]
    p = None if params is None else c.match(fn, "params", params, treedef, g, paths)
    count = state.count
    neg_lr, cast_lr = c.learning_rate(options["learning_rate"], count)
    wd, has_decay = (c.weight_decay_value(options["weight_decay"], count)
                     if spec.weight_decay else (0.0, False))
    if p is None and (fused or has_decay or spec.reads_params or spec.reduction):
      raise ValueError(f"{fn}: this transformation needs the params: call "
                       "update(updates, state, params)")
    h = Hyper(spec.scalars(options, count), neg_lr=neg_lr, wd=wd)
    decays = (c.mask_flags(fn, options["mask"], updates, treedef) if has_decay
              else [False] * len(g))
    outs: list[Any] = [None] * len(g)
    norms: list[Any] = [None] * len(g)
    for decay in sorted(set(decays), reverse=True):  # one op per static variant of the rule
      idx = [i for i, d in enumerate(decays) if d == decay]
      op, with_p = _op(spec, options, names, decay=decay, cast_lr=cast_lr, fused=fused)
      leaves = [(g[i], *(col[i] for col in columns)) + ((p[i],) if with_p else ())
                for i in idx]
      if backend == "pallas":
        check_pallas_dtypes(leaves, [paths[i] for i in idx])
      o, n = execute(op, h, leaves, backend=backend, options=executor_options,
                     fused_apply=fused and spec.reduction is None)
      for j, i in enumerate(idx):
        outs[i], norms[i] = o[j], (n[j] if n is not None else None)

    first = [o[0] for o in outs]
    if spec.reduction is not None:  # the second pass, with the per-leaf norms
      first = [spec.reduction.finish(h, first[i], p[i], *norms[i], cast_lr=cast_lr)
               for i in range(len(g))]
      if fused:
        first = [(p[i] + first[i]).astype(p[i].dtype) for i in range(len(g))]
    new_fields = {f.name: jax.tree.unflatten(treedef, [o[k + 1] for o in outs])
                  for k, f in enumerate(fields)}
    return jax.tree.unflatten(treedef, first), spec.state(
        count=optax.safe_increment(count),
        **{f.name: new_fields.get(f.name) for f in spec.fields})

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # optax's contract: extra arguments are accepted and ignored
    return step(updates, state, params, fused=False)

  update_fn.fused_apply = lambda grads, state, params: step(grads, state, params, fused=True)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _op(spec: OptimizerSpec, options, names, *, decay: bool, cast_lr: bool, fused: bool):
  """The elementwise op of one static variant of the rule, and whether it reads ``p``."""
  static = dict(spec.static(options), cast_lr=cast_lr)
  if spec.weight_decay:
    static["decay"] = decay
  apply_in_kernel = fused and spec.reduction is None
  with_p = spec.reads_params or decay or spec.reduction is not None or apply_in_kernel
  rule = BoundRule(spec.rule, names, with_p, tuple(sorted(static.items())), apply_in_kernel)
  inputs = ("g", *names) + (("p",) if with_p else ())
  outputs = ("u", *names)
  aliases = tuple((1 + k, 1 + k) for k in range(len(names)))
  if apply_in_kernel:
    aliases += ((len(inputs) - 1, 0),)
  reduction = spec.reduction
  pads = (0.0, *(f.pad for f in spec.fields if f.name in names)) + ((0.0,) if with_p else ())
  op = ElementwiseOp(
      rule, spec.hyper, pads, aliases,
      norm_inputs=tuple(inputs.index(x) for x in reduction.inputs) if reduction else (),
      norm_outputs=tuple(outputs.index(x) for x in reduction.outputs) if reduction else (),
      name=spec.name)
  return op, with_p

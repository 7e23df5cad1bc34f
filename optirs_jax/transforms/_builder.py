"""The one builder: an optax transformation, its reference, kernels and fused apply from a spec.

:func:`build` checks the optimizer's arguments by the kinds its spec declares, and returns
an :class:`optax.GradientTransformationExtraArgs` whose ``update`` flattens the trees,
checks them (errors name the leaf's key path), computes this step's scalars as optax does,
and runs the spec's rule through :func:`optirs_jax.pallas.dispatch.execute` (the jnp
reference or the Pallas kernels, chosen per platform at lowering time). The fused apply
path (:func:`optirs_jax.apply`) is the same step with the rule returning ``p + u``: it
hangs on ``update.fused_apply``, which also takes what the mixed-precision wrappers
(:mod:`optirs_jax.mixed_precision`) need inside the kernel: a loss scale's inverse to
unscale the gradients with, a finiteness flag that turns the step into a no-op, and a
float32 master copy of low-precision params.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optirs_jax.pallas.dispatch import check_pallas_dtypes, execute, lowering_targets
from optirs_jax.pallas.op import ElementwiseOp, Hyper, output_dtypes
from optirs_jax.rounding import split16
from optirs_jax.spec import BoundRule, OptimizerSpec, prologue_scalars
from optirs_jax.transforms import _checks as c
from optirs_jax.transforms import _factored, _noise, _quantized, _quantized_kernel
from optirs_jax.transforms import _second_pass as second_pass
from optirs_jax.transforms._wiring import check_wiring

# What each kind of argument a spec declares must be.
_CHECKS = {
    "schedule": c.check_number_or_schedule,
    "optional schedule": lambda fn, name, v: None if v is None else c.check_number_or_schedule(
        fn, name, v),
    "number": c.check_number,
    "decay rate": c.check_unit_interval,
    "optional number": lambda fn, name, v: c.check_number(fn, name, v, allow_none=True),
    "flag": c.check_flag,
    "dtype": None,  # canonicalized below
    "mask": None,  # a tree of bools, a callable or None: checked against the tree in update
    "seed": c.check_seed,
    "axes": c.check_axes,
    "key": c.check_key,
}


# The stochastic-rounding arguments every optimizer takes (see optirs_jax.rounding).
ROUNDING = (("stochastic_rounding", "flag"), ("rounding_seed", "seed"))


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


OWN = object()  # a fused apply's default param_seed: the optimizer's own rounding


def build(spec: OptimizerSpec,
          arguments: Mapping[str, Any]) -> optax.GradientTransformationExtraArgs:
  """The optimizer ``spec`` describes, with ``arguments`` (its public function's arguments,
  ``backend`` and ``executor_options`` included)."""
  fn = f"optirs_jax.{spec.name}"
  options = _check_arguments(fn, spec, arguments)
  backend = c.check_backend(fn, arguments["backend"])
  executor_options = c.check_executor_options(fn, arguments["executor_options"])
  fields = tuple(f for f in spec.fields if f.exists(options))
  # The fields of the reduction's second pass are not the rule's.
  late = tuple(f for f in fields if spec.reduction and f.name in spec.reduction.fields)
  # Scalars per leaf, which the reduction's between() updates from the norms.
  leafwise = tuple(f for f in fields if f.per_leaf)
  fields = tuple(f for f in fields if f not in late and f not in leafwise)
  names = tuple(f.name for f in fields)
  check_wiring(fn, spec, options, names)
  # A reduction whose first pass keeps no state only measures there (it reads the gradient
  # and writes the block sums, not the update: 4 bytes a parameter less), and its second
  # pass reruns the rule on the gradient.
  measures = (spec.reduction is not None and not names and spec.factored is None
              and set(spec.reduction.outputs) <= {"u"})
  quantization = _quantized.check(fn, arguments)  # None: float fields
  seed = options["rounding_seed"] if options.get("stochastic_rounding") else None  # traced ok
  axes = options.get("axis_name")
  norm_axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))

  def init_fn(params):
    c.flatten(fn, "params", params)

    def value_of(field):
      return options[field.init] if isinstance(field.init, str) else field.init

    def init(field):
      value, dtype = value_of(field), options.get(field.dtype) if field.dtype else None
      if field.per_leaf:
        return jax.tree.map(lambda x: jnp.asarray(value, dtype=dtype or x.dtype), params)
      if quantization is not None:  # filled (or encoded) from the value by encode_fields
        return jax.tree.map(lambda x: _quantized.Fill(x, jnp.dtype(dtype or x.dtype)), params)
      return optax.tree.full_like(params, value, dtype=dtype)

    # Row and column statistics, or the full ones, per leaf (the full field made once).
    values = {} if spec.factored is None else _factored.init(spec, options, params)
    factored_names = set(values)
    values |= {f.name: init(f) if f.exists(options) else None for f in spec.fields
               if f.name not in values}
    state = spec.state(count=jnp.zeros([], jnp.int32), **_noise.key_state(spec, options),
                       **values)
    if quantization is not None:  # the fields filled (and encoded) from their values
      state = _quantized.encode_fields(fn, state, spec.fields, quantization, {
          f.name: value_of(f) for f in spec.fields if f.name not in factored_names})
    return state

  def step(updates, state, params, *, fused=False, master=None, inv_scale=None, finite=None,
           param_seed=OWN, prologue=()):
    kw = dict(fused=fused, master=master, inv_scale=inv_scale, finite=finite,
              param_seed=param_seed, prologue=prologue)
    if spec.factored is not None:
      _factored.check_plain(fn, master=master, inv_scale=inv_scale, finite=finite,
                            prologue=prologue)
    if spec.noise:  # optax's add_noise first, in XLA (the new key rides in the state)
      updates, state = _noise.add(fn, options, updates, state, finite, folded=bool(prologue)
                                  or inv_scale is not None or master is not None)
    if quantization is None:
      return float_step(updates, state, params, **kw)
    # The float32 step between a decode and an encode of the quantized fields.
    state, quantized = _quantized.decode_fields(state, spec.fields)
    result = float_step(updates, state, params, quantized=quantized, **kw)
    return (result[0], _quantized.reencode_fields(result[1], spec.fields, quantized),
            *result[2:])

  def float_step(updates, state, params, *, fused, master, inv_scale, finite, param_seed,
                 prologue, quantized=None):
    g, paths, treedef = c.flatten(fn, "updates", updates)
    dims, fac = ([None] * len(g), {}) if spec.factored is None else _factored.columns(
        fn, spec, options, state, g, paths, treedef)  # factored leaves: dims[i] is not None
    columns = [fac[f.name] if f.name in fac else
               c.match(fn, f"state.{f.name}", getattr(state, f.name), treedef, g, paths)
               for f in fields]
    late_columns = [c.match(fn, f"state.{f.name}", getattr(state, f.name), treedef, g, paths)
                    for f in late]
    leaf_columns = [c.match(fn, f"state.{f.name}", getattr(state, f.name), treedef, g, paths,
                            per_leaf=True)
                    for f in leafwise]
    p = None if params is None else c.match(fn, "params", params, treedef, g, paths)
    m = None
    if master is not None:  # float32 masters of the half-precision leaves; others ignored
      m = jax.tree.leaves(master, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
      if len(m) != len(g):
        raise ValueError(f"{fn}: the master params have {len(m)} leaves, the updates {len(g)}")
    uses_master = [m is not None and is_half(p[i]) for i in range(len(g))]
    param_seed = seed if param_seed is OWN else param_seed
    count = state.count
    neg_lr, cast_lr = c.learning_rate(options["learning_rate"], count)
    wd, has_decay = (c.weight_decay_value(options["weight_decay"], count)
                     if spec.weight_decay else (0.0, False))
    reads_p = any(kind == "add_decayed_weights" for kind, _ in prologue)
    if p is None and (fused or has_decay or spec.reads_params or spec.reduction or reads_p):
      raise ValueError(f"{fn}: this transformation needs the params: call "
                       "update(updates, state, params)")
    scalars = dict(spec.scalars(options, count), neg_lr=neg_lr, wd=wd)
    if inv_scale is not None:
      scalars["inv_scale"] = inv_scale
    # optax links folded in before the rule (optirs_jax.fusion): (kind, {name: value}) each.
    kinds, links = prologue_scalars(prologue)
    scalars.update(links)
    if finite is not None:
      scalars["finite"] = jnp.asarray(finite).astype(jnp.float32)
    if seed is not None or param_seed is not None:
      scalars["count_lo"], scalars["count_hi"] = split16(count)
    if seed is not None:
      scalars["seed_lo"], scalars["seed_hi"] = split16(seed)
    if param_seed is not None:
      scalars["pseed_lo"], scalars["pseed_hi"] = split16(param_seed)
    h = Hyper(scalars)
    decays = (c.mask_flags(fn, options["mask"], updates, treedef) if has_decay
              else [False] * len(g))
    # What the rule reads as the params: the master copy where there is one.
    weights = [m[i] if uses_master[i] else p[i] for i in range(len(g))] if p else None
    outs: list[Any] = [None] * len(g)
    norms: list[Any] = [None] * len(g)
    in_kernel, kernel_platforms = _kernel_quantized(quantized, len(g), g)
    variants = sorted(set(zip(decays, uses_master)), reverse=True)
    for decay, in_master in variants:  # one op per static variant of the rule
      idx = [i for i in range(len(g)) if (decays[i], uses_master[i]) == (decay, in_master)
             and dims[i] is None]
      mode = _Mode(fused=fused, master=in_master, unscale=inv_scale is not None,
                   guard=finite is not None, rounding=seed is not None,
                   param_rounding=fused and param_seed is not None,
                   cast_lr=cast_lr, prologue=kinds)
      op, with_p, with_low = _op(spec, options, names, mode, decay=decay, measures=measures)
      # float32 gradients, or half ones with a float32 master (which the rule reads as p)
      quantized_idx = [i for i in idx if in_kernel[i] is not None
                       and (g[i].dtype == jnp.float32 or in_master)
                       and (not with_p or weights[i].dtype == jnp.float32)]
      if quantized_idx:
        extras = {i: (weights[i],) * with_p + (p[i],) * with_low for i in quantized_idx}
        _run_quantized(op, h, quantized_idx, g, in_kernel, extras, outs, kernel_platforms)
        idx = sorted(set(idx) - set(quantized_idx))
        if not idx:
          continue
      leaves = [(g[i], *(col[i] for col in columns)) + ((weights[i],) if with_p else ())
                + ((p[i],) if with_low else ()) for i in idx]
      if backend == "pallas":
        check_pallas_dtypes(leaves, [paths[i] for i in idx])
      o, n = execute(op, h, leaves, backend=backend, options=executor_options,
                     fused_apply=fused and spec.reduction is None, norm_axes=norm_axes)
      for j, i in enumerate(idx):
        outs[i], norms[i] = o[j], (n[j] if n is not None else None)

    new_factored = {}  # the new row and column statistics
    if spec.factored is not None:
      new_factored = _factored_pass(h, g, weights, fac, dims, outs, norms, treedef)
    first = list(g) if measures else [o[0] for o in outs]
    new_master = None
    if m is not None and spec.reduction is None:
      new_master = [outs[i][-1] if uses_master[i] else m[i] for i in range(len(g))]
    new_fields = {f.name: jax.tree.unflatten(treedef, [o[k + 1] for o in outs])
                  for k, f in enumerate(fields)}
    if spec.reduction is not None:  # the second pass, with the per-leaf norms
      masked = ([True] * len(g) if spec.reduction.mask is None else
                c.mask_flags(fn, options[spec.reduction.mask], updates, treedef))
      if spec.reduction.between is not None:
        norms, leaf_out = second_pass.between(spec.reduction.between, h, norms, leafwise,
                                              leaf_columns, guard=finite is not None)
        new_fields |= {f.name: jax.tree.unflatten(treedef, col)
                       for f, col in zip(leafwise, leaf_out)}
      first, new_master, late_out = second_pass.finish(
          spec, h, first, weights, p, m, norms, uses_master, late, late_columns, masked,
          static=tuple(sorted(spec.reduction.static(options).items())),
          on_reference=[d is not None for d in dims], decays=decays,
          rerun=second_pass.Rerun(tuple(sorted(spec.static(options).items())),
                                  inv_scale is not None, kinds) if measures else None,
          fused=fused, guard=finite is not None, rounding=seed is not None,
          param_rounding=param_seed is not None, cast_lr=cast_lr, backend=backend,
          options=executor_options)
      new_fields |= {f.name: jax.tree.unflatten(treedef, list(col))
                     for f, col in zip(late, late_out)}
    new_count = optax.safe_increment(count)
    if finite is not None:
      new_count = jnp.where(finite, new_count, count)
    new_state = spec.state(count=new_count, **_noise.carried(spec, state),
                           **{f.name: new_fields.get(f.name) for f in spec.fields},
                           **new_factored)
    result = (jax.tree.unflatten(treedef, first), new_state)
    if m is not None:
      result += (jax.tree.unflatten(treedef, new_master),)
    return result

  def _factored_pass(h, g, weights, fac, dims, outs, norms, treedef) -> dict:
    """The factored leaves' first pass in XLA (``outs`` and ``norms`` filled in place); the
    new row and column statistics of every leaf."""
    f = spec.factored
    new = {f.row: list(fac[f.row]), f.col: list(fac[f.col])}
    for i in [i for i, d in enumerate(dims) if d is not None]:
      r, new[f.row][i], new[f.col][i], placeholder, norms[i] = _factored.first_pass(
          spec, h, g[i], weights[i], fac[f.row][i], fac[f.col][i], dims[i],
          full_dtype=fac[f.full][i].dtype)
      outs[i] = (r, placeholder)  # the rule's one field is the full statistics
    return {k: jax.tree.unflatten(treedef, v) for k, v in new.items()}

  def _kernel_quantized(quantized, n, g):
    """Per leaf, its quantized rule fields where the kernel decodes and encodes them (else
    None), and ``(trace the Triton kernel, how other platforms run it)``: on a step traced
    for an NVIDIA GPU (or with ``backend="pallas"``, Pallas' interpreter elsewhere), for a
    rule without per-leaf norms."""
    none = [None] * n
    if quantized is None or spec.reduction is not None or backend == "jnp" or not g:
      return none, None
    targets = lowering_targets([(g[0],)])
    cuda = "cuda" in targets
    if not cuda and backend != "pallas":
      return none, None
    other = "interpret" if backend == "pallas" and "tpu" not in targets else "jnp"
    return _quantized.kernel_fields(quantized, names, n) or none, (cuda, other)

  def _run_quantized(op, h, idx, g, in_kernel, extras, outs, platforms):
    """The leaves ``idx`` through the quantized kernel: ``outs[i] = (update or new params,
    Quantized8bit per field[, new master])``; ``extras[i]``: the rule's inputs after its
    fields (the params or master copy, and the half-precision params in master mode)."""
    floats = [(g[i], *(jax.ShapeDtypeStruct(g[i].shape, jnp.float32) for _ in names),
               *extras[i]) for i in idx]
    out_dtypes = [(d[0], *d[1 + len(names):]) for d in output_dtypes(op, h, floats)]
    results = _quantized_kernel.execute(
        op, h, [(g[i], *in_kernel[i], *extras[i]) for i in idx], n_fields=len(names),
        signed=[not f.nonneg for f in fields], out_dtypes=out_dtypes, cuda=platforms[0],
        other=platforms[1], tiling=executor_options.quantized_tiling,
        coder=executor_options.dynamic_map_coder,
        grouped=executor_options.large_leaf_policy == "group",
        max_buffers=executor_options.grouped_max_buffers)
    for i, r in zip(idx, results):
      outs[i] = r

  def is_half(x) -> bool:
    return jnp.finfo(x.dtype).bits < 32 if jnp.issubdtype(x.dtype, jnp.floating) else False

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args  # optax's contract: extra arguments are accepted and ignored
    return step(updates, state, params)

  def fused_apply(grads, state, params, *, master=None, inv_scale=None, finite=None,
                  param_seed=OWN, prologue=()):
    """``(new params, new state)`` in one pass.

    With ``master`` (a tree like the params holding float32 copies of the half-precision
    leaves; its other leaves are ignored), the rule updates the copies and the params
    become their rounding: ``(new params, new state, new master)``. ``inv_scale`` unscales
    the gradients inside the kernel; where ``finite`` is False nothing changes (the count
    neither). ``param_seed`` rounds the new half-precision params stochastically with that
    seed (``None``: to nearest; by default as the optimizer's ``stochastic_rounding``).
    ``prologue``: ``(kind, {name: value})`` per optax link applied to the gradients first,
    in the same pass (:func:`optirs_jax.spec.apply_prologue`; :mod:`optirs_jax.fusion`).
    """
    return step(grads, state, params, fused=True, master=master, inv_scale=inv_scale,
                finite=finite, param_seed=param_seed, prologue=prologue)

  def guarded_update(updates, state, params=None, *, inv_scale=None, finite=None):
    """``update`` with the gradients multiplied by ``inv_scale`` as they are read, and a
    step where ``finite`` is False that returns zero updates and the state as it was (a
    loss-scaled step on the optax contract, without an unscaled copy or a select)."""
    return step(updates, state, params, inv_scale=inv_scale, finite=finite)

  update_fn.fused_apply = fused_apply
  update_fn.guarded_update = guarded_update
  update_fn.optirs_name = spec.name
  # (optirs_jax.fusion; noise comes before the kernel, factored statistics are XLA's)
  update_fn.folds_links = update_fn.folds_wrappers = not (spec.noise or spec.factored)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@dataclasses.dataclass(frozen=True)
class _Mode:
  """The static variant of one step: fused apply, master copy, unscale, guard, rounding."""

  fused: bool
  master: bool
  unscale: bool
  guard: bool
  rounding: bool
  param_rounding: bool
  cast_lr: bool
  prologue: tuple[str, ...] = ()


def _op(spec: OptimizerSpec, options, names, mode: _Mode, *, decay: bool,
        measures: bool = False):
  """The elementwise op of one static variant of the rule, whether it reads the params (the
  master copy in master mode) and whether it also writes the low-precision params.
  ``measures``: the update is a norm source only (neither stored nor returned)."""
  static = dict(spec.static(options), cast_lr=mode.cast_lr)
  if spec.weight_decay:
    static["decay"] = decay
  apply_in_kernel = mode.fused and spec.reduction is None
  with_p = (spec.reads_params or decay or spec.reduction is not None or apply_in_kernel
            or "add_decayed_weights" in mode.prologue)
  with_low = apply_in_kernel and mode.master
  rule = BoundRule(spec.rule, names, with_p, tuple(sorted(static.items())),
                   apply=apply_in_kernel and not mode.master, master=with_low,
                   unscale=mode.unscale, guard=mode.guard, wide_grads=mode.master,
                   rounding=mode.rounding,
                   param_rounding=mode.param_rounding, prologue=mode.prologue)
  inputs = ("g", *names) + (("p",) if with_p else ()) + (("p_low",) if with_low else ())
  outputs = ("u", *names) + (("master",) if with_low else ())
  aliases = tuple((1 + k, 1 + k) for k in range(len(names)))
  if with_low:
    aliases += ((inputs.index("p_low"), 0), (inputs.index("p"), len(outputs) - 1))
  elif apply_in_kernel:
    aliases += ((inputs.index("p"), 0),)
  reduction = spec.reduction
  pads = (0.0, *(f.pad for f in spec.fields if f.name in names)) + (0.0,) * (with_p + with_low)
  op = ElementwiseOp(
      rule, rule.hyper(spec.hyper), pads, aliases,
      norm_inputs=tuple(inputs.index(x) for x in reduction.inputs) if reduction else (),
      norm_outputs=tuple(outputs.index(x) for x in reduction.outputs) if reduction else (),
      name=spec.name, indexed=rule.indexed, mixed_on_kernels=rule.widens_mixed,
      unguarded=rule.unguarded(), means=bool(reduction and reduction.means),
      norm_only=int(measures))
  return op, with_p, with_low

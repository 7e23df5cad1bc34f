"""Optimizer wrappers for mixed precision: loss scaling and float32 master weights."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import fusion
from optirs_jax.dtypes import widened
from optirs_jax.mixed_precision._finite import unscaled_all_finite
from optirs_jax.mixed_precision._loss_scale import (
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  StaticLossScale,
  all_finite,
  select_tree,
)
from optirs_jax.pallas.dispatch import lowering_targets
from optirs_jax.pallas.sharding import varying_axes
from optirs_jax.rounding import stochastic_round
from optirs_jax.transforms._checks import key_paths, structure_mismatch

_SCALES = (DynamicLossScale, StaticLossScale, NoOpLossScale)


class LossScalingState(NamedTuple):
  """State of :func:`with_loss_scaling`."""

  loss_scale: LossScale  # the scale to multiply the next step's loss by
  skipped_steps: jax.Array  # int32: steps skipped because a gradient was not finite
  inner_state: Any


class MasterWeightsState(NamedTuple):
  """State of :func:`master_weights`."""

  count: jax.Array  # int32: the steps taken (the stochastic rounding's counter)
  master: Any  # float32 copies of the half-precision params (optax.MaskedNode() for the others)
  inner_state: Any


def _fused(tx):
  """The fused step of ``tx`` (an optirs_jax optimizer, a chain around one, ...; see
  :mod:`optirs_jax.fusion`), else None."""
  return fusion.fused_step(tx)


def _as_state(loss_scale: LossScale) -> LossScale:
  if isinstance(loss_scale, DynamicLossScale):
    return DynamicLossScale(jnp.asarray(loss_scale.loss_scale, jnp.float32),
                            jnp.asarray(loss_scale.counter, jnp.int32), loss_scale.period,
                            loss_scale.factor, loss_scale.min_loss_scale)
  if isinstance(loss_scale, StaticLossScale):
    return StaticLossScale(jnp.asarray(loss_scale.loss_scale, jnp.float32))
  return loss_scale


def _reference_only(grads, finite) -> bool:
  """Whether a step traced now can only run on the jnp reference: no kernel platform to
  lower for, and a flag that is the same on every shard (inside a ``shard_map`` a varying
  flag keeps the in-kernel guard)."""
  leaves = tuple(jax.tree.leaves(grads))
  return not lowering_targets([leaves]) and not varying_axes(finite)


def _inverse(loss_scale):
  """What the gradients are multiplied by to unscale them (None: nothing to unscale)."""
  if isinstance(loss_scale, NoOpLossScale):
    return None
  return 1.0 / jnp.asarray(loss_scale.loss_scale, jnp.float32)


def _keep_dtypes(new, old):
  """``new`` with each leaf in ``old``'s dtype (so a skipped step can select either)."""
  return jax.tree.map(lambda n, o: n.astype(o.dtype) if hasattr(o, "dtype") else n, new, old)


def with_loss_scaling(inner: optax.GradientTransformation,
                      loss_scale: LossScale | None = None
                      ) -> optax.GradientTransformationExtraArgs:
  r"""Loss scaling around ``inner``: its ``update`` takes the gradients of the *scaled* loss.

  .. math::
    g = \nabla (s \cdot L) / s, \qquad
    (u, \text{state}) = \begin{cases} \text{inner}(g) & g \text{ finite} \\
                                      (0, \text{state unchanged}) & \text{otherwise}
                        \end{cases}

  and the scale :math:`s` is adjusted (:class:`DynamicLossScale` grows it after a period
  of finite steps and shrinks it on a non-finite one). A skipped step leaves ``inner``'s
  state bit for bit as it was and counts in ``skipped_steps_of(state)``. Get the scale to
  multiply the loss by with :func:`loss_scale_of`. ``inner`` sees the unscaled gradients
  in float32 where they were float16/bfloat16.

  With :func:`optirs_jax.apply` around an optirs_jax optimizer (or :func:`master_weights`
  of one), the step is one kernel pass after a read-only finiteness check: the kernel
  unscales the gradients as it reads them (no unscaled copy is written to memory) and
  writes params and state unchanged on a non-finite step.

  For gradient accumulation put ``optax.MultiSteps`` inside:
  ``with_loss_scaling(optax.MultiSteps(inner, k))``.

  Args:
    inner: the optimizer (any optax transformation).
    loss_scale: a :class:`DynamicLossScale` (default ``DynamicLossScale(2.0**15)``),
      :class:`StaticLossScale` or :class:`NoOpLossScale`.

  Example:
    >>> import jax, jax.numpy as jnp, optirs_jax
    >>> from optirs_jax import mixed_precision as mp
    >>> tx = mp.with_loss_scaling(optirs_jax.adam(1e-2))
    >>> params = {"w": jnp.ones(3, jnp.float16)}
    >>> state = tx.init(params)
    >>> loss = lambda p: 0.25 * jnp.sum(p["w"].astype(jnp.float32) ** 2)
    >>> grads = jax.grad(lambda p: mp.loss_scale_of(state).scale(loss(p)))(params)
    >>> params, state = optirs_jax.apply(tx, grads, state, params)
    >>> params["w"], int(mp.skipped_steps_of(state))
    (Array([0.99, 0.99, 0.99], dtype=float16), 0)
  """
  loss_scale = DynamicLossScale(2.0**15) if loss_scale is None else loss_scale
  if not isinstance(loss_scale, _SCALES):
    raise TypeError(f"with_loss_scaling: loss_scale={loss_scale!r} must be one of "
                    f"{[c.__name__ for c in _SCALES]}")
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return LossScalingState(_as_state(loss_scale), jnp.zeros([], jnp.int32), inner.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    guarded = getattr(inner.update, "guarded_update", None)
    if guarded is not None and not extra_args:
      # The optax contract on the kernels: one read-only pass for the flag, then the
      # inner optimizer unscales as it reads and keeps its state on a skipped step, in
      # place (no unscaled copy of the gradients, no select over the state).
      inv = _inverse(state.loss_scale)
      finite = unscaled_all_finite(jax.tree.leaves(updates), inv)
      if not _reference_only(updates, finite):  # (XLA:CPU: the selects below compile faster)
        try:
          new_updates, new_inner = guarded(updates, state.inner_state, params, inv_scale=inv,
                                           finite=finite)
          return new_updates, _next(state, finite, new_inner)
        except fusion.NotFused:
          pass
    grads = state.loss_scale.unscale(updates)
    finite = all_finite(grads)
    new_updates, new_inner = inner.update(grads, state.inner_state, params, **extra_args)
    new_updates = select_tree(finite, new_updates, optax.tree.zeros_like(new_updates))
    new_inner = select_tree(finite, _keep_dtypes(new_inner, state.inner_state),
                            state.inner_state)
    return new_updates, _next(state, finite, new_inner)

  def fused_apply(grads, state, params, *, prologue=(), **unused):
    fused = _fused(inner)
    if prologue or unused:  # links before the loss scaling: not folded in
      raise fusion.NotFused("with_loss_scaling after other links")
    if fused is None:  # not an optirs_jax optimizer: the unfused pair
      updates, state = update_fn(grads, state, params)
      return optax.apply_updates(params, updates), state
    inv = _inverse(state.loss_scale)
    # Read-only, nothing is written: on the GPU one grouped pass over the gradients.
    finite = unscaled_all_finite(jax.tree.leaves(grads), inv)
    if _reference_only(grads, finite):
      # Only the jnp reference can run (XLA:CPU): skip the step with a conditional. The
      # kernels' guard, a select on the tree-wide flag in every leaf's fusion, took
      # XLA:CPU 54 s to compile on GPT-2's 148 leaves (1/1000 scale); with the
      # conditional the step compiles in 2.5 s.
      step = lambda: _keep_dtypes(fused(grads, state.inner_state, params, inv_scale=inv),
                                  (params, state.inner_state))
      try:
        new_params, new_inner = jax.lax.cond(finite, step, lambda: (params, state.inner_state))
      except fusion.NotFused:
        updates, state = update_fn(grads, state, params)
        return optax.apply_updates(params, updates), state
    else:  # the kernels skip the step in place, with no round trip to the host
      try:
        new_params, new_inner = fused(grads, state.inner_state, params, inv_scale=inv,
                                      finite=finite)
      except fusion.NotFused:
        updates, state = update_fn(grads, state, params)
        return optax.apply_updates(params, updates), state
    return new_params, _next(state, finite, new_inner)

  def _next(state, finite, new_inner):
    return LossScalingState(state.loss_scale.adjust(finite),
                            state.skipped_steps + (~finite).astype(jnp.int32), new_inner)

  update_fn.fused_apply = fused_apply
  update_fn.optirs_name = f"with_loss_scaling({fusion.name_of(inner)})"
  # None where the inner is fused and takes the loss scale into its kernel.
  update_fn.inner_not_fused = (fusion.why_not_fused(inner)
                               or fusion.why_not_wrapped(inner, "loss scaling"))
  update_fn.folds_links = False  # outermost: the gradients it unscales are the loss's
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _find(state, kind: type, what: str):
  found = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kind))
           if isinstance(s, kind)]
  if not found:
    raise ValueError(f"{what}: the state holds no {kind.__name__} (is the optimizer "
                     "wrapped in optirs_jax.mixed_precision.with_loss_scaling?)")
  return found[0]


def loss_scale_of(state) -> LossScale:
  """The loss scale in ``state`` (the wrapper's, or a chain's state holding it)."""
  return _find(state, LossScalingState, "loss_scale_of").loss_scale


def skipped_steps_of(state) -> jax.Array:
  """How many steps :func:`with_loss_scaling` skipped (non-finite gradients)."""
  return _find(state, LossScalingState, "skipped_steps_of").skipped_steps


def _is_half(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32


def master_weights(inner: optax.GradientTransformation, *, stochastic_rounding: bool = False,
                   rounding_seed: int = 0) -> optax.GradientTransformationExtraArgs:
  r"""Float32 master weights for float16/bfloat16 params: ``inner`` updates the copy.

  .. math::
    (u, \text{state}) = \text{inner}(g, \text{state}, m), \qquad m \leftarrow m + u, \qquad
    p \leftarrow \mathrm{round}(m)

  The state keeps a float32 copy ``m`` of each half-precision leaf (other leaves are
  updated as they are), and ``inner`` sees those leaves' gradients in float32; the update
  returned is ``round(m) - p`` in float32, so
  ``optax.apply_updates(params, updates)`` gives exactly the master rounded to the params'
  dtype. With :func:`optirs_jax.apply` around an optirs_jax optimizer it is one kernel pass
  that reads the half-precision gradient and the master and writes the master, the state
  and the half-precision params.

  Args:
    inner: the optimizer (any optax transformation).
    stochastic_rounding: round the master to bfloat16 params stochastically (unbiased;
      :mod:`optirs_jax.rounding`) instead of to nearest.
    rounding_seed: the stochastic rounding's seed.

  Example:
    >>> import jax.numpy as jnp, optax, optirs_jax
    >>> from optirs_jax.mixed_precision import master_weights
    >>> tx = master_weights(optirs_jax.sgd(1e-3))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> for _ in range(10):  # each step alone is below half a bfloat16 step at 1.0
    ...   updates, state = tx.update({"w": jnp.ones(2, jnp.bfloat16)}, state, params)
    ...   params = optax.apply_updates(params, updates)
    >>> params["w"], state.master["w"]
    (Array([0.988281, 0.988281], dtype=bfloat16), Array([0.9900001, 0.9900001], dtype=float32))
  """
  if not isinstance(stochastic_rounding, bool):
    raise TypeError(f"master_weights: stochastic_rounding={stochastic_rounding!r} must be "
                    "True or False")
  if (isinstance(rounding_seed, bool) or not isinstance(rounding_seed, int)
      or not 0 <= rounding_seed < 2**32):
    raise ValueError(f"master_weights: rounding_seed={rounding_seed!r} must be a "
                     "non-negative 32-bit int")
  seed = rounding_seed if stochastic_rounding else None
  inner = optax.with_extra_args_support(inner)

  def full(params, master):  # what the inner optimizer sees as the params
    masked = lambda x: isinstance(x, optax.MaskedNode)
    if jax.tree.structure(master, is_leaf=masked) != jax.tree.structure(params):
      raise ValueError(structure_mismatch("master_weights", "state.master", master,
                                          key_paths(params), "params", is_leaf=masked))
    return jax.tree.map(lambda p, m: m if _is_half(p) else p, params, master)

  def init_fn(params):
    # No copy of a float32 leaf: optax's MaskedNode, a node without arrays (an empty array
    # there would stop orbax, which saves no array of zero size).
    master = jax.tree.map(lambda p: p.astype(jnp.float32) if _is_half(p)
                          else optax.MaskedNode(), params)
    return MasterWeightsState(jnp.zeros([], jnp.int32), master,
                              inner.init(full(params, master)))

  def round_master(m, p, count):
    if seed is None:
      return m.astype(p.dtype)
    return stochastic_round(m, p.dtype, seed=seed, count=count)

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError("master_weights: update needs the params: call "
                       "update(updates, state, params)")
    # The inner optimizer works in float32 on the half-precision leaves (as the kernel does).
    grads = jax.tree.map(lambda g, p: g.astype(widened(g.dtype)) if _is_half(p) else g,
                         updates, params)
    u, new_inner = inner.update(grads, state.inner_state, full(params, state.master),
                                **extra_args)
    return _with_masters(params, state, u, new_inner)

  def _with_masters(params, state, u, new_inner, finite=None):
    """(updates, new state) from the inner optimizer's float32 updates of the masters."""
    def step(p, m, u):
      if not _is_half(p):
        return u, m
      new_m = m + u.astype(m.dtype)
      return round_master(new_m, p, state.count).astype(jnp.float32) - p.astype(
          jnp.float32), new_m

    pairs = jax.tree.map(step, params, state.master, u)
    is_pair = lambda x: isinstance(x, tuple)
    count = optax.safe_increment(state.count)
    if finite is not None:
      count = jnp.where(finite, count, state.count)
    return (jax.tree.map(lambda t: t[0], pairs, is_leaf=is_pair),
            MasterWeightsState(count, jax.tree.map(lambda t: t[1], pairs, is_leaf=is_pair),
                               new_inner))

  def guarded_update(updates, state, params, *, inv_scale=None, finite=None):
    """``update`` with the gradients unscaled by ``inv_scale`` and a step where ``finite``
    is False that changes nothing (zero updates, the inner state as it was), inside the
    inner optimizer's kernels."""
    guarded = getattr(inner.update, "guarded_update", None)
    if guarded is None or params is None:
      raise fusion.NotFused("master_weights around an optimizer without a guarded update")
    u, new_inner = guarded(updates, state.inner_state, full(params, state.master),
                           inv_scale=inv_scale, finite=finite)
    return _with_masters(params, state, u, new_inner, finite)

  def fused_apply(grads, state, params, *, inv_scale=None, finite=None, prologue=(),
                  **unused):
    if prologue or unused:  # links before the master weights: not folded in
      raise fusion.NotFused("master_weights after other links")
    fused = _fused(inner)
    if fused is not None:
      full(params, state.master)  # checked: the same leaves
      try:
        new_params, new_inner, new_master = fused(grads, state.inner_state, params,
                                                  master=state.master, inv_scale=inv_scale,
                                                  finite=finite, param_seed=seed)
      except fusion.NotFused:
        fused = None
    if fused is None:  # not an optirs_jax optimizer: unscale and guard in jnp
      grads = grads if inv_scale is None else jax.tree.map(
          lambda g: g.astype(widened(g.dtype)) * inv_scale.astype(widened(g.dtype)), grads)
      updates, new_state = update_fn(grads, state, params)
      new_params = optax.apply_updates(params, updates)
      if finite is None:
        return new_params, new_state
      return (select_tree(finite, new_params, params),
              select_tree(finite, _keep_dtypes(new_state, state), state))
    count = optax.safe_increment(state.count)
    if finite is not None:
      count = jnp.where(finite, count, state.count)
    return new_params, MasterWeightsState(count, new_master, new_inner)

  update_fn.fused_apply = fused_apply
  update_fn.guarded_update = guarded_update
  update_fn.optirs_name = f"master_weights({fusion.name_of(inner)})"
  # None where the inner is fused and takes the master copies into its kernel.
  update_fn.inner_not_fused = (fusion.why_not_fused(inner)
                               or fusion.why_not_wrapped(inner, "master weights"))
  update_fn.folds_links = False  # put the links inside: master_weights(chain(...))
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)

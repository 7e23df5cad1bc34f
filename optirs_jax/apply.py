"""The fused apply path: new params and state from one pass over the data."""

from __future__ import annotations

from typing import Any

import optax

from optirs_jax import fusion


def apply(tx: optax.GradientTransformation, grads: Any, opt_state: Any,
          params: Any) -> tuple[Any, Any]:
  r"""One optimizer step: returns ``(new_params, new_opt_state)``.

  For an optirs_jax optimizer the kernel writes the new params and the new state in the
  same pass, in place when the caller donates them (``jax.jit(..., donate_argnums=...)``),
  so the updates are never materialized; the numbers are those of

  .. math:: p' = p + u, \qquad (u, s') = \mathrm{tx.update}(g, s, p)

  i.e. of ``tx.update`` followed by :func:`optax.apply_updates`. So it is for what users
  wrap optimizers in: ``optax.chain`` of ``clip_by_global_norm``, ``clip``, ``scale``,
  ``scale_by_learning_rate``, ``scale_by_schedule``, ``add_decayed_weights`` and an
  optirs_jax optimizer (the links fold into the kernel's pass; the global norm is one more
  read of the gradients), ``optax.inject_hyperparams`` of one, and the mixed-precision
  wrappers (:mod:`optirs_jax.fusion`). For any other transformation it runs exactly that
  pair, so it is always safe to call; :func:`optirs_jax.fusion.explain` says which path a
  transformation takes.

  Donate params and state in the order the step returns them: JAX pairs each donated
  argument with the first unclaimed output of the same shape and dtype, and a step taking
  ``(grads, state, params)`` but returning ``(params, state)`` would pair the first moment
  with the new params, so XLA copies every buffer first (3x slower on one large leaf).

  Example:
    >>> import jax, jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adamw(1e-2)
    >>> params = {"w": jnp.ones(4)}
    >>> state = tx.init(params)
    >>> step = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p), donate_argnums=(0, 1))
    >>> params, state = step(params, state, {"w": jnp.full(4, 0.5)})
    >>> params["w"]
    Array([0.98999906, 0.98999906, 0.98999906, 0.98999906], dtype=float32)
  """
  step = fusion.fused_step(tx)
  if step is not None:
    try:
      return step(grads, opt_state, params)
    except fusion.NotFused:  # known only once traced (an inner optimizer without a kernel)
      pass
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state

"""Adagrad as one fused GradientTransformation."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.executor import execute
from optirs_jax.transforms import _common as c


class AdagradState(NamedTuple):
  """State of :func:`adagrad`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the schedule's step, saturating.
  sum_of_squares: optax.Updates  # running sum of |g|^2, in the params' dtype.


def adagrad(learning_rate: optax.ScalarOrSchedule,
            initial_accumulator_value: jax.typing.ArrayLike = 0.1,
            eps: jax.typing.ArrayLike = 1e-7, *,
            backend: str = "auto") -> optax.GradientTransformation:
  r"""Adagrad; the same numbers as :func:`optax.adagrad`.

  .. math::
    s_k = s_{k-1} + |g_k|^2, \qquad u_k = -\eta_k\, g_k / \sqrt{s_k + \epsilon}
    \quad (0 \text{ where } s_k = 0)

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    initial_accumulator_value: the starting value of :math:`s` (must be >= 0).
    eps: added inside the square root.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> opt = optirs_jax.adagrad(1.0, initial_accumulator_value=0.0, eps=0.0)
    >>> params = jnp.array([1.0, 1.0])
    >>> updates, _ = opt.update(jnp.array([2.0, 0.0]), opt.init(params))
    >>> updates
    Array([-1., -0.], dtype=float32)

  References:
    Duchi et al., `Adaptive Subgradient Methods for Online Learning and Stochastic
    Optimization <https://jmlr.org/papers/v12/duchi11a.html>`_, 2011.
  """
  fn = "optirs_jax.adagrad"
  c.check_number_or_schedule(fn, "learning_rate", learning_rate)
  c.check_number(fn, "initial_accumulator_value", initial_accumulator_value)
  c.check_number(fn, "eps", eps)
  if isinstance(initial_accumulator_value, (int, float)) and initial_accumulator_value < 0:
    raise ValueError(f"{fn}: initial_accumulator_value={initial_accumulator_value} must be >= 0")
  backend = c.check_backend(fn, backend)

  def init_fn(params):
    c.flatten(fn, "params", params)
    return AdagradState(count=jnp.zeros([], jnp.int32),
                        sum_of_squares=c.full_like(params, initial_accumulator_value))

  def step(updates, state, params, fused: bool):
    g, paths, treedef = c.flatten(fn, "updates", updates)
    s = c.match(fn, "state.sum_of_squares", state.sum_of_squares, treedef, g, paths)
    if fused:
      p = c.params_leaves(fn, params, treedef, g, paths)
    neg_lr, cast_lr = c.learning_rate(learning_rate, state.count)
    h = rules.Hyper(eps=eps, neg_lr=neg_lr)
    leaves = [(g[i], s[i]) + ((p[i],) if fused else ()) for i in range(len(g))]
    c.pallas_dtype_check(backend, leaves, paths)
    rule = functools.partial(rules.adagrad_rule, cast_lr=cast_lr)
    if fused:
      rule = rules.applying(rule)
    outs, _ = execute(rule, h, rules.ADAGRAD_HYPER, leaves, backend=backend,
                      pads=(0.0, 1.0, 0.0), aliases={1: 1, **({0: 2} if fused else {})},
                      name="adagrad", fused_apply=fused)
    return (jax.tree.unflatten(treedef, [o[0] for o in outs]),
            AdagradState(count=c.safe_increment(state.count),
                         sum_of_squares=jax.tree.unflatten(treedef, [o[1] for o in outs])))

  return c.transformation(init_fn, step)

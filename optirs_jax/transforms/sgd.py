"""SGD with optional (Nesterov) momentum as one fused GradientTransformation."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.executor import execute
from optirs_jax.transforms import _common as c


class SgdState(NamedTuple):
  """State of :func:`sgd`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the schedule's step, saturating.
  trace: optax.Params | None  # momentum buffer in ``accumulator_dtype``; None without momentum.


def sgd(learning_rate: optax.ScalarOrSchedule, momentum: jax.typing.ArrayLike | None = None,
        nesterov: bool = False, accumulator_dtype: Any | None = None, *,
        backend: str = "auto") -> optax.GradientTransformation:
  r"""Stochastic gradient descent; the same numbers as :func:`optax.sgd`.

  .. math::
    t_k = g_k + \mu\, t_{k-1}, \qquad
    u_k = -\eta_k\, t_k \quad (\text{Nesterov: } u_k = -\eta_k (g_k + \mu\, t_k))

  Without momentum :math:`u_k = -\eta_k g_k`.

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    momentum: the momentum decay :math:`\mu`, or ``None`` for plain SGD.
    nesterov: use Nesterov momentum.
    accumulator_dtype: dtype of the momentum buffer; ``None`` keeps the params' dtype.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> opt = optirs_jax.sgd(0.5, momentum=0.9)
    >>> params = jnp.array([1.0, -2.0])
    >>> updates, state = opt.update(jnp.array([1.0, 1.0]), opt.init(params))
    >>> updates
    Array([-0.5, -0.5], dtype=float32)

  References:
    Sutskever et al., `On the importance of initialization and momentum in deep learning
    <http://proceedings.mlr.press/v28/sutskever13.pdf>`_, 2013.
  """
  fn = "optirs_jax.sgd"
  c.check_number_or_schedule(fn, "learning_rate", learning_rate)
  c.check_number(fn, "momentum", momentum, allow_none=True)
  c.check_flag(fn, "nesterov", nesterov)
  accumulator_dtype = c.canonical_dtype(fn, "accumulator_dtype", accumulator_dtype)
  backend = c.check_backend(fn, backend)
  has_trace = momentum is not None

  def init_fn(params):
    c.flatten(fn, "params", params)
    trace = c.zeros_like(params, accumulator_dtype) if has_trace else None
    return SgdState(count=jnp.zeros([], jnp.int32), trace=trace)

  def step(updates, state, params, fused: bool):
    g, paths, treedef = c.flatten(fn, "updates", updates)
    trace = c.match(fn, "state.trace", state.trace, treedef, g, paths) if has_trace else None
    if fused:
      p = c.params_leaves(fn, params, treedef, g, paths)
    neg_lr, cast_lr = c.learning_rate(learning_rate, state.count)
    h = rules.Hyper(momentum=momentum if has_trace else 0.0, neg_lr=neg_lr)
    leaves = [(g[i],) + ((trace[i],) if has_trace else ()) + ((p[i],) if fused else ())
              for i in range(len(g))]
    c.pallas_dtype_check(backend, leaves, paths)
    rule = functools.partial(rules.sgd_rule, nesterov=nesterov, cast_lr=cast_lr,
                             accumulator_dtype=accumulator_dtype)
    if fused:
      rule = rules.applying(rule)
    outs, _ = execute(rule, h, rules.SGD_HYPER, leaves, backend=backend, pads=(0.0, 0.0, 0.0),
                      aliases={1: 1, **({0: len(leaves[0]) - 1} if fused else {})}, name="sgd",
                      fused_apply=fused)
    new_trace = jax.tree.unflatten(treedef, [o[1] for o in outs]) if has_trace else None
    return (jax.tree.unflatten(treedef, [o[0] for o in outs]),
            SgdState(count=c.safe_increment(state.count), trace=new_trace))

  return c.transformation(init_fn, step)

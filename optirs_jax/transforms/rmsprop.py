"""RMSprop (plain or centered, with optional momentum) as one fused GradientTransformation."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.executor import execute
from optirs_jax.transforms import _common as c


class RmspropState(NamedTuple):
  """State of :func:`rmsprop`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; bias correction and schedule step, saturating.
  nu: optax.Updates  # EMA of |g|^2, starting at ``initial_scale``.
  mu: optax.Updates | None  # EMA of g when centered, else None.
  trace: optax.Updates | None  # momentum buffer (after the learning rate), else None.


def rmsprop(learning_rate: optax.ScalarOrSchedule, decay: jax.typing.ArrayLike = 0.9,
            eps: jax.typing.ArrayLike = 1e-8, initial_scale: jax.typing.ArrayLike = 0.0,
            eps_in_sqrt: bool = True, centered: bool = False,
            momentum: jax.typing.ArrayLike | None = None, nesterov: bool = False,
            bias_correction: bool = False, *,
            backend: str = "auto") -> optax.GradientTransformation:
  r"""RMSprop; the same numbers as :func:`optax.rmsprop`.

  .. math::
    \begin{align*}
      v_k &= \rho v_{k-1} + (1-\rho) |g_k|^2, \qquad
      m_k = \rho m_{k-1} + (1-\rho) g_k \ (\text{centered}) \\
      s_k &= -\eta_k\, g_k / \sqrt{\hat v_k - |\hat m_k|^2 + \epsilon}
      \quad (\text{or } / (\sqrt{\cdot} + \epsilon) \text{ with } \texttt{eps\_in\_sqrt=False}) \\
      t_k &= s_k + \mu t_{k-1}, \qquad u_k = t_k \ (\text{Nesterov: } s_k + \mu t_k)
    \end{align*}

  :math:`m` only when centered, :math:`t` only with momentum (applied after the learning
  rate, as in optax), hats only with ``bias_correction``.

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    decay: the EMA decay :math:`\rho`.
    eps: the stabilizer :math:`\epsilon`.
    initial_scale: the starting value of :math:`v`.
    eps_in_sqrt: add ``eps`` inside the square root (default) or outside.
    centered: subtract the squared mean (centered RMSprop).
    momentum: the momentum decay :math:`\mu`, or ``None``.
    nesterov: use Nesterov momentum.
    bias_correction: divide the EMAs by :math:`1-\rho^k`.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> opt = optirs_jax.rmsprop(0.1, decay=0.0, eps=0.0)
    >>> params = jnp.array([1.0, 1.0])
    >>> updates, _ = opt.update(jnp.array([4.0, -2.0]), opt.init(params))
    >>> updates
    Array([-0.1,  0.1], dtype=float32)

  References:
    Hinton, `Overview of mini-batch gradient descent
    <www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf>`_, 2012;
    Graves, `Generating Sequences With Recurrent Neural Networks
    <https://arxiv.org/abs/1308.0850>`_, 2014.
  """
  fn = "optirs_jax.rmsprop"
  c.check_number_or_schedule(fn, "learning_rate", learning_rate)
  for name, value in (("decay", decay), ("eps", eps), ("initial_scale", initial_scale)):
    c.check_number(fn, name, value)
  c.check_number(fn, "momentum", momentum, allow_none=True)
  for name, value in (("eps_in_sqrt", eps_in_sqrt), ("centered", centered),
                      ("nesterov", nesterov), ("bias_correction", bias_correction)):
    c.check_flag(fn, name, value)
  backend = c.check_backend(fn, backend)
  has_trace = momentum is not None

  def init_fn(params):
    c.flatten(fn, "params", params)
    return RmspropState(count=jnp.zeros([], jnp.int32), nu=c.full_like(params, initial_scale),
                        mu=c.zeros_like(params) if centered else None,
                        trace=c.zeros_like(params) if has_trace else None)

  def step(updates, state, params, fused: bool):
    g, paths, treedef = c.flatten(fn, "updates", updates)
    slots = [c.match(fn, "state.nu", state.nu, treedef, g, paths)]
    if centered:
      slots.append(c.match(fn, "state.mu", state.mu, treedef, g, paths))
    if has_trace:
      slots.append(c.match(fn, "state.trace", state.trace, treedef, g, paths))
    if fused:
      slots.append(c.params_leaves(fn, params, treedef, g, paths))
    count_inc = c.safe_increment(state.count)
    neg_lr, cast_lr = c.learning_rate(learning_rate, state.count)
    h = rules.Hyper(decay=decay, c_decay=1 - decay, eps=eps,
                    bc=(1 - decay**c.as_float(count_inc)) if bias_correction else 1.0,
                    momentum=momentum if has_trace else 0.0, neg_lr=neg_lr)
    leaves = [(g[i],) + tuple(s[i] for s in slots) for i in range(len(g))]
    c.pallas_dtype_check(backend, leaves, paths)
    rule = functools.partial(rules.rmsprop_rule, centered=centered, eps_in_sqrt=eps_in_sqrt,
                             bias_correction=bias_correction, momentum=has_trace,
                             nesterov=nesterov, cast_lr=cast_lr)
    if fused:
      rule = rules.applying(rule)
    n_state = len(slots) - int(fused)
    pads = (0.0, 1.0) + (0.0,) * len(slots)
    aliases = {k: k for k in range(1, n_state + 1)}
    if fused:
      aliases[0] = len(slots)
    outs, _ = execute(rule, h, rules.RMSPROP_HYPER, leaves, backend=backend, pads=pads,
                      aliases=aliases, name="rmsprop", fused_apply=fused)
    column = lambda k: jax.tree.unflatten(treedef, [o[k] for o in outs])
    k_mu, k_trace = 2, 2 + int(centered)
    return column(0), RmspropState(
        count=count_inc, nu=column(1), mu=column(k_mu) if centered else None,
        trace=column(k_trace) if has_trace else None)

  return c.transformation(init_fn, step)

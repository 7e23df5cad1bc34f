"""Adam, AdamW and LAMB as single fused GradientTransformations."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.executor import execute
from optirs_jax.transforms import _common as c


class AdamState(NamedTuple):
  """State of :func:`adam`, :func:`adamw` and :func:`lamb`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; saturates at the int32 maximum.
  mu: optax.Updates  # first moment, in ``mu_dtype`` (or the updates' dtype).
  nu: optax.Updates  # second moment, in the params' dtype.


def _adam_family(fn: str, learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
                 nesterov: bool, backend: str, trust_ratio: bool) -> optax.GradientTransformation:
  c.check_number_or_schedule(fn, "learning_rate", learning_rate)
  for name, value in (("b1", b1), ("b2", b2), ("eps", eps), ("eps_root", eps_root)):
    c.check_number(fn, name, value)
  c.check_number_or_schedule(fn, "weight_decay", weight_decay)
  c.check_flag(fn, "nesterov", nesterov)
  mu_dtype = c.canonical_dtype(fn, "mu_dtype", mu_dtype)
  backend = c.check_backend(fn, backend)

  def init_fn(params):
    c.flatten(fn, "params", params)
    return AdamState(count=jnp.zeros([], jnp.int32), mu=c.zeros_like(params, mu_dtype),
                     nu=c.zeros_like(params))

  def step(updates, state, params, fused: bool):
    g, paths, treedef = c.flatten(fn, "updates", updates)
    mu = c.match(fn, "state.mu", state.mu, treedef, g, paths)
    nu = c.match(fn, "state.nu", state.nu, treedef, g, paths)
    wd, has_decay = c.weight_decay_value(weight_decay, state.count)
    p = None
    if has_decay or trust_ratio or fused:
      p = c.params_leaves(fn, params, treedef, g, paths)
    count_inc = c.safe_increment(state.count)
    step_f, next_f = c.as_float(count_inc), c.as_float(c.safe_increment(count_inc))
    neg_lr, cast_lr = c.learning_rate(learning_rate, state.count)
    h = rules.Hyper(
        b1=b1, c1=1 - b1, b2=b2, c2=1 - b2, eps=eps, eps_root=eps_root,
        bc1=1 - b1**step_f, bc1_next=1 - b1**next_f, bc2=1 - b2**step_f, wd=wd, neg_lr=neg_lr)
    decays = c.mask_flags(fn, mask, updates, treedef) if has_decay else [False] * len(g)
    # The kernel reads p only where the rule or a fused apply needs it (LAMB applies later).
    with_p = [decays[i] or trust_ratio or fused for i in range(len(g))]
    leaves = [(g[i], mu[i], nu[i]) + ((p[i],) if with_p[i] else ()) for i in range(len(g))]
    c.pallas_dtype_check(backend, leaves, paths)

    outs: list[Any] = [None] * len(g)
    norms: list[Any] = [None] * len(g)
    apply_in_kernel = fused and not trust_ratio
    for decay, idx in c.split_by(decays):
      rule = functools.partial(rules.adam_rule, nesterov=nesterov, decay=decay,
                               scale_lr=not trust_ratio, cast_lr=cast_lr, mu_dtype=mu_dtype)
      if apply_in_kernel:
        rule = rules.applying(rule, p_index=3 if decay else None)
      o, n = execute(rule, h, rules.ADAM_HYPER, [leaves[i] for i in idx], backend=backend,
                     pads=(0.0, 0.0, 1.0, 0.0),
                     aliases={1: 1, 2: 2, **({0: 3} if apply_in_kernel else {})},
                     norm_of=((3,), (0,)) if trust_ratio else None, name=fn.split(".")[-1],
                     fused_apply=apply_in_kernel)
      for j, i in enumerate(idx):
        outs[i] = o[j]
        norms[i] = n[j] if n is not None else None

    first = [o[0] for o in outs]
    if trust_ratio:  # second pass: the per-leaf ratio (fused by XLA with the unpacking)
      first = [rules.lamb_trust_scale(first[i], p[i], *norms[i], h, cast_lr)
               for i in range(len(g))]
      if fused:
        first = [(p[i] + first[i]).astype(p[i].dtype) for i in range(len(g))]
    new_state = AdamState(count=count_inc,
                          mu=jax.tree.unflatten(treedef, [o[1] for o in outs]),
                          nu=jax.tree.unflatten(treedef, [o[2] for o in outs]))
    return jax.tree.unflatten(treedef, first), new_state

  return c.transformation(init_fn, step)


def adam(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
         b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
         eps_root: jax.typing.ArrayLike = 0.0, mu_dtype: Any | None = None, *,
         nesterov: bool = False, backend: str = "auto") -> optax.GradientTransformation:
  r"""Adam, fused into one kernel pass; the same numbers as :func:`optax.adam`.

  .. math::
    \begin{align*}
      m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
      v_t = \beta_2 v_{t-1} + (1-\beta_2) |g_t|^2 \\
      \hat m_t &= m_t / (1-\beta_1^t), \qquad \hat v_t = v_t / (1-\beta_2^t) \\
      u_t &= -\eta_t\, \hat m_t / (\sqrt{\hat v_t + \bar\epsilon} + \epsilon)
    \end{align*}

  With ``nesterov=True`` (NAdam),
  :math:`\hat m_t = \beta_1 m_t / (1-\beta_1^{t+1}) + (1-\beta_1) g_t / (1-\beta_1^t)`.

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added inside the square root.
    mu_dtype: dtype of the first moment; ``None`` keeps the updates' dtype.
    nesterov: use Nesterov momentum (NAdam).
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"`` (see :mod:`optirs_jax.backends`).

  Returns:
    An :class:`optax.GradientTransformation` with state :class:`AdamState`.

  Example:
    >>> import jax.numpy as jnp, optax, optirs_jax
    >>> params = {"w": jnp.array([1.0, 2.0, 3.0])}
    >>> opt = optirs_jax.adam(1e-1)
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.array([0.5, -1.0, 0.0])}
    >>> updates, state = opt.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"]
    Array([0.9000007, 2.0999994, 3.       ], dtype=float32)

  References:
    Kingma and Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, 2014; Dozat, `Incorporating Nesterov Momentum
    into Adam <https://openreview.net/pdf?id=OM0jvwB8jIp57ZJjtNEZ>`_, 2016.
  """
  return _adam_family("optirs_jax.adam", learning_rate, b1, b2, eps, eps_root, mu_dtype, 0.0,
                      None, nesterov, backend, trust_ratio=False)


def adamw(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
          b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
          eps_root: jax.typing.ArrayLike = 0.0, mu_dtype: Any | None = None,
          weight_decay: optax.ScalarOrSchedule = 1e-4, mask: Any = None, *,
          nesterov: bool = False, backend: str = "auto") -> optax.GradientTransformation:
  r"""AdamW (decoupled weight decay), fused; the same numbers as :func:`optax.adamw`.

  .. math::
    u_t = -\eta_t \left( \hat m_t / (\sqrt{\hat v_t + \bar\epsilon} + \epsilon)
          + \lambda\, p_{t-1} \right)

  with :math:`\hat m_t, \hat v_t` as in :func:`adam`. The decay is multiplied by the
  learning rate, as in optax and PyTorch.

  Args:
    learning_rate, b1, b2, eps, eps_root, mu_dtype, nesterov, backend: as in :func:`adam`.
    weight_decay: the decay :math:`\lambda`, a number or a schedule.
    mask: a tree of bools (or a prefix of the params tree), or a callable returning one,
      ``True`` where the decay applies. Adam itself applies to every leaf.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> params = {"w": jnp.ones(3), "b": jnp.zeros(3)}
    >>> opt = optirs_jax.adamw(1e-3, weight_decay=0.1, mask={"w": True, "b": False})
    >>> updates, state = opt.update(params, opt.init(params), params)
    >>> updates["w"].shape
    (3,)

  References:
    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  return _adam_family("optirs_jax.adamw", learning_rate, b1, b2, eps, eps_root, mu_dtype,
                      weight_decay, mask, nesterov, backend, trust_ratio=False)


def lamb(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
         b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-6,
         eps_root: jax.typing.ArrayLike = 0.0, weight_decay: optax.ScalarOrSchedule = 0.0,
         mask: Any = None, *, backend: str = "auto") -> optax.GradientTransformation:
  r"""LAMB: Adam with a layer-wise trust ratio; the same numbers as :func:`optax.lamb`.

  .. math::
    \begin{align*}
      r_t &= \hat m_t / (\sqrt{\hat v_t + \bar\epsilon} + \epsilon) + \lambda p_{t-1} \\
      u_t &= -\eta_t\, \frac{\|p_{t-1}\|}{\|r_t\|}\, r_t
      \quad (\text{ratio } 1 \text{ where either norm is } 0)
    \end{align*}

  The norms are per leaf. On the Pallas backend the first pass writes the moments and
  ``r`` and, per block, partial sums of squares of ``p`` and ``r``; a segment sum gives the
  per-leaf norms and a second elementwise pass applies the ratio.

  Args:
    learning_rate, b1, b2, eps, eps_root, backend: as in :func:`adam`.
    weight_decay: the decay :math:`\lambda` (a number or a schedule).
    mask: where the decay applies (the trust ratio applies to every leaf).

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> params = {"w": jnp.array([3.0, 4.0])}
    >>> opt = optirs_jax.lamb(1e-2)
    >>> updates, _ = opt.update({"w": jnp.array([1.0, 0.0])}, opt.init(params), params)
    >>> updates["w"]
    Array([-0.05, -0.  ], dtype=float32)

  References:
    You et al., `Large Batch Optimization for Deep Learning: Training BERT in 76 minutes
    <https://arxiv.org/abs/1904.00962>`_, 2020.
  """
  return _adam_family("optirs_jax.lamb", learning_rate, b1, b2, eps, eps_root, None,
                      weight_decay, mask, False, backend, trust_ratio=True)

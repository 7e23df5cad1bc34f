"""Yogi: Adam whose second moment moves by the sign of its gap to the squared gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Field, OptimizerSpec
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry
from optirs_jax.transforms.adam import AdamState, adam_scalars

INITIAL = 1e-6  # optax's scale_by_yogi's initial_accumulator_value (yogi does not expose it)


def yogi_rule(h, g, *, p, mu, nu, cast_lr: bool):
  r"""optax's ``scale_by_yogi`` then the learning rate: ``(u, mu, nu)`` with
  :math:`v \leftarrow v - (1-\beta_2)\,\mathrm{sign}(v - |g|^2)\,|g|^2`."""
  del p
  new_mu = rules.ema(h.b1, h.c1, g, mu)
  g2 = rules.abs_sq(g)
  new_nu = nu - h.c2 * jnp.sign(nu - g2) * g2
  mu_hat = rules.debias(new_mu, h.bc1)
  nu_hat = rules.debias(new_nu, h.bc2)
  u = mu_hat / (jnp.sqrt(nu_hat + h.eps_root) + h.eps)
  return rules.scale_lr(h, u, cast_lr), new_mu, new_nu.astype(nu.dtype)


YOGI = OptimizerSpec(
    name="yogi",
    arguments=(("learning_rate", "schedule"), ("b1", "decay rate"), ("b2", "decay rate"),
               ("eps", "number")) + ROUNDING,
    state=AdamState,
    fields=(Field("mu", init=INITIAL), Field("nu", init=INITIAL, pad=1.0, nonneg=True)),
    rule=yogi_rule,
    hyper=("b1", "c1", "c2", "eps", "eps_root", "bc1", "bc2", "neg_lr"),
    scalars=lambda o, count: adam_scalars(dict(o, eps_root=0.0), count),
)


def yogi(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
         b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-3, *,
         stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
         executor_options: ExecutorOptions | None = None,
         state_quantization: str | None = None, quantization_block_size: int = 256,
         min_quantized_size: int = 4096
         ) -> optax.GradientTransformationExtraArgs:
  r"""Yogi, fused; the same numbers as :func:`optax.yogi`.

  .. math::
    \begin{align*}
      m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
      v_t = v_{t-1} - (1-\beta_2)\, \mathrm{sign}(v_{t-1} - |g_t|^2)\, |g_t|^2 \\
      u_t &= -\eta_t\, \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}
    \end{align*}

  Both moments start at 1e-6 (optax's ``scale_by_yogi`` default).

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    b1, b2: the moments' decay rates.
    eps: added to the denominator (Yogi's default is large, 1e-3).
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.yogi(1e-1)
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> [round(v, 5) for v in updates["w"].tolist()]
    [-0.0996, 0.09985]

  References:
    Zaheer et al., `Adaptive Methods for Nonconvex Optimization
    <https://papers.nips.cc/paper/8186-adaptive-methods-for-nonconvex-optimization>`_, 2018.
  """
  return build(YOGI, locals())


ENTRIES = (
    Entry("yogi", yogi, YOGI, optax.yogi, cases=({}, {"b1": 0.8, "b2": 0.99, "eps": 1e-6}),
          alias=({"learning_rate": 1e-1},), moments=(("mu", 0, "mu"), ("nu", 0, "nu")),
          bytes_per_param=28),
)

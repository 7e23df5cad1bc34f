"""AMSGrad: Adam with the running maximum of the second moment."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Field, OptimizerSpec
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry
from optirs_jax.transforms.adam import adam_scalars


class AmsgradState(NamedTuple):
  """State of :func:`amsgrad`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; saturates at the int32 maximum.
  mu: optax.Updates  # first moment, in ``mu_dtype`` (or the updates' dtype).
  nu: optax.Updates  # second moment.
  nu_max: optax.Updates  # the running maximum of the (bias-corrected) second moment.


def amsgrad_rule(h, g, *, p, mu, nu, nu_max, bias_correction_mu: bool,
                 bias_correction_nu: bool, cast_lr: bool, mu_dtype=None):
  r"""optax's ``scale_by_amsgrad`` then the learning rate: ``(u, mu, nu, nu_max)``."""
  del p
  new_mu = rules.ema(h.b1, h.c1, g, mu)
  new_nu = rules.ema(h.b2, h.c2, rules.sq(g), nu)
  mu_hat = rules.debias(new_mu, h.bc1) if bias_correction_mu else new_mu
  nu_eff = rules.debias(new_nu, h.bc2) if bias_correction_nu else new_nu
  new_max = jnp.maximum(nu_max, nu_eff)
  u = mu_hat / (jnp.sqrt(new_max + h.eps_root) + h.eps)
  return (rules.scale_lr(h, u, cast_lr), rules.cast(new_mu, mu_dtype), new_nu.astype(nu.dtype),
          new_max.astype(nu_max.dtype))


AMSGRAD = OptimizerSpec(
    name="amsgrad",
    arguments=(("learning_rate", "schedule"), ("b1", "decay rate"), ("b2", "decay rate"),
               ("eps", "number"), ("eps_root", "number"), ("mu_dtype", "dtype"),
               ("bias_correction_mu", "flag"), ("bias_correction_nu", "flag")) + ROUNDING,
    state=AmsgradState,
    fields=(Field("mu", dtype="mu_dtype"), Field("nu", pad=1.0, nonneg=True),
            Field("nu_max", pad=1.0, nonneg=True)),
    rule=amsgrad_rule,
    hyper=("b1", "c1", "b2", "c2", "eps", "eps_root", "bc1", "bc2", "neg_lr"),
    scalars=adam_scalars,
    static=lambda o: dict(bias_correction_mu=bool(o["bias_correction_mu"]),
                          bias_correction_nu=bool(o["bias_correction_nu"]),
                          mu_dtype=o["mu_dtype"]),
)


def amsgrad(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
            b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
            eps_root: jax.typing.ArrayLike = 0.0, mu_dtype: Any | None = None,
            bias_correction_mu: bool = True, bias_correction_nu: bool = True, *,
            stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
            executor_options: ExecutorOptions | None = None,
            state_quantization: str | None = None, quantization_block_size: int = 256,
            min_quantized_size: int = 4096
            ) -> optax.GradientTransformationExtraArgs:
  r"""AMSGrad, fused; the same numbers as :func:`optax.amsgrad`.

  .. math::
    \begin{align*}
      m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
      v_t = \beta_2 v_{t-1} + (1-\beta_2) |g_t|^2 \\
      \hat v^{\max}_t &= \max(\hat v^{\max}_{t-1}, v_t / (1-\beta_2^t)) \\
      u_t &= -\eta_t\, \frac{m_t / (1-\beta_1^t)}{\sqrt{\hat v^{\max}_t + \bar\epsilon}
             + \epsilon}
    \end{align*}

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    b1, b2: the moments' decay rates.
    eps, eps_root: added outside and inside the square root.
    mu_dtype: dtype of the first moment; ``None``: the updates' dtype.
    bias_correction_mu, bias_correction_nu: correct the first, the second moment's bias.
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.amsgrad(1e-1)
    >>> updates, state = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> [round(v, 5) for v in updates["w"].tolist()]
    [-0.1, 0.1]
    >>> [round(v, 5) for v in state.nu_max["w"].tolist()]
    [0.25, 1.00001]

  References:
    Reddi, Kale and Kumar, `On the Convergence of Adam and Beyond
    <https://openreview.net/forum?id=ryQu7f-RZ>`_, 2018.
  """
  return build(AMSGRAD, locals())


ENTRIES = (
    Entry("amsgrad", amsgrad, AMSGRAD, optax.amsgrad,
          cases=({}, {"b1": 0.8, "eps_root": 1e-8}, {"bias_correction_nu": False},
                 {"bias_correction_mu": False, "mu_dtype": jnp.float32}),
          alias=({"learning_rate": 1e-1},),
          moments=(("mu", 0, "mu"), ("nu", 0, "nu"), ("nu_max", 0, "nu_max")),
          bytes_per_param=36),
)

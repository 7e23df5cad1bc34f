"""Optimistic gradient descent, and optimistic Adam: steps extrapolated from the last one."""

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
from optirs_jax.transforms.adam import adam_rule, adam_scalars


class OptimisticState(NamedTuple):
  """State of :func:`optimistic_gradient_descent`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; 0 before the first step (optax's flag).
  previous_gradient: optax.Updates  # the last step's gradient.


class OptimisticAdamState(NamedTuple):
  """State of :func:`optimistic_adam_v2`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; saturates at the int32 maximum.
  mu: optax.Updates  # Adam's first moment.
  nu: optax.Updates  # Adam's second moment.
  previous_gradient: optax.Updates  # the last step's Adam direction.


def _optimistic(h, d, previous):
  """optax's ``scale_by_optimistic_gradient`` on the direction ``d``."""
  previous = rules.where_scalar(h.first > 0, d, previous)
  return h.alpha_beta * d - h.beta * previous


def optimistic_rule(h, g, *, p, previous_gradient, cast_lr: bool):
  """Optimistic gradient descent: ``(u, previous_gradient)``."""
  del p
  u = _optimistic(h, g, previous_gradient)
  return rules.scale_lr(h, u, cast_lr), g.astype(previous_gradient.dtype)


def optimistic_adam_rule(h, g, *, p, mu, nu, previous_gradient, nesterov: bool,
                         cast_lr: bool, mu_dtype=None):
  """Adam's direction, then the optimistic step on it: ``(u, mu, nu, previous)``."""
  d, new_mu, new_nu = adam_rule(h, g, p=p, mu=mu, nu=nu, nesterov=nesterov, decay=False,
                                scale=False, cast_lr=cast_lr, mu_dtype=mu_dtype)
  u = _optimistic(h, d, previous_gradient)
  return rules.scale_lr(h, u, cast_lr), new_mu, new_nu, d.astype(previous_gradient.dtype)


def _scalars(o, count) -> dict:
  return dict(alpha_beta=o["alpha"] + o["beta"], beta=o["beta"],
              first=jnp.asarray(count == 0, jnp.float32))


OPTIMISTIC = OptimizerSpec(
    name="optimistic_gradient_descent",
    arguments=(("learning_rate", "schedule"), ("alpha", "number"), ("beta", "number")) + ROUNDING,
    state=OptimisticState,
    fields=(Field("previous_gradient"),),
    rule=optimistic_rule,
    hyper=("alpha_beta", "beta", "first", "neg_lr"),
    scalars=_scalars,
)

OPTIMISTIC_ADAM = OptimizerSpec(
    name="optimistic_adam_v2",
    arguments=(("learning_rate", "schedule"), ("alpha", "number"), ("beta", "number"),
               ("b1", "decay rate"), ("b2", "decay rate"), ("eps", "number"),
               ("eps_root", "number"), ("mu_dtype", "dtype"), ("nesterov", "flag")) + ROUNDING,
    state=OptimisticAdamState,
    fields=(Field("mu", dtype="mu_dtype"), Field("nu", pad=1.0, nonneg=True),
            Field("previous_gradient")),
    rule=optimistic_adam_rule,
    hyper=("b1", "c1", "b2", "c2", "eps", "eps_root", "bc1", "bc1_next", "bc2", "alpha_beta",
           "beta", "first", "neg_lr"),
    scalars=lambda o, count: adam_scalars(o, count) | _scalars(o, count),
    static=lambda o: dict(nesterov=bool(o["nesterov"]), mu_dtype=o["mu_dtype"]),
)


def optimistic_gradient_descent(learning_rate: optax.ScalarOrSchedule,
                                alpha: jax.typing.ArrayLike = 1.0,
                                beta: jax.typing.ArrayLike = 1.0, *,
                                stochastic_rounding: bool = False, rounding_seed: int = 0,
                                backend: str = "auto",
                                executor_options: ExecutorOptions | None = None,
                                state_quantization: str | None = None,
                                quantization_block_size: int = 256,
                                min_quantized_size: int = 4096
                                ) -> optax.GradientTransformationExtraArgs:
  r"""Optimistic gradient descent, fused; the same numbers as
  :func:`optax.optimistic_gradient_descent`.

  .. math:: u_t = -\eta_t \left( (\alpha + \beta)\, g_t - \beta\, g_{t-1} \right)

  with :math:`g_0` taken for :math:`g_{-1}` at the first step.

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    alpha, beta: the weights of the gradient and of its change (numbers).
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.optimistic_gradient_descent(1e-1)
    >>> state = tx.init({"w": jnp.zeros(2)})
    >>> _, state = tx.update({"w": jnp.array([0.5, -1.0])}, state)
    >>> tx.update({"w": jnp.array([1.0, 1.0])}, state)[0]["w"]
    Array([-0.15, -0.3 ], dtype=float32)

  References:
    Mokhtari, Ozdaglar and Pattathil, `A Unified Analysis of Extra-gradient and Optimistic
    Gradient Methods for Saddle Point Problems <https://arxiv.org/abs/1901.08511>`_, 2019.
  """
  return build(OPTIMISTIC, locals())


def optimistic_adam_v2(learning_rate: optax.ScalarOrSchedule, *,
                       alpha: jax.typing.ArrayLike = 1.0, beta: jax.typing.ArrayLike = 1.0,
                       b1: jax.typing.ArrayLike = 0.9, b2: jax.typing.ArrayLike = 0.999,
                       eps: jax.typing.ArrayLike = 1e-8, eps_root: jax.typing.ArrayLike = 0.0,
                       mu_dtype: Any | None = None, nesterov: bool = True,
                       stochastic_rounding: bool = False, rounding_seed: int = 0,
                       backend: str = "auto", executor_options: ExecutorOptions | None = None,
                       state_quantization: str | None = None, quantization_block_size: int = 256,
                       min_quantized_size: int = 4096
                       ) -> optax.GradientTransformationExtraArgs:
  r"""Optimistic Adam, fused; the same numbers as :func:`optax.optimistic_adam_v2`: the
  optimistic step (:func:`optimistic_gradient_descent`) on Adam's direction :math:`d_t`.

  .. math:: u_t = -\eta_t \left( (\alpha + \beta)\, d_t - \beta\, d_{t-1} \right)

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    alpha, beta: the weights of the direction and of its change.
    b1, b2, eps, eps_root, mu_dtype, nesterov: Adam's, as in :func:`~optirs_jax.adam`
      (Nesterov momentum by default, as optax's).
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.optimistic_adam_v2(1e-1)
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> [round(v, 5) for v in updates["w"].tolist()]
    [-0.14737, 0.14737]

  References:
    Daskalakis et al., `Training GANs with Optimism <https://arxiv.org/abs/1711.00141>`_,
    2018.
  """
  return build(OPTIMISTIC_ADAM, locals())


ENTRIES = (
    Entry("optimistic_gradient_descent", optimistic_gradient_descent, OPTIMISTIC,
          optax.optimistic_gradient_descent, cases=({}, {"alpha": 0.7, "beta": 0.1}),
          alias=({"learning_rate": 2e-3, "alpha": 0.7, "beta": 0.1},),
          moments=(("previous_gradient", 0, "previous_gradient"),), complex=False),
    Entry("optimistic_adam_v2", optimistic_adam_v2, OPTIMISTIC_ADAM, optax.optimistic_adam_v2,
          cases=({}, {"alpha": 0.7, "beta": 0.1, "nesterov": False},
                 {"mu_dtype": jnp.float32, "b1": 0.8}),
          alias=({"learning_rate": 2e-3},),
          moments=(("mu", 0, "mu"), ("nu", 0, "nu"), ("previous_gradient", 1,
                                                       "previous_gradient")),
          bytes_per_param=36),
)

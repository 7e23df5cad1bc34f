"""Adagrad."""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Field, OptimizerSpec
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry


class AdagradState(NamedTuple):
  """State of :func:`adagrad`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the schedule's step, saturating.
  sum_of_squares: optax.Updates  # running sum of |g|^2, in the params' dtype.


def adagrad_rule(h, g, *, p, sum_of_squares, cast_lr: bool):
  r"""Adagrad: :math:`s \leftarrow s + |g|^2`, :math:`u = -\eta\, g / \sqrt{s + \epsilon}`
  (0 where s = 0)."""
  del p
  new_s = rules.abs_sq(g) + sum_of_squares
  inv = jnp.where(new_s > 0, jax.lax.rsqrt(new_s + h.eps), 0.0)
  return rules.scale_lr(h, inv * g, cast_lr), new_s


def _validate(fn, options):
  value = options["initial_accumulator_value"]
  if isinstance(value, numbers.Real) and value < 0:
    raise ValueError(f"{fn}: initial_accumulator_value={value} must be >= 0")


ADAGRAD = OptimizerSpec(
    name="adagrad",
    arguments=(("learning_rate", "schedule"), ("initial_accumulator_value", "number"),
               ("eps", "number")) + ROUNDING,
    state=AdagradState,
    fields=(Field("sum_of_squares", init="initial_accumulator_value", pad=1.0,
                  nonneg=True),),
    rule=adagrad_rule,
    hyper=("eps", "neg_lr"),
    scalars=lambda o, count: dict(eps=o["eps"]),
    validate=_validate,
)


def adagrad(learning_rate: optax.ScalarOrSchedule,
            initial_accumulator_value: jax.typing.ArrayLike = 0.1,
            eps: jax.typing.ArrayLike = 1e-7, *, stochastic_rounding: bool = False,
            rounding_seed: int = 0, backend: str = "auto",
            executor_options: ExecutorOptions | None = None,
            state_quantization: str | None = None, quantization_block_size: int = 256,
            min_quantized_size: int = 4096
            ) -> optax.GradientTransformationExtraArgs:
  r"""Adagrad; the same numbers as :func:`optax.adagrad`.

  .. math::
    s_k = s_{k-1} + |g_k|^2, \qquad u_k = -\eta_k\, g_k / \sqrt{s_k + \epsilon}
    \quad (0 \text{ where } s_k = 0)

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    initial_accumulator_value: the starting value of :math:`s` (must be >= 0).
    eps: added inside the square root.
    stochastic_rounding, rounding_seed: as in :func:`~optirs_jax.adam`.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.
    executor_options: the kernels' layout and launch options (:class:`~optirs_jax.ExecutorOptions`).
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

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
  return build(ADAGRAD, locals())


ENTRIES = (
    Entry("adagrad", adagrad, ADAGRAD, optax.adagrad,
          cases=({}, {"initial_accumulator_value": 0.0, "eps": 1e-5}),
          alias=({"learning_rate": 1.0},), moments=(("sum_of_squares", 0, "sum_of_squares"),)),
)

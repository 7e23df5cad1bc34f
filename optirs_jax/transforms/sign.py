"""signSGD and Signum: steps of the learning rate times the sign of the gradient, or of its
momentum."""

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


class SignSgdState(NamedTuple):
  """State of :func:`sign_sgd`: the schedule's step only."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the schedule's step, saturating.


class SignumState(NamedTuple):
  """State of :func:`signum`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the schedule's step, saturating.
  ema: optax.Updates  # the momentum, in ``accumulator_dtype`` (or the updates' dtype).


def sign_sgd_rule(h, g, *, p, cast_lr: bool):
  """optax's ``scale_by_sign`` then the learning rate."""
  del p
  return (rules.scale_lr(h, jnp.sign(g), cast_lr),)


def signum_rule(h, g, *, p, ema, cast_lr: bool, accumulator_dtype=None):
  """optax's ``ema`` (not debiased), ``scale_by_sign``, then the learning rate."""
  del p
  new = rules.ema(h.beta, h.c_beta, g, ema)
  return rules.scale_lr(h, jnp.sign(new), cast_lr), rules.cast(new, accumulator_dtype)


SIGN_SGD = OptimizerSpec(
    name="sign_sgd", arguments=(("learning_rate", "schedule"),) + ROUNDING, state=SignSgdState,
    fields=(), rule=sign_sgd_rule, hyper=("neg_lr",), scalars=lambda o, count: {})

SIGNUM = OptimizerSpec(
    name="signum",
    arguments=(("learning_rate", "schedule"), ("beta", "decay rate"),
               ("accumulator_dtype", "dtype")) + ROUNDING,
    state=SignumState,
    fields=(Field("ema", dtype="accumulator_dtype"),),
    rule=signum_rule,
    hyper=("beta", "c_beta", "neg_lr"),
    scalars=lambda o, count: dict(beta=o["beta"], c_beta=1 - o["beta"]),
    static=lambda o: dict(accumulator_dtype=o["accumulator_dtype"]),
)


def sign_sgd(learning_rate: optax.ScalarOrSchedule, *, stochastic_rounding: bool = False,
             rounding_seed: int = 0, backend: str = "auto",
             executor_options: ExecutorOptions | None = None
             ) -> optax.GradientTransformationExtraArgs:
  r"""signSGD, fused; the same numbers as :func:`optax.sign_sgd`.

  .. math:: u_t = -\eta_t\, \mathrm{sign}(g_t)

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.sign_sgd(1e-1)
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0, 0.0])}, tx.init({"w": jnp.zeros(3)}))
    >>> updates["w"]
    Array([-0.1,  0.1, -0. ], dtype=float32)

  References:
    Bernstein et al., `signSGD: Compressed Optimisation for Non-Convex Problems
    <https://arxiv.org/abs/1802.04434>`_, 2018.
  """
  return build(SIGN_SGD, locals())


def signum(learning_rate: optax.ScalarOrSchedule, beta: jax.typing.ArrayLike = 0.9,
           accumulator_dtype: Any | None = None, *, stochastic_rounding: bool = False,
           rounding_seed: int = 0, backend: str = "auto",
           executor_options: ExecutorOptions | None = None,
           state_quantization: str | None = None, quantization_block_size: int = 256,
           min_quantized_size: int = 4096
           ) -> optax.GradientTransformationExtraArgs:
  r"""Signum (signSGD with momentum), fused; the same numbers as :func:`optax.signum`.

  .. math::
    m_t = \beta m_{t-1} + (1-\beta) g_t,\qquad u_t = -\eta_t\, \mathrm{sign}(m_t)

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    beta: the momentum's decay rate.
    accumulator_dtype: dtype of the momentum; ``None``: the updates' dtype.
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.signum(1e-1)
    >>> updates, state = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> updates["w"], state.ema["w"]
    (Array([-0.1,  0.1], dtype=float32), Array([ 0.05, -0.1 ], dtype=float32))

  References:
    Bernstein et al., `signSGD: Compressed Optimisation for Non-Convex Problems
    <https://arxiv.org/abs/1802.04434>`_, 2018.
  """
  return build(SIGNUM, locals())


ENTRIES = (
    Entry("sign_sgd", sign_sgd, SIGN_SGD, optax.sign_sgd, alias=({"learning_rate": 1e-1},),
          complex=False, bytes_per_param=12),
    Entry("signum", signum, SIGNUM, optax.signum,
          cases=({}, {"beta": 0.5}, {"accumulator_dtype": jnp.float32}),
          alias=({"learning_rate": 1e-2},), moments=(("ema", 0, "ema"),), complex=False),
)

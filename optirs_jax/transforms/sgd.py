"""SGD with optional (Nesterov) momentum."""

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


class SgdState(NamedTuple):
  """State of :func:`sgd`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the schedule's step, saturating.
  trace: optax.Params | None  # momentum buffer in ``accumulator_dtype``; None without momentum.


def sgd_rule(h, g, *, p, trace=None, nesterov: bool, cast_lr: bool, accumulator_dtype=None):
  r"""SGD with optional (Nesterov) momentum: :math:`t \leftarrow g + \mu t`, :math:`u = -\eta t`.

  Without a momentum buffer (``trace is None``) the rule is plain ``-lr * g``.
  """
  del p
  if trace is None:
    return (rules.scale_lr(h, g, cast_lr),)
  new_t = g + h.momentum * trace
  u = g + h.momentum * new_t if nesterov else new_t
  return rules.scale_lr(h, u, cast_lr), rules.cast(new_t, accumulator_dtype)


SGD = OptimizerSpec(
    name="sgd",
    arguments=(("learning_rate", "schedule"), ("momentum", "optional number"),
               ("nesterov", "flag"), ("accumulator_dtype", "dtype")) + ROUNDING,
    state=SgdState,
    fields=(Field("trace", dtype="accumulator_dtype", when="momentum"),),
    rule=sgd_rule,
    hyper=("momentum", "neg_lr"),
    scalars=lambda o, count: dict(momentum=0.0 if o["momentum"] is None else o["momentum"]),
    static=lambda o: dict(nesterov=bool(o["nesterov"]), accumulator_dtype=o["accumulator_dtype"]),
)


def sgd(learning_rate: optax.ScalarOrSchedule, momentum: jax.typing.ArrayLike | None = None,
        nesterov: bool = False, accumulator_dtype: Any | None = None, *,
        stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
        executor_options: ExecutorOptions | None = None,
        state_quantization: str | None = None, quantization_block_size: int = 256,
        min_quantized_size: int = 4096
        ) -> optax.GradientTransformationExtraArgs:
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
    stochastic_rounding, rounding_seed: as in :func:`~optirs_jax.adam`.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.
    executor_options: the kernels' layout and launch options (:class:`~optirs_jax.ExecutorOptions`).
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

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
  return build(SGD, locals())


ENTRIES = (
    Entry("sgd", sgd, SGD, optax.sgd,
          cases=({}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True},
                 {"momentum": 0.5, "accumulator_dtype": jnp.float32}),
          typical={"momentum": 0.9, "nesterov": True},
          alias=({"learning_rate": 1e-3, "momentum": 0.9},),
          moments=(("trace", 0, "trace"),)),
)

"""Lion: the sign of an interpolation of gradient and momentum (one state field)."""

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


class LionState(NamedTuple):
  """State of :func:`lion`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the schedule's step, saturating.
  mu: optax.Updates  # momentum, in ``mu_dtype`` (or the updates' dtype).


def lion_rule(h, g, *, p, mu, decay: bool, cast_lr: bool, mu_dtype=None):
  r"""Lion: the sign of an interpolation of the gradient and the momentum.

  .. math::
    u = -\eta\,(\mathrm{sign}((1-\beta_1) g + \beta_1 m) + \lambda p),\qquad
    m \leftarrow (1-\beta_2) g + \beta_2 m
  """
  u = jnp.sign(h.c1 * g + h.b1 * mu)
  new_mu = rules.cast(rules.ema(h.b2, h.c2, g, mu), mu_dtype)
  if decay:
    u = u + h.wd * p
  return rules.scale_lr(h, u, cast_lr), new_mu


LION = OptimizerSpec(
    name="lion",
    arguments=(("learning_rate", "schedule"), ("b1", "decay rate"), ("b2", "decay rate"),
               ("mu_dtype", "dtype"), ("weight_decay", "schedule"), ("mask", "mask")) + ROUNDING,
    state=LionState,
    fields=(Field("mu", dtype="mu_dtype"),),
    rule=lion_rule,
    hyper=("b1", "c1", "b2", "c2", "wd", "neg_lr"),
    scalars=lambda o, count: dict(b1=o["b1"], c1=1.0 - o["b1"], b2=o["b2"], c2=1 - o["b2"]),
    static=lambda o: dict(mu_dtype=o["mu_dtype"]),
    weight_decay=True,
)


def lion(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
         b2: jax.typing.ArrayLike = 0.99, mu_dtype: Any | None = None,
         weight_decay: optax.ScalarOrSchedule = 1e-3, mask: Any = None, *,
         stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
         executor_options: ExecutorOptions | None = None,
         state_quantization: str | None = None, quantization_block_size: int = 256,
         min_quantized_size: int = 4096
         ) -> optax.GradientTransformationExtraArgs:
  r"""Lion; the same numbers as :func:`optax.lion`.

  .. math::
    \begin{align*}
      u_t &= -\eta_t \left( \mathrm{sign}\big((1-\beta_1) g_t + \beta_1 m_{t-1}\big)
             + \lambda\, p_{t-1} \right) \\
      m_t &= \beta_2 m_{t-1} + (1-\beta_2) g_t
    \end{align*}

  One state field instead of Adam's two; updates are :math:`\pm\eta` per element (plus the
  decay), so Lion takes a learning rate 3-10x smaller than AdamW's and a decay 3-10x
  larger.

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    b1: the interpolation weight of the momentum in the update's sign.
    b2: the decay of the momentum.
    mu_dtype: dtype of the momentum; ``None`` keeps the updates' dtype.
    weight_decay: the decoupled decay :math:`\lambda` (multiplied by the learning rate).
    mask: where the decay applies (a tree of bools, a prefix of one, or a callable).
    stochastic_rounding, rounding_seed: as in :func:`~optirs_jax.adam`.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.
    executor_options: the kernels' layout and launch options (:class:`~optirs_jax.ExecutorOptions`).
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with state :class:`LionState`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> opt = optirs_jax.lion(0.1, weight_decay=0.0)
    >>> params = jnp.array([1.0, 1.0, 1.0])
    >>> updates, state = opt.update(jnp.array([0.5, -2.0, 0.25]), opt.init(params), params)
    >>> updates
    Array([-0.1,  0.1, -0.1], dtype=float32)

  References:
    Chen et al., `Symbolic Discovery of Optimization Algorithms
    <https://arxiv.org/abs/2302.06675>`_, 2023.
  """
  return build(LION, locals())


ENTRIES = (
    Entry("lion", lion, LION, optax.lion,
          cases=({}, {"b1": 0.8, "b2": 0.95, "weight_decay": 0.0},
                 {"mu_dtype": jnp.float32, "weight_decay": optax.linear_schedule(0.1, 0.0, 50)},
                 {"weight_decay": 0.1, "mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)}),
          alias=({"learning_rate": 1e-2, "weight_decay": 1e-4},), moments=(("mu", 0, "mu"),),
          complex=False),
)

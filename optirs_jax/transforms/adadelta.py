"""Adadelta: steps scaled by the ratio of the updates' and the gradients' RMS."""

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


class AdadeltaState(NamedTuple):
  """State of :func:`adadelta`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the schedules' step, saturating.
  e_g: optax.Updates  # EMA of the squared gradients.
  e_x: optax.Updates  # EMA of the squared updates.


def adadelta_rule(h, g, *, p, e_g, e_x, decay: bool, scale: bool, cast_lr: bool):
  r"""optax's ``add_decayed_weights``, ``scale_by_adadelta`` then the learning rate (none
  when ``learning_rate`` is None): ``(u, e_g, e_x)``."""
  if decay:
    g = g + h.wd * p
  new_e_g = rules.ema(h.rho, h.c_rho, g**2, e_g)
  u = (jnp.sqrt(e_x + h.eps) / jnp.sqrt(new_e_g + h.eps)) * g
  new_e_x = rules.ema(h.rho, h.c_rho, u**2, e_x)
  if scale:
    u = rules.scale_lr(h, u, cast_lr)
  return u, new_e_g.astype(e_g.dtype), new_e_x.astype(e_x.dtype)


ADADELTA = OptimizerSpec(
    name="adadelta",
    arguments=(("learning_rate", "optional schedule"), ("rho", "decay rate"), ("eps", "number"),
               ("weight_decay", "schedule"), ("mask", "mask")) + ROUNDING,
    state=AdadeltaState,
    fields=(Field("e_g", pad=1.0, nonneg=True), Field("e_x", nonneg=True)),
    rule=adadelta_rule,
    hyper=("rho", "c_rho", "eps", "wd", "neg_lr"),
    scalars=lambda o, count: dict(rho=o["rho"], c_rho=1 - o["rho"], eps=o["eps"]),
    static=lambda o: dict(scale=o["learning_rate"] is not None),
    weight_decay=True,
)


def adadelta(learning_rate: optax.ScalarOrSchedule | None = None,
             rho: jax.typing.ArrayLike = 0.9, eps: jax.typing.ArrayLike = 1e-6,
             weight_decay: optax.ScalarOrSchedule = 0.0, weight_decay_mask: Any = None, *,
             stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
             executor_options: ExecutorOptions | None = None,
             state_quantization: str | None = None, quantization_block_size: int = 256,
             min_quantized_size: int = 4096
             ) -> optax.GradientTransformationExtraArgs:
  r"""Adadelta, fused; the same numbers as :func:`optax.adadelta`.

  .. math::
    \begin{align*}
      g_t &\leftarrow g_t + \lambda p_{t-1} \\
      E[g^2]_t &= \rho E[g^2]_{t-1} + (1-\rho) g_t^2,\qquad
      x_t = \frac{\sqrt{E[x^2]_{t-1} + \epsilon}}{\sqrt{E[g^2]_t + \epsilon}}\, g_t \\
      E[x^2]_t &= \rho E[x^2]_{t-1} + (1-\rho) x_t^2,\qquad u_t = -\eta_t\, x_t
    \end{align*}

  As in optax, ``learning_rate=None`` (the default) scales by nothing: the update is
  :math:`x_t` itself.

  Args:
    learning_rate: ``None``, a number, a scalar array or a schedule ``count -> lr``.
    rho: the decay rate of both averages.
    eps: added inside both square roots.
    weight_decay: L2 decay :math:`\lambda` added to the gradient first (a number or a
      schedule).
    weight_decay_mask: where the decay applies (a tree of bools or a callable returning one).
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adadelta(1.0)
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> updates["w"]
    Array([-0.00316221,  0.00316226], dtype=float32)

  References:
    Zeiler, `ADADELTA: An Adaptive Learning Rate Method
    <https://arxiv.org/abs/1212.5701>`_, 2012.
  """
  return build(ADADELTA, dict(locals(), mask=weight_decay_mask))


ENTRIES = (
    Entry("adadelta", adadelta, ADADELTA, optax.adadelta,
          cases=({}, {"rho": 0.8, "eps": 1e-8},
                 {"weight_decay": 0.01},
                 {"weight_decay": 0.1,
                  "weight_decay_mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)}),
          alias=({"learning_rate": 0.1}, {}), moments=(("e_g", 1, "e_g"), ("e_x", 1, "e_x")),
          complex=False, bytes_per_param=28),
)

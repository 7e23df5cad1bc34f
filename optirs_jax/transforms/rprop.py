"""Rprop: per-element step sizes grown or shrunk by the sign agreement of the gradients."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Field, OptimizerSpec
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry


class RpropState(NamedTuple):
  """State of :func:`rprop`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the steps taken, saturating.
  step_sizes: optax.Updates  # per element, starting at the learning rate.
  prev_updates: optax.Updates  # the last step's signed step sizes (0 after a sign change).


def rprop_rule(h, g, *, p, step_sizes, prev_updates, cast_lr: bool):
  r"""optax's ``scale_by_rprop`` then ``scale(-1.0)``: ``(u, step_sizes, prev_updates)``."""
  del p, cast_lr  # rprop's learning rate is its initial step size, not a scale
  s = g * prev_updates
  grown = jnp.clip(step_sizes * jnp.where(s > 0, h.eta_plus, h.eta_minus),
                   min=h.min_step_size, max=h.max_step_size)
  new_steps = jnp.where(s == 0, step_sizes, grown)
  new_prev = jnp.where(s < 0, jnp.zeros_like(g), new_steps * jnp.sign(g))
  # As optax computes it: the step is the *previous* signed step size (0 after a sign
  # change), so the first step is zero.
  u = jnp.where(s < 0, jnp.zeros_like(prev_updates), prev_updates)
  return -1.0 * u, new_steps.astype(step_sizes.dtype), new_prev.astype(prev_updates.dtype)


RPROP = OptimizerSpec(
    name="rprop",
    arguments=(("learning_rate", "number"), ("eta_minus", "number"), ("eta_plus", "number"),
               ("min_step_size", "number"), ("max_step_size", "number")) + ROUNDING,
    state=RpropState,
    fields=(Field("step_sizes", init="learning_rate", nonneg=True), Field("prev_updates")),
    rule=rprop_rule,
    hyper=("eta_minus", "eta_plus", "min_step_size", "max_step_size"),
    scalars=lambda o, count: {k: o[k] for k in ("eta_minus", "eta_plus", "min_step_size",
                                                 "max_step_size")},
)


def rprop(learning_rate: jax.typing.ArrayLike, eta_minus: jax.typing.ArrayLike = 0.5,
          eta_plus: jax.typing.ArrayLike = 1.2, min_step_size: jax.typing.ArrayLike = 1e-6,
          max_step_size: jax.typing.ArrayLike = 50.0, *, stochastic_rounding: bool = False,
          rounding_seed: int = 0, backend: str = "auto",
          executor_options: ExecutorOptions | None = None,
          state_quantization: str | None = None, quantization_block_size: int = 256,
          min_quantized_size: int = 4096
          ) -> optax.GradientTransformationExtraArgs:
  r"""Rprop, fused; the same numbers as :func:`optax.rprop`.

  Per element, with :math:`s_t = g_t\, \delta_{t-1}` (optax's order: the step applied is
  the previous one, :math:`\delta_{t-1}`, so the first step is zero):

  .. math::
    \begin{align*}
      \eta_t &= \begin{cases} \eta_{t-1} & s_t = 0 \\
        \mathrm{clip}(\eta_{t-1} \cdot (\eta^+ \text{ if } s_t > 0 \text{ else } \eta^-),
                      \eta_{\min}, \eta_{\max}) & \text{otherwise} \end{cases} \\
      \delta_t &= \begin{cases} 0 & s_t < 0 \\ \eta_t\, \mathrm{sign}(g_t) &
                  \text{otherwise} \end{cases},\qquad
      u_t = \begin{cases} 0 & s_t < 0 \\ -\delta_{t-1} & \text{otherwise} \end{cases}
    \end{align*}

  Args:
    learning_rate: the initial step size :math:`\eta_0` (a number: Rprop has no schedule).
    eta_minus, eta_plus: the factors that shrink and grow a step size.
    min_step_size, max_step_size: the step sizes' bounds.
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.rprop(1e-1)
    >>> updates, state = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> updates["w"], state.step_sizes["w"]
    (Array([-0., -0.], dtype=float32), Array([0.1, 0.1], dtype=float32))

  References:
    Riedmiller and Braun, `A Direct Adaptive Method for Faster Backpropagation Learning: The
    RPROP Algorithm <https://ieeexplore.ieee.org/document/298623>`_, 1993.
  """
  return build(RPROP, locals())


ENTRIES = (
    Entry("rprop", rprop, RPROP, optax.rprop,
          cases=({}, {"eta_minus": 0.3, "eta_plus": 1.5, "min_step_size": 1e-3,
                      "max_step_size": 0.05}),
          alias=({"learning_rate": 1e-1},),
          moments=(("step_sizes", 0, "step_sizes"), ("prev_updates", 0, "prev_updates")),
          complex=False, bytes_per_param=28),
)

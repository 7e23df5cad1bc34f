"""LAMB: Adam's direction, then a per-leaf trust ratio from the norms the first pass reduces."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import OptimizerSpec, Reduction
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry
from optirs_jax.transforms.adam import (
  ADAM_FIELDS,
  ADAM_HYPER,
  AdamState,
  adam_rule,
  adam_scalars,
)


def lamb_trust_ratio(h, u, p, p_norm, u_norm, *, cast_lr: bool):
  """LAMB's second pass on one leaf: ``-lr * u * ||p|| / ||u||`` (1 where a norm is 0).

  The norms come from the executor (``jnp.linalg.norm`` on the reference, per-block partial
  sums reduced on the device on Pallas); the arithmetic is optax's
  ``scale_by_trust_ratio`` followed by ``scale_by_learning_rate``.
  """
  # Each norm in its array's dtype, promoted as optax promotes them (params and updates of
  # different dtypes give an update of the wider one).
  with jax.numpy_dtype_promotion("standard"):
    p_norm = p_norm.astype(p.dtype)
    u_norm = u_norm.astype(u.dtype)
    trust_ratio = 1.0 * p_norm / (u_norm + 0.0)
    zero_norm = jnp.logical_or(p_norm == 0.0, u_norm == 0.0)
    safe_ratio = jnp.where(zero_norm, jnp.array(1.0, dtype=p.dtype), trust_ratio)
    return rules.scale_lr(h, u * safe_ratio, cast_lr)


LAMB = OptimizerSpec(
    name="lamb",
    arguments=(("learning_rate", "schedule"), ("b1", "decay rate"), ("b2", "decay rate"),
               ("eps", "number"), ("eps_root", "number"), ("mu_dtype", "dtype"),
               ("nu_dtype", "dtype"), ("weight_decay", "schedule"), ("mask", "mask"),
               ("axis_name", "axes")) + ROUNDING,
    state=AdamState,
    fields=ADAM_FIELDS,
    rule=adam_rule,
    hyper=ADAM_HYPER,
    scalars=adam_scalars,
    static=lambda o: dict(nesterov=False, scale=False, mu_dtype=o["mu_dtype"]),
    weight_decay=True,
    # ||p|| and ||r|| per leaf, then u = -lr * r * ||p|| / ||r||.
    reduction=Reduction(inputs=("p",), outputs=("u",), finish=lamb_trust_ratio),
)


def lamb(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
         b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-6,
         eps_root: jax.typing.ArrayLike = 0.0, weight_decay: optax.ScalarOrSchedule = 0.0,
         mask: Any = None, *, mu_dtype: Any | None = None, nu_dtype: Any | None = None,
         stochastic_rounding: bool = False, rounding_seed: int = 0,
         axis_name: str | tuple[str, ...] | None = None, backend: str = "auto",
         executor_options: ExecutorOptions | None = None,
         state_quantization: str | None = None, quantization_block_size: int = 256,
         min_quantized_size: int = 4096
         ) -> optax.GradientTransformationExtraArgs:
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
    learning_rate, b1, b2, eps, eps_root, mu_dtype, nu_dtype: as in
      :func:`~optirs_jax.adam` (optax's lamb has neither dtype option; ``None`` keeps
      optax's dtypes).
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    weight_decay: the decay :math:`\lambda` (a number or a schedule).
    mask: where the decay applies (the trust ratio applies to every leaf).
    axis_name: inside a ``shard_map`` whose leaves are sharded over these mesh axes, the
      norms are of the whole leaves (partial sums of squares added over the axes each leaf
      varies over); ``None``: of the local arrays. Under ``jax.jit`` with sharded arrays
      the norms are always of the whole leaves.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with state
    :class:`~optirs_jax.AdamState`.

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
  return build(LAMB, locals())


ENTRIES = (
    Entry("lamb", lamb, LAMB, optax.lamb,
          cases=({}, {"weight_decay": 0.01},
                 {"weight_decay": 0.01, "mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)}),
          alias=({"learning_rate": 1e-3},), moments=(("mu", 0, "mu"), ("nu", 0, "nu")),
          bytes_per_param=40),
)

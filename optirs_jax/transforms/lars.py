"""LARS: layer-wise adaptive rate scaling, then momentum (per-leaf norms, two passes)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Field, OptimizerSpec, Reduction
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry


class LarsState(NamedTuple):
  """State of :func:`lars`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the schedules' step, saturating.
  trace: optax.Updates  # the momentum buffer (after the learning rate, as optax's trace).


def lars_rule(h, g, *, p, decay: bool, cast_lr: bool):
  """The first pass: the gradient with its weight decay (optax's ``add_decayed_weights``);
  the executor takes its norm and the params'."""
  del cast_lr
  return (g + h.wd * p if decay else g,)


def lars_finish(h, u, p, p_norm, u_norm, *, cast_lr: bool, trace, masked: bool,
                nesterov: bool = False):
  """The second pass on one leaf: optax's ``scale_by_trust_ratio`` where ``masked``, the
  learning rate, then ``trace`` (momentum): ``(update, new trace)``."""
  with jax.numpy_dtype_promotion("standard"):
    if masked:
      p_norm = p_norm.astype(p.dtype)  # safe_norm with min_norm 0: the norm itself
      u_norm = u_norm.astype(u.dtype)
      ratio = h.trust_coefficient * p_norm / (u_norm + h.eps)
      zero_norm = jnp.logical_or(p_norm == 0.0, u_norm == 0.0)
      u = u * jnp.where(zero_norm, jnp.array(1.0, dtype=p.dtype), ratio)
    u = rules.scale_lr(h, u, cast_lr)
    new_trace = u + h.momentum * trace
    out = u + h.momentum * new_trace if nesterov else new_trace
    return out, new_trace.astype(trace.dtype)


def _finish(h, u, p, p_norm, u_norm, *, cast_lr, trace, masked):
  return lars_finish(h, u, p, p_norm, u_norm, cast_lr=cast_lr, trace=trace, masked=masked,
                     nesterov=False)


def _finish_nesterov(h, u, p, p_norm, u_norm, *, cast_lr, trace, masked):
  return lars_finish(h, u, p, p_norm, u_norm, cast_lr=cast_lr, trace=trace, masked=masked,
                     nesterov=True)


def _spec(nesterov: bool) -> OptimizerSpec:
  return OptimizerSpec(
      name="lars",
      arguments=(("learning_rate", "schedule"), ("weight_decay", "schedule"), ("mask", "mask"),
                 ("trust_coefficient", "number"), ("eps", "number"),
                 ("trust_ratio_mask", "mask"), ("momentum", "number"), ("nesterov", "flag"),
                 ("axis_name", "axes")) + ROUNDING,
      state=LarsState,
      fields=(Field("trace"),),
      rule=lars_rule,
      hyper=("trust_coefficient", "eps", "momentum", "wd", "neg_lr"),
      scalars=lambda o, count: dict(trust_coefficient=o["trust_coefficient"], eps=o["eps"],
                                    momentum=o["momentum"]),
      weight_decay=True,
      reduction=Reduction(inputs=("p",), outputs=("u",),
                          finish=_finish_nesterov if nesterov else _finish, fields=("trace",),
                          mask="trust_ratio_mask"),
  )


LARS, LARS_NESTEROV = _spec(False), _spec(True)


def lars(learning_rate: optax.ScalarOrSchedule, weight_decay: optax.ScalarOrSchedule = 0.0,
         weight_decay_mask: Any = True, trust_coefficient: jax.typing.ArrayLike = 0.001,
         eps: jax.typing.ArrayLike = 0.0, trust_ratio_mask: Any = True,
         momentum: jax.typing.ArrayLike = 0.9, nesterov: bool = False, *,
         axis_name: str | tuple[str, ...] | None = None, stochastic_rounding: bool = False,
         rounding_seed: int = 0, backend: str = "auto",
         executor_options: ExecutorOptions | None = None,
         state_quantization: str | None = None, quantization_block_size: int = 256,
         min_quantized_size: int = 4096
         ) -> optax.GradientTransformationExtraArgs:
  r"""LARS, with per-leaf norms fused (two passes); the same numbers as :func:`optax.lars`.

  Per leaf:

  .. math::
    \begin{align*}
      r_t &= g_t + \lambda p_{t-1},\qquad
      \tilde r_t = \kappa\, \frac{\|p_{t-1}\|}{\|r_t\| + \epsilon}\, r_t
      \quad (r_t \text{ where either norm is } 0) \\
      v_t &= -\eta_t \tilde r_t + \mu v_{t-1},\qquad u_t = v_t
      \quad (\text{Nesterov: } u_t = -\eta_t \tilde r_t + \mu v_t)
    \end{align*}

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    weight_decay: :math:`\lambda`, added to the gradient first (a number or a schedule).
    weight_decay_mask: where the decay applies (a tree of bools, a prefix of one such as
      ``True``, or a callable returning one).
    trust_coefficient: :math:`\kappa`.
    eps: added to the update's norm.
    trust_ratio_mask: where the trust ratio applies (as ``weight_decay_mask``).
    momentum: :math:`\mu`.
    nesterov: use Nesterov momentum.
    axis_name: inside a ``shard_map`` whose leaves are sharded over these mesh axes, the
      norms are of the whole leaves (as in :func:`~optirs_jax.lamb`).
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.lars(1.0)
    >>> p = {"w": jnp.array([3.0, 4.0])}
    >>> updates, _ = tx.update({"w": jnp.array([0.0, 2.0])}, tx.init(p), p)
    >>> updates["w"]  # -lr * 0.001 * (5 / 2) * g
    Array([ 0.   , -0.005], dtype=float32)

  References:
    You, Gitman and Ginsburg, `Large Batch Training of Convolutional Networks
    <https://arxiv.org/abs/1708.03888>`_, 2017.
  """
  spec = LARS_NESTEROV if nesterov else LARS
  return build(spec, dict(locals(), mask=weight_decay_mask))


ENTRIES = (
    Entry("lars", lars, LARS, optax.lars,
          cases=({}, {"weight_decay": 1e-2}, {"nesterov": True, "eps": 1e-6},
                 {"weight_decay": 1e-2, "trust_coefficient": 0.01,
                  "weight_decay_mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p),
                  "trust_ratio_mask": lambda p: jax.tree.map(lambda x: x.size > 64, p)}),
          typical={"weight_decay": 1e-2}, alias=({"learning_rate": 1.0},),
          moments=(("trace", 3, "trace"),), bytes_per_param=28),
)

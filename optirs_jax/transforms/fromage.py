"""Fromage: steps scaled to the params' norm, and shrunk towards zero (Frobenius matched
gradient descent)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import OptimizerSpec, Reduction
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry


class FromageState(NamedTuple):
  """State of :func:`fromage`: the schedules' step only."""

  count: jax.Array  # shape=(), dtype=jnp.int32; saturates at the int32 maximum.


def fromage_scalars(options, count) -> dict:
  """The scaled learning rate and the decay at this step, as optax's ``fromage`` builds
  them: ``-lr / sqrt(1 + lr^2)`` and ``1 / sqrt(1 + lr^2) - 1``."""
  lr = options["learning_rate"]
  if callable(lr):
    mult = 1 / (1 + lr(count)**2)**0.5
    return dict(neg_lr_mult=-1 * (mult * lr(count)), decay=mult - 1,
                min_norm=options["min_norm"])
  mult = 1 / (1 + lr**2)**0.5
  return dict(neg_lr_mult=-1 * (lr * mult), decay=mult - 1, min_norm=options["min_norm"])


def fromage_rule(h, g, *, p, cast_lr: bool):
  """The first pass: the gradient itself (as it reaches fromage: after any links folded in
  before it), whose norm and the params' the executor takes."""
  del h, p, cast_lr
  return (g,)


def _safe(norm, min_norm):
  # optax's numerics.safe_norm: the norm, or min_norm where it is not above it.
  return jnp.where(norm <= min_norm, min_norm, norm)


def fromage_finish(h, u, p, p_norm, g_norm, *, cast_lr: bool):
  """The second pass on one leaf: optax's ``scale_by_trust_ratio(min_norm)``, the scaled
  learning rate, then ``add_decayed_weights``."""
  with jax.numpy_dtype_promotion("standard"):
    p_norm = _safe(p_norm.astype(p.dtype), h.min_norm)
    g_norm = _safe(g_norm.astype(u.dtype), h.min_norm)
    ratio = 1.0 * p_norm / (g_norm + 0.0)
    zero_norm = jnp.logical_or(p_norm == 0.0, g_norm == 0.0)
    u = u * jnp.where(zero_norm, jnp.array(1.0, dtype=p.dtype), ratio)
    neg_lr = jnp.asarray(h.neg_lr_mult, dtype=u.dtype) if cast_lr else h.neg_lr_mult
    u = neg_lr * u
    return u + h.decay * p


FROMAGE = OptimizerSpec(
    name="fromage",
    arguments=(("learning_rate", "schedule"), ("min_norm", "number"),
               ("axis_name", "axes")) + ROUNDING,
    state=FromageState,
    fields=(),
    rule=fromage_rule,
    hyper=("neg_lr_mult", "decay", "min_norm"),
    scalars=fromage_scalars,
    reads_params=True,
    reduction=Reduction(inputs=("p",), outputs=("u",), finish=fromage_finish),
)


def fromage(learning_rate: optax.ScalarOrSchedule, min_norm: jax.typing.ArrayLike = 1e-6, *,
            axis_name: str | tuple[str, ...] | None = None, stochastic_rounding: bool = False,
            rounding_seed: int = 0, backend: str = "auto",
            executor_options: ExecutorOptions | None = None
            ) -> optax.GradientTransformationExtraArgs:
  r"""Fromage, with per-leaf norms fused; the same numbers as :func:`optax.fromage`.

  .. math::
    u_t = -\frac{\eta_t}{\sqrt{1 + \eta_t^2}}\, \frac{\|p_{t-1}\|}{\|g_t\|}\, g_t
          + \left( \frac{1}{\sqrt{1 + \eta_t^2}} - 1 \right) p_{t-1}

  per leaf, each norm at least ``min_norm`` (the ratio is 1 where a norm is 0).

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    min_norm: the norms' floor.
    axis_name: inside a ``shard_map`` whose leaves are sharded over these mesh axes, the
      norms are of the whole leaves (as in :func:`~optirs_jax.lamb`); ``None``: of the local
      shards.
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.fromage(1e-1)
    >>> p = {"w": jnp.array([3.0, 4.0])}
    >>> updates, _ = tx.update({"w": jnp.array([0.0, 2.0])}, tx.init(p), p)
    >>> updates["w"]
    Array([-0.01488843, -0.51736987], dtype=float32)

  References:
    Bernstein et al., `On the Distance between two Neural Networks and the Stability of
    Learning <https://arxiv.org/abs/2002.03432>`_, 2020.
  """
  return build(FROMAGE, locals())


ENTRIES = (
    Entry("fromage", fromage, FROMAGE, optax.fromage, cases=({}, {"min_norm": 1e-2}),
          alias=({"learning_rate": 5e-3},), complex=False, bytes_per_param=20),
)

"""Adan: Adam with Nesterov momentum estimated from gradient differences."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Field, OptimizerSpec
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._checks import as_float
from optirs_jax.transforms._registry import Entry


class AdanState(NamedTuple):
  """State of :func:`adan` (optax's ``ScaleByAdanState``, with ``count`` for its ``t``)."""

  count: jax.Array  # shape=(), dtype=jnp.int32; saturates at the int32 maximum.
  m: optax.Updates  # EMA of the gradients.
  v: optax.Updates  # EMA of the gradients' differences.
  n: optax.Updates  # EMA of |g + (1 - b2) (g - g_prev)|^2.
  g_prev: optax.Updates  # the previous gradients (optax's ``g``).


def adan_scalars(options, count) -> dict:
  """Adan's scalars at this step, as optax's ``scale_by_adan`` computes them."""
  b1, b2, b3 = options["b1"], options["b2"], options["b3"]
  t = as_float(optax.safe_increment(count))
  return dict(b1=b1, c1=1 - b1, b2=b2, c2=1 - b2, b3=b3, c3=1 - b3, eps=options["eps"],
              eps_root=options["eps_root"], bc1=1 - b1**t, bc2=1 - b2**t, bc3=1 - b3**t,
              first=jnp.asarray(count == 0, jnp.float32))


def adan_rule(h, g, *, p, m, v, n, g_prev, decay: bool, cast_lr: bool):
  r"""optax's ``scale_by_adan`` (then the decay, then the learning rate):
  ``(u, m, v, n, g)``."""
  diff = rules.where_scalar(h.first > 0, jnp.zeros_like(g), g - g_prev)
  new_m = rules.ema(h.b1, h.c1, g, m)
  new_v = rules.ema(h.b2, h.c2, diff, v)
  new_n = rules.ema(h.b3, h.c3, rules.sq(g + h.c2 * diff), n)
  u = rules.debias(new_m, h.bc1) + h.c2 * rules.debias(new_v, h.bc2)
  u = u / (jnp.sqrt(rules.debias(new_n, h.bc3) + h.eps_root) + h.eps)
  if decay:
    u = u + h.wd * p
  return (rules.scale_lr(h, u, cast_lr), new_m.astype(m.dtype), new_v.astype(v.dtype),
          new_n.astype(n.dtype), g.astype(g_prev.dtype))


ADAN = OptimizerSpec(
    name="adan",
    arguments=(("learning_rate", "schedule"), ("b1", "decay rate"), ("b2", "decay rate"),
               ("b3", "decay rate"), ("eps", "number"), ("eps_root", "number"),
               ("weight_decay", "schedule"), ("mask", "mask")) + ROUNDING,
    state=AdanState,
    fields=(Field("m"), Field("v"), Field("n", pad=1.0, nonneg=True), Field("g_prev")),
    rule=adan_rule,
    hyper=("b1", "c1", "b2", "c2", "b3", "c3", "eps", "eps_root", "bc1", "bc2", "bc3", "first",
           "wd", "neg_lr"),
    scalars=adan_scalars,
    weight_decay=True,
)


def adan(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.98,
         b2: jax.typing.ArrayLike = 0.92, b3: jax.typing.ArrayLike = 0.99,
         eps: jax.typing.ArrayLike = 1e-8, eps_root: jax.typing.ArrayLike = 1e-8,
         weight_decay: optax.ScalarOrSchedule = 0.0, mask: Any = None, *,
         stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
         executor_options: ExecutorOptions | None = None,
         state_quantization: str | None = None, quantization_block_size: int = 256,
         min_quantized_size: int = 4096
         ) -> optax.GradientTransformationExtraArgs:
  r"""Adan (adaptive Nesterov momentum), fused; the same numbers as :func:`optax.adan`.

  .. math::
    \begin{align*}
      \Delta_t &= g_t - g_{t-1} \quad (0 \text{ at the first step}) \\
      m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
      v_t = \beta_2 v_{t-1} + (1-\beta_2) \Delta_t \\
      n_t &= \beta_3 n_{t-1} + (1-\beta_3) |g_t + (1-\beta_2) \Delta_t|^2 \\
      u_t &= -\eta_t \left( \frac{\hat m_t + (1-\beta_2) \hat v_t}
             {\sqrt{\hat n_t + \bar\epsilon} + \epsilon} + \lambda p_{t-1} \right)
    \end{align*}

  with :math:`\hat x_t = x_t / (1-\beta^t)` each moment's bias correction.

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    b1, b2, b3: the decay rates of the gradients', their differences' and the squared
      estimate's moments.
    eps, eps_root: added outside and inside the square root.
    weight_decay: decoupled decay :math:`\lambda` (a number or a schedule).
    mask: where the decay applies (a tree of bools or a callable returning one).
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adan(1e-1)
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> updates["w"]
    Array([-0.10000005,  0.10000005], dtype=float32)

  References:
    Xie et al., `Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep
    Models <https://arxiv.org/abs/2208.06677>`_, 2022.
  """
  return build(ADAN, locals())


ENTRIES = (
    Entry("adan", adan, ADAN, optax.adan,
          cases=({}, {"b1": 0.9, "b2": 0.9, "b3": 0.999, "eps_root": 0.0},
                 {"weight_decay": 0.05},
                 {"weight_decay": 0.1, "mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)}),
          typical={"weight_decay": 0.1}, alias=({"learning_rate": 1e-1},),
          moments=(("m", 0, "m"), ("v", 0, "v"), ("n", 0, "n"), ("g_prev", 0, "g")),
          complex=False, bytes_per_param=44),
)

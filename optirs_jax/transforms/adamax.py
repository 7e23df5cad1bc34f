"""AdaMax and AdaMaxW: Adam with the infinity norm of the gradients as its second moment."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Field, OptimizerSpec
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry
from optirs_jax.transforms.adam import AdamState, adam_scalars


def adamax_rule(h, g, *, p, mu, nu, decay: bool, cast_lr: bool):
  r"""optax's ``scale_by_adamax`` (then the decay, then the learning rate): ``(u, mu, nu)``
  with :math:`v \leftarrow \max(|g| + \epsilon, \beta_2 v)`, :math:`u = \hat m / v`."""
  new_mu = rules.ema(h.b1, h.c1, g, mu)
  new_nu = jnp.maximum(jnp.abs(g) + h.eps, h.b2 * nu)
  u = rules.debias(new_mu, h.bc1) / new_nu
  if decay:
    u = u + h.wd * p
  return rules.scale_lr(h, u, cast_lr), new_mu, new_nu.astype(nu.dtype)


ADAMAXW = OptimizerSpec(
    name="adamaxw",
    arguments=(("learning_rate", "schedule"), ("b1", "decay rate"), ("b2", "decay rate"),
               ("eps", "number"), ("weight_decay", "schedule"), ("mask", "mask")) + ROUNDING,
    state=AdamState,
    fields=(Field("mu"), Field("nu", pad=1.0, nonneg=True)),
    rule=adamax_rule,
    hyper=("b1", "c1", "b2", "eps", "bc1", "wd", "neg_lr"),
    scalars=lambda o, count: adam_scalars(dict(o, eps_root=0.0), count),
    weight_decay=True,
)
ADAMAX = dataclasses.replace(ADAMAXW, name="adamax")


def adamax(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
           b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8, *,
           stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
           executor_options: ExecutorOptions | None = None,
           state_quantization: str | None = None, quantization_block_size: int = 256,
           min_quantized_size: int = 4096
           ) -> optax.GradientTransformationExtraArgs:
  r"""AdaMax, fused; the same numbers as :func:`optax.adamax`.

  .. math::
    m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t,\qquad
    v_t = \max(|g_t| + \epsilon,\ \beta_2 v_{t-1}),\qquad
    u_t = -\eta_t\, \frac{m_t / (1-\beta_1^t)}{v_t}

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    b1: the first moment's decay rate.
    b2: the infinity norm's decay rate.
    eps: added to :math:`|g|` (it keeps :math:`v` above 0).
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adamax(1e-1)
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> [round(v, 5) for v in updates["w"].tolist()]
    [-0.1, 0.1]

  References:
    Kingma and Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_ (Section 7.1), 2014.
  """
  return build(ADAMAX, dict(locals(), weight_decay=0.0, mask=None))


def adamaxw(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
            b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
            weight_decay: optax.ScalarOrSchedule = 1e-4, mask: Any = None, *,
            stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
            executor_options: ExecutorOptions | None = None,
            state_quantization: str | None = None, quantization_block_size: int = 256,
            min_quantized_size: int = 4096
            ) -> optax.GradientTransformationExtraArgs:
  r"""AdaMaxW: :func:`adamax` with decoupled weight decay; the same numbers as
  :func:`optax.adamaxw`.

  .. math:: u_t = -\eta_t \left( \frac{m_t / (1-\beta_1^t)}{v_t} + \lambda\, p_{t-1} \right)

  Args:
    learning_rate, b1, b2, eps: as in :func:`adamax`.
    weight_decay: the decay :math:`\lambda`, a number or a schedule.
    mask: a tree of bools (or a prefix of the params tree), or a callable returning one,
      ``True`` where the decay applies.
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adamaxw(1e-1, weight_decay=0.1)
    >>> p = {"w": jnp.ones(2)}
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init(p), p)
    >>> [round(v, 5) for v in updates["w"].tolist()]
    [-0.11, 0.09]

  References:
    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  return build(ADAMAXW, locals())


_MOMENTS = (("mu", 0, "mu"), ("nu", 0, "nu"))
ENTRIES = (
    Entry("adamax", adamax, ADAMAX, optax.adamax, cases=({}, {"b1": 0.8, "b2": 0.99,
                                                            "eps": 1e-6}),
          alias=({"learning_rate": 1e-1},), moments=_MOMENTS, bytes_per_param=28),
    Entry("adamaxw", adamaxw, ADAMAXW, optax.adamaxw,
          cases=({}, {"weight_decay": 0.05},
                 {"weight_decay": 0.1, "mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)}),
          typical={"weight_decay": 0.1}, alias=({"learning_rate": 1e-1},), moments=_MOMENTS,
          bytes_per_param=28),
)

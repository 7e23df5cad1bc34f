"""NovoGrad: Adam's second moment as one scalar per leaf (the gradient's squared norm)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Field, OptimizerSpec, Reduction
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry


class NovogradState(NamedTuple):
  """State of :func:`novograd`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; saturates at the int32 maximum.
  mu: optax.Updates  # the first moment, shaped like the params.
  nu: optax.Updates  # the second moment: one scalar per leaf, in the leaf's dtype.


def novograd_scalars(options, count) -> dict:
  return dict(b1=options["b1"], b2=options["b2"], eps=options["eps"],
              eps_root=options["eps_root"], weight_decay=options["weight_decay"],
              first=(count == 0).astype(jnp.float32))


def novograd_rule(h, g, *, p, cast_lr: bool):
  """The first pass: the gradient (as it reaches NovoGrad), whose norm the executor takes."""
  del h, p, cast_lr
  return (g,)


def novograd_between(h, g_norm, *, nu):
  """The leaf's second moment from its gradient's norm, as optax's ``scale_by_novograd``:
  the squared norm on the first step, then ``(1 - b2) |g|^2 + b2 nu``."""
  squared = g_norm**2
  new_nu = jnp.where(h.first > 0, squared.astype(nu.dtype), (1 - h.b2) * squared + h.b2 * nu)
  return (new_nu,), (new_nu,)


def novograd_finish(h, u, p, nu, *, cast_lr: bool, mu):
  """The second pass on one leaf: the normalized gradient plus the decay into the first
  moment (the sum itself on the first step), then the learning rate."""
  with jax.numpy_dtype_promotion("standard"):
    nu = nu.astype(p.dtype)  # the leaf's dtype, as optax keeps it (a kernel reads float32)
    step = u / (jnp.sqrt(nu + h.eps_root) + h.eps) + h.weight_decay * p
    new_mu = rules.where_scalar(h.first > 0, step, h.b1 * mu + step)
    return rules.scale_lr(h, new_mu, cast_lr), new_mu


NOVOGRAD = OptimizerSpec(
    name="novograd",
    arguments=(("learning_rate", "schedule"), ("b1", "decay rate"), ("b2", "decay rate"),
               ("eps", "number"), ("eps_root", "number"), ("weight_decay", "number"),
               ("axis_name", "axes")) + ROUNDING,
    state=NovogradState,
    fields=(Field("mu"), Field("nu", per_leaf=True)),
    rule=novograd_rule,
    hyper=("b1", "b2", "eps", "eps_root", "weight_decay", "first", "neg_lr"),
    scalars=novograd_scalars,
    reads_params=True,
    reduction=Reduction(inputs=(), outputs=("u",), finish=novograd_finish, fields=("mu",),
                        between=novograd_between),
)


def novograd(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
             b2: jax.typing.ArrayLike = 0.25, eps: jax.typing.ArrayLike = 1e-6,
             eps_root: jax.typing.ArrayLike = 0.0, weight_decay: jax.typing.ArrayLike = 0.0, *,
             axis_name: str | tuple[str, ...] | None = None, stochastic_rounding: bool = False,
             rounding_seed: int = 0, backend: str = "auto",
             executor_options: ExecutorOptions | None = None,
             state_quantization: str | None = None, quantization_block_size: int = 256,
             min_quantized_size: int = 4096
             ) -> optax.GradientTransformationExtraArgs:
  r"""NovoGrad, with per-leaf norms fused; the same numbers as :func:`optax.novograd`.

  Per leaf, with :math:`\|g_t\|` the norm of the whole leaf's gradient:

  .. math::
    \begin{align*}
      n_t &= \beta_2 n_{t-1} + (1 - \beta_2) \|g_t\|^2 \quad (n_1 = \|g_1\|^2) \\
      m_t &= \beta_1 m_{t-1} + \frac{g_t}{\sqrt{n_t + \bar\epsilon} + \epsilon}
             + \lambda p_{t-1} \quad (m_1 \text{ without } \beta_1 m_0) \\
      u_t &= -\eta_t m_t
    \end{align*}

  :math:`n_t` is one scalar per leaf (``state.nu``, shape ``()``).

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    b1: :math:`\beta_1`, the first moment's decay.
    b2: :math:`\beta_2`, the squared norms' decay.
    eps: :math:`\epsilon`, added to the root.
    eps_root: :math:`\bar\epsilon`, added under the root.
    weight_decay: :math:`\lambda` (a number, as in optax's ``scale_by_novograd``).
    axis_name: inside a ``shard_map`` whose leaves are sharded over these mesh axes, the
      norms are of the whole leaves (as in :func:`~optirs_jax.lamb`); ``None``: of the local
      shards.
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.novograd(0.1)
    >>> p = {"w": jnp.array([1.0, 1.0])}
    >>> updates, state = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(p), p)
    >>> updates["w"]  # -0.1 * g / (|g| + eps)
    Array([-0.05999999, -0.07999998], dtype=float32)
    >>> state.nu["w"]  # |g|^2
    Array(25., dtype=float32)

  References:
    Ginsburg et al., `Stochastic Gradient Methods with Layer-wise Adaptive Moments for
    Training of Deep Networks <https://arxiv.org/abs/1905.11286>`_, 2019.
  """
  return build(NOVOGRAD, locals())


ENTRIES = (
    Entry("novograd", novograd, NOVOGRAD, optax.novograd,
          cases=({}, {"b1": 0.8, "b2": 0.5, "eps": 1e-4, "eps_root": 1e-8},
                 {"weight_decay": 1e-2}),
          typical={"weight_decay": 1e-2}, alias=({"learning_rate": 1e-3},),
          moments=(("mu", 0, "mu"), ("nu", 0, "nu")), complex=False, bytes_per_param=24),
)

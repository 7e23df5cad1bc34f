"""AdaBelief: Adam whose second moment is the variance of the gradient around its EMA."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Field, OptimizerSpec
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry
from optirs_jax.transforms.adam import adam_scalars


class AdaBeliefState(NamedTuple):
  """State of :func:`adabelief`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; saturates at the int32 maximum.
  mu: optax.Updates  # first moment.
  nu: optax.Updates  # second central moment (plus eps_root each step).


def nesterov_mu_hat(h, new_mu, g):
  """The Nesterov estimate optax's ``scale_by_belief`` and ``scale_by_radam`` use."""
  return h.b1 * rules.debias(new_mu, h.bc1_next) + h.c1 * rules.debias(g, h.bc1)


def adabelief_rule(h, g, *, p, mu, nu, nesterov: bool, cast_lr: bool):
  r"""optax's ``scale_by_belief`` then the learning rate: ``(u, mu, nu)``."""
  del p
  new_mu = rules.ema(h.b1, h.c1, g, mu)
  new_nu = rules.ema(h.b2, h.c2, rules.sq(g - new_mu), nu) + h.eps_root
  mu_hat = nesterov_mu_hat(h, new_mu, g) if nesterov else rules.debias(new_mu, h.bc1)
  u = mu_hat / (jnp.sqrt(rules.debias(new_nu, h.bc2)) + h.eps)
  return rules.scale_lr(h, u, cast_lr), new_mu, new_nu.astype(nu.dtype)


ADABELIEF = OptimizerSpec(
    name="adabelief",
    arguments=(("learning_rate", "schedule"), ("b1", "decay rate"), ("b2", "decay rate"),
               ("eps", "number"), ("eps_root", "number"), ("nesterov", "flag")) + ROUNDING,
    state=AdaBeliefState,
    fields=(Field("mu"), Field("nu", pad=1.0, nonneg=True)),
    rule=adabelief_rule,
    hyper=("b1", "c1", "b2", "c2", "eps", "eps_root", "bc1", "bc1_next", "bc2", "neg_lr"),
    scalars=adam_scalars,
    static=lambda o: dict(nesterov=bool(o["nesterov"])),
)


def adabelief(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
              b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-16,
              eps_root: jax.typing.ArrayLike = 1e-16, *, nesterov: bool = False,
              stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
              executor_options: ExecutorOptions | None = None,
              state_quantization: str | None = None, quantization_block_size: int = 256,
              min_quantized_size: int = 4096
              ) -> optax.GradientTransformationExtraArgs:
  r"""AdaBelief, fused; the same numbers as :func:`optax.adabelief`.

  .. math::
    \begin{align*}
      m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
      s_t = \beta_2 s_{t-1} + (1-\beta_2) |g_t - m_t|^2 + \bar\epsilon \\
      u_t &= -\eta_t\, \frac{m_t / (1-\beta_1^t)}{\sqrt{s_t / (1-\beta_2^t)} + \epsilon}
    \end{align*}

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    b1, b2: the moments' decay rates.
    eps: added to the denominator.
    eps_root: added to the second moment each step.
    nesterov: use Nesterov momentum (as :func:`~optirs_jax.nadam`).
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adabelief(1e-1)
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> [round(v, 5) for v in updates["w"].tolist()]
    [-0.11111, 0.11111]

  References:
    Zhuang et al., `AdaBelief Optimizer: Adapting Stepsizes by the Belief in Observed
    Gradients <https://arxiv.org/abs/2010.07468>`_, 2020.
  """
  return build(ADABELIEF, locals())


ENTRIES = (
    Entry("adabelief", adabelief, ADABELIEF, optax.adabelief,
          cases=({}, {"b1": 0.8, "eps": 1e-8, "eps_root": 1e-10}, {"nesterov": True}),
          alias=({"learning_rate": 1e-2},), moments=(("mu", 0, "mu"), ("nu", 0, "nu")),
          bytes_per_param=28),
)

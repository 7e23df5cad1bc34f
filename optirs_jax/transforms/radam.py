"""RAdam: Adam with its adaptive step rectified (plain momentum until the variance of the
adaptive learning rate is tractable)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Field, OptimizerSpec
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry
from optirs_jax.transforms.adabelief import nesterov_mu_hat
from optirs_jax.transforms.adam import AdamState, adam_scalars


def radam_scalars(options, count) -> dict:
  """Adam's scalars and the rectification, as optax's ``scale_by_radam`` computes them:
  :math:`\\rho_t` (``ro``) and its factor :math:`r_t` (``r``; NaN while :math:`\\rho_t < 4`,
  where the threshold picks the plain momentum)."""
  b2, threshold = options["b2"], options["threshold"]
  ro_inf = 2.0 / (1.0 - b2) - 1.0
  count_inc = optax.safe_increment(count)
  with jax.numpy_dtype_promotion("standard"):  # optax's expression, as optax promotes it
    b2t = b2**count_inc
    ro = ro_inf - 2 * count_inc * b2t / (1 - b2t)
    r = jnp.sqrt((ro - 4.0) * (ro - 2.0) * ro_inf / ((ro_inf - 4.0) * (ro_inf - 2.0) * ro))
  return dict(adam_scalars(options, count), ro=ro, r=r, threshold=threshold)


def radam_rule(h, g, *, p, mu, nu, nesterov: bool, cast_lr: bool):
  r"""optax's ``scale_by_radam`` then the learning rate: ``(u, mu, nu)``."""
  del p
  new_mu = rules.ema(h.b1, h.c1, g, mu)
  new_nu = rules.ema(h.b2, h.c2, rules.sq(g), nu)
  mu_hat = nesterov_mu_hat(h, new_mu, g) if nesterov else rules.debias(new_mu, h.bc1)
  nu_hat = rules.debias(new_nu, h.bc2)
  rectified = jnp.asarray(h.r).astype(mu_hat.dtype) * mu_hat / (
      jnp.sqrt(nu_hat + h.eps_root) + h.eps)
  u = rules.where_scalar(h.ro >= h.threshold, rectified, mu_hat)
  return rules.scale_lr(h, u, cast_lr), new_mu, new_nu.astype(nu.dtype)


RADAM = OptimizerSpec(
    name="radam",
    arguments=(("learning_rate", "schedule"), ("b1", "decay rate"), ("b2", "decay rate"),
               ("eps", "number"), ("eps_root", "number"), ("threshold", "number"),
               ("nesterov", "flag")) + ROUNDING,
    state=AdamState,
    fields=(Field("mu"), Field("nu", pad=1.0, nonneg=True)),
    rule=radam_rule,
    hyper=("b1", "c1", "b2", "c2", "eps", "eps_root", "bc1", "bc1_next", "bc2", "ro", "r",
           "threshold", "neg_lr"),
    scalars=radam_scalars,
    static=lambda o: dict(nesterov=bool(o["nesterov"])),
)


def radam(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
          b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
          eps_root: jax.typing.ArrayLike = 0.0, threshold: jax.typing.ArrayLike = 5.0, *,
          nesterov: bool = False, stochastic_rounding: bool = False, rounding_seed: int = 0,
          backend: str = "auto", executor_options: ExecutorOptions | None = None,
          state_quantization: str | None = None, quantization_block_size: int = 256,
          min_quantized_size: int = 4096
          ) -> optax.GradientTransformationExtraArgs:
  r"""RAdam, fused; the same numbers as :func:`optax.radam`.

  .. math::
    \begin{align*}
      \rho_\infty &= \frac{2}{1-\beta_2} - 1,\qquad
      \rho_t = \rho_\infty - \frac{2 t \beta_2^t}{1-\beta_2^t},\qquad
      r_t = \sqrt{\frac{(\rho_t-4)(\rho_t-2)\rho_\infty}{(\rho_\infty-4)(\rho_\infty-2)\rho_t}} \\
      u_t &= -\eta_t \begin{cases}
        r_t\, \hat m_t / (\sqrt{\hat v_t + \bar\epsilon} + \epsilon) & \rho_t \ge \tau \\
        \hat m_t & \text{otherwise}
      \end{cases}
    \end{align*}

  with :math:`\hat m_t, \hat v_t` Adam's bias-corrected moments and :math:`\tau` the
  ``threshold``.

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    b1, b2, eps, eps_root: as in :func:`~optirs_jax.adam`.
    threshold: :math:`\tau`, where the rectified step starts.
    nesterov: use Nesterov momentum (as :func:`~optirs_jax.nadam`).
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.radam(1e-1)
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> # the first steps: plain (bias-corrected) momentum
    >>> [round(v, 5) for v in updates["w"].tolist()]
    [-0.05, 0.1]

  References:
    Liu et al., `On the Variance of the Adaptive Learning Rate and Beyond
    <https://arxiv.org/abs/1908.03265>`_, 2020.
  """
  return build(RADAM, locals())


ENTRIES = (
    Entry("radam", radam, RADAM, optax.radam,
          cases=({}, {"b2": 0.9, "threshold": 4.0}, {"nesterov": True, "eps_root": 1e-8}),
          alias=({"learning_rate": 5e-3},), moments=(("mu", 0, "mu"), ("nu", 0, "nu")),
          bytes_per_param=28),
)

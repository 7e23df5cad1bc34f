"""RMSprop: plain or centered, with optional bias correction and momentum."""

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


class RmspropState(NamedTuple):
  """State of :func:`rmsprop`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; bias correction and schedule step, saturating.
  nu: optax.Updates  # EMA of |g|^2, starting at ``initial_scale``.
  mu: optax.Updates | None  # EMA of g when centered, else None.
  trace: optax.Updates | None  # momentum buffer (after the learning rate), else None.


def rmsprop_rule(h, g, *, p, nu, mu=None, trace=None, eps_in_sqrt: bool, bias_correction: bool,
                 nesterov: bool, cast_lr: bool):
  r"""RMSprop, plain or centered (with ``mu``), with optional bias correction and momentum
  (with ``trace``) after the learning rate.

  .. math::
    v \leftarrow (1-\rho)|g|^2 + \rho v,\quad u = -\eta\, g / \sqrt{\hat v - |\hat m|^2 + \epsilon}

  Returns ``(u, nu[, mu][, trace])``.
  """
  del p
  new_nu = rules.ema(h.decay, h.c_decay, rules.sq(g), nu)
  nu_hat = rules.debias(new_nu, h.bc) if bias_correction else new_nu
  out = [new_nu]
  var = nu_hat
  if mu is not None:
    new_mu = rules.ema(h.decay, h.c_decay, g, mu)
    mu_hat = rules.debias(new_mu, h.bc) if bias_correction else new_mu
    var = nu_hat - rules.abs_sq(mu_hat)
    out.append(new_mu)
  if eps_in_sqrt:
    scaling = jax.lax.rsqrt(var + h.eps)
  else:
    scaling = 1 / (jnp.sqrt(var) + h.eps)
  u = rules.scale_lr(h, scaling * g, cast_lr)
  if trace is not None:
    new_t = u + h.momentum * trace
    u = u + h.momentum * new_t if nesterov else new_t
    out.append(new_t)
  return (u, *out)


def _scalars(o, count) -> dict:
  decay = o["decay"]
  bc = (1 - decay**as_float(optax.safe_increment(count))) if o["bias_correction"] else 1.0
  return dict(decay=decay, c_decay=1 - decay, eps=o["eps"], bc=bc,
              momentum=0.0 if o["momentum"] is None else o["momentum"])


RMSPROP = OptimizerSpec(
    name="rmsprop",
    arguments=(("learning_rate", "schedule"), ("decay", "decay rate"), ("eps", "number"),
               ("initial_scale", "number"), ("eps_in_sqrt", "flag"), ("centered", "flag"),
               ("momentum", "optional number"), ("nesterov", "flag"),
               ("bias_correction", "flag"), ("nu_dtype", "dtype")) + ROUNDING,
    state=RmspropState,
    fields=(Field("nu", init="initial_scale", dtype="nu_dtype", pad=1.0, nonneg=True),
            Field("mu", when="centered"),
            Field("trace", when="momentum")),
    rule=rmsprop_rule,
    hyper=("decay", "c_decay", "eps", "bc", "momentum", "neg_lr"),
    scalars=_scalars,
    static=lambda o: dict(eps_in_sqrt=bool(o["eps_in_sqrt"]),
                          bias_correction=bool(o["bias_correction"]),
                          nesterov=bool(o["nesterov"])),
)


def rmsprop(learning_rate: optax.ScalarOrSchedule, decay: jax.typing.ArrayLike = 0.9,
            eps: jax.typing.ArrayLike = 1e-8, initial_scale: jax.typing.ArrayLike = 0.0,
            eps_in_sqrt: bool = True, centered: bool = False,
            momentum: jax.typing.ArrayLike | None = None, nesterov: bool = False,
            bias_correction: bool = False, *, nu_dtype: Any | None = None,
            stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
            executor_options: ExecutorOptions | None = None,
            state_quantization: str | None = None, quantization_block_size: int = 256,
            min_quantized_size: int = 4096
            ) -> optax.GradientTransformationExtraArgs:
  r"""RMSprop; the same numbers as :func:`optax.rmsprop`.

  .. math::
    \begin{align*}
      v_k &= \rho v_{k-1} + (1-\rho) |g_k|^2, \qquad
      m_k = \rho m_{k-1} + (1-\rho) g_k \ (\text{centered}) \\
      s_k &= -\eta_k\, g_k / \sqrt{\hat v_k - |\hat m_k|^2 + \epsilon}
      \quad (\text{or } / (\sqrt{\cdot} + \epsilon) \text{ with } \texttt{eps\_in\_sqrt=False}) \\
      t_k &= s_k + \mu t_{k-1}, \qquad u_k = t_k \ (\text{Nesterov: } s_k + \mu t_k)
    \end{align*}

  :math:`m` only when centered, :math:`t` only with momentum (applied after the learning
  rate, as in optax), hats only with ``bias_correction``.

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    decay: the EMA decay :math:`\rho`.
    eps: the stabilizer :math:`\epsilon`.
    initial_scale: the starting value of :math:`v`.
    eps_in_sqrt: add ``eps`` inside the square root (default) or outside.
    centered: subtract the squared mean (centered RMSprop).
    momentum: the momentum decay :math:`\mu`, or ``None``.
    nesterov: use Nesterov momentum.
    bias_correction: divide the EMAs by :math:`1-\rho^k`.
    nu_dtype: dtype of :math:`v` (optax has no such option); ``None``: the params' dtype.
    stochastic_rounding, rounding_seed: as in :func:`~optirs_jax.adam`.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.
    executor_options: the kernels' layout and launch options (:class:`~optirs_jax.ExecutorOptions`).
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> opt = optirs_jax.rmsprop(0.1, decay=0.0, eps=0.0)
    >>> params = jnp.array([1.0, 1.0])
    >>> updates, _ = opt.update(jnp.array([4.0, -2.0]), opt.init(params))
    >>> updates
    Array([-0.1,  0.1], dtype=float32)

  References:
    Hinton, `Overview of mini-batch gradient descent
    <www.cs.toronto.edu/~tijmen/csc321/slides/lecture_slides_lec6.pdf>`_, 2012;
    Graves, `Generating Sequences With Recurrent Neural Networks
    <https://arxiv.org/abs/1308.0850>`_, 2014.
  """
  return build(RMSPROP, locals())


ENTRIES = (
    Entry("rmsprop", rmsprop, RMSPROP, optax.rmsprop,
          cases=({}, {"centered": True}, {"momentum": 0.9},
                 {"momentum": 0.9, "nesterov": True, "centered": True},
                 {"eps_in_sqrt": False, "initial_scale": 0.1},
                 {"bias_correction": True, "decay": 0.95},
                 # initial_scale > 0: at step 1 a bias-corrected centered variance is exactly
                 # 0 (NaN in optax).
                 {"bias_correction": True, "centered": True, "eps_in_sqrt": False,
                  "initial_scale": 1.0}),
          typical={"centered": True, "momentum": 0.9},
          alias=({"learning_rate": 5e-3}, {"learning_rate": 5e-3, "momentum": 0.9}),
          moments=(("nu", 0, "nu"), ("mu", 0, "mu"), ("trace", 2, "trace")),
          bytes_per_param=20),
)

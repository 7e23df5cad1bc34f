"""Adam and AdamW: one spec, one fused pass."""

from __future__ import annotations

import dataclasses
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


class AdamState(NamedTuple):
  """State of :func:`adam`, :func:`adamw` and :func:`~optirs_jax.lamb`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; saturates at the int32 maximum.
  mu: optax.Updates  # first moment, in ``mu_dtype`` (or the updates' dtype).
  nu: optax.Updates  # second moment, in the params' dtype.


def adam_rule(h, g, *, p, mu, nu, nesterov: bool, decay: bool, scale: bool, cast_lr: bool,
              mu_dtype=None):
  r"""Adam moments and direction, optional decoupled decay, optional learning rate.

  .. math::
    m \leftarrow (1-\beta_1) g + \beta_1 m,\quad v \leftarrow (1-\beta_2)|g|^2 + \beta_2 v,\quad
    u = \frac{\hat m}{\sqrt{\hat v + \bar\epsilon} + \epsilon} + \lambda p

  Returns ``(u, mu, nu)``; ``u`` is multiplied by ``-lr`` when ``scale`` (LAMB scales
  after its trust ratio instead).
  """
  new_mu = rules.ema(h.b1, h.c1, g, mu)
  new_nu = rules.ema(h.b2, h.c2, rules.sq(g), nu)
  if nesterov:
    mu_hat = h.b1 * rules.debias(new_mu, h.bc1_next) + h.c1 * rules.debias(g, h.bc1)
  else:
    mu_hat = rules.debias(new_mu, h.bc1)
  nu_hat = rules.debias(new_nu, h.bc2)
  u = mu_hat / (jnp.sqrt(nu_hat + h.eps_root) + h.eps)
  if decay:
    u = u + h.wd * p
  if scale:
    u = rules.scale_lr(h, u, cast_lr)
  return u, rules.cast(new_mu, mu_dtype), new_nu.astype(nu.dtype)


def adam_scalars(options, count) -> dict:
  """Adam's scalars at this step, as optax's ``scale_by_adam`` computes them."""
  b1, b2 = options["b1"], options["b2"]
  count_inc = optax.safe_increment(count)
  t, t_next = as_float(count_inc), as_float(optax.safe_increment(count_inc))
  return dict(b1=b1, c1=1 - b1, b2=b2, c2=1 - b2, eps=options["eps"],
              eps_root=options["eps_root"], bc1=1 - b1**t, bc1_next=1 - b1**t_next,
              bc2=1 - b2**t)


ADAM_HYPER = ("b1", "c1", "b2", "c2", "eps", "eps_root", "bc1", "bc1_next", "bc2", "wd", "neg_lr")
ADAM_FIELDS = (Field("mu", dtype="mu_dtype"),
               Field("nu", dtype="nu_dtype", pad=1.0, nonneg=True))

ADAMW = OptimizerSpec(
    name="adamw",
    arguments=(("learning_rate", "schedule"), ("b1", "decay rate"), ("b2", "decay rate"),
               ("eps", "number"), ("eps_root", "number"), ("mu_dtype", "dtype"),
               ("nu_dtype", "dtype"), ("weight_decay", "schedule"), ("mask", "mask"),
               ("nesterov", "flag")) + ROUNDING,
    state=AdamState,
    fields=ADAM_FIELDS,
    rule=adam_rule,
    hyper=ADAM_HYPER,
    scalars=adam_scalars,
    static=lambda o: dict(nesterov=bool(o["nesterov"]), scale=True, mu_dtype=o["mu_dtype"]),
    weight_decay=True,
)
ADAM = dataclasses.replace(ADAMW, name="adam")
NADAM = dataclasses.replace(ADAMW, name="nadam")
NADAMW = dataclasses.replace(ADAMW, name="nadamw")


def adam(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
         b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
         eps_root: jax.typing.ArrayLike = 0.0, mu_dtype: Any | None = None, *,
         nu_dtype: Any | None = None, nesterov: bool = False, stochastic_rounding: bool = False,
         rounding_seed: int = 0, backend: str = "auto",
         executor_options: ExecutorOptions | None = None,
         state_quantization: str | None = None, quantization_block_size: int = 256,
         min_quantized_size: int = 4096
         ) -> optax.GradientTransformationExtraArgs:
  r"""Adam, fused into one kernel pass; the same numbers as :func:`optax.adam`.

  .. math::
    \begin{align*}
      m_t &= \beta_1 m_{t-1} + (1-\beta_1) g_t, \qquad
      v_t = \beta_2 v_{t-1} + (1-\beta_2) |g_t|^2 \\
      \hat m_t &= m_t / (1-\beta_1^t), \qquad \hat v_t = v_t / (1-\beta_2^t) \\
      u_t &= -\eta_t\, \hat m_t / (\sqrt{\hat v_t + \bar\epsilon} + \epsilon)
    \end{align*}

  With ``nesterov=True`` (NAdam),
  :math:`\hat m_t = \beta_1 m_t / (1-\beta_1^{t+1}) + (1-\beta_1) g_t / (1-\beta_1^t)`.

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the denominator outside the square root.
    eps_root: added inside the square root.
    mu_dtype: dtype of the first moment; ``None``: the params' dtype.
    nu_dtype: dtype of the second moment (optax has no such option); ``None``: the
      params' dtype. ``jnp.bfloat16`` halves its bytes.
    nesterov: use Nesterov momentum (NAdam).
    stochastic_rounding: round bfloat16 state (and, on the fused apply, bfloat16 params)
      stochastically instead of to nearest: unbiased, so updates smaller than half a
      bfloat16 step still add up (:mod:`optirs_jax.rounding`).
    rounding_seed: the stochastic rounding's seed (its bits also depend on the step count
      and the element): a run is deterministic for a given seed.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"`` (see :mod:`optirs_jax.backends`).
    executor_options: the kernels' layout and launch options
      (:class:`~optirs_jax.ExecutorOptions`; ``None``: the measured defaults).
    state_quantization: ``None`` (float state), ``"dynamic8"`` or ``"fp8"``: each state field
      of a float32 leaf of at least ``min_quantized_size`` elements is stored in 8 bits, one
      float32 absmax per block of ``quantization_block_size`` elements along the last axis
      (the dynamic tree map, unsigned for non-negative fields, or ``float8_e4m3fn``). Each
      step decodes the fields, runs this float32 step and encodes them again: on a GPU
      inside one kernel per large leaf (fp8 state on GPT-2: 1.5x float32 AdamW's fused
      step), elsewhere in jnp.
    quantization_block_size, min_quantized_size: the blocks' size (a power of two) and the
      smallest leaf quantized.

  Returns:
    An :class:`optax.GradientTransformationExtraArgs` with state :class:`AdamState`.

  Example:
    >>> import jax.numpy as jnp, optax, optirs_jax
    >>> params = {"w": jnp.array([1.0, 2.0, 3.0])}
    >>> opt = optirs_jax.adam(1e-1)
    >>> state = opt.init(params)
    >>> grads = {"w": jnp.array([0.5, -1.0, 0.0])}
    >>> updates, state = opt.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"]
    Array([0.9000007, 2.0999994, 3.       ], dtype=float32)

  References:
    Kingma and Ba, `Adam: A Method for Stochastic Optimization
    <https://arxiv.org/abs/1412.6980>`_, 2014; Dozat, `Incorporating Nesterov Momentum
    into Adam <https://openreview.net/pdf?id=OM0jvwB8jIp57ZJjtNEZ>`_, 2016.
  """
  return build(ADAM, dict(locals(), weight_decay=0.0, mask=None))


def adamw(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
          b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
          eps_root: jax.typing.ArrayLike = 0.0, mu_dtype: Any | None = None,
          weight_decay: optax.ScalarOrSchedule = 1e-4, mask: Any = None, *,
          nu_dtype: Any | None = None, nesterov: bool = False,
          stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
          executor_options: ExecutorOptions | None = None,
          state_quantization: str | None = None, quantization_block_size: int = 256,
          min_quantized_size: int = 4096
          ) -> optax.GradientTransformationExtraArgs:
  r"""AdamW (decoupled weight decay), fused; the same numbers as :func:`optax.adamw`.

  .. math::
    u_t = -\eta_t \left( \hat m_t / (\sqrt{\hat v_t + \bar\epsilon} + \epsilon)
          + \lambda\, p_{t-1} \right)

  with :math:`\hat m_t, \hat v_t` as in :func:`adam`. The decay is multiplied by the
  learning rate, as in optax and PyTorch.

  Args:
    learning_rate, b1, b2, eps, eps_root, mu_dtype, nu_dtype, nesterov: as in :func:`adam`.
    stochastic_rounding, rounding_seed, backend, executor_options: as in :func:`adam`.
    weight_decay: the decay :math:`\lambda`, a number or a schedule.
    mask: a tree of bools (or a prefix of the params tree), or a callable returning one,
      ``True`` where the decay applies. Adam itself applies to every leaf.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> params = {"w": jnp.ones(3), "b": jnp.zeros(3)}
    >>> opt = optirs_jax.adamw(1e-3, weight_decay=0.1, mask={"w": True, "b": False})
    >>> updates, state = opt.update(params, opt.init(params), params)
    >>> updates["w"].shape
    (3,)

  References:
    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  return build(ADAMW, locals())


def nadam(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
          b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
          eps_root: jax.typing.ArrayLike = 0.0, mu_dtype: Any | None = None, *,
          nesterov: bool = True, nu_dtype: Any | None = None, stochastic_rounding: bool = False,
          rounding_seed: int = 0, backend: str = "auto",
          executor_options: ExecutorOptions | None = None,
          state_quantization: str | None = None, quantization_block_size: int = 256,
          min_quantized_size: int = 4096
          ) -> optax.GradientTransformationExtraArgs:
  r"""NAdam: :func:`adam` with Nesterov momentum; the same numbers as :func:`optax.nadam`.

  .. math::
    u_t = -\eta_t\, \frac{\beta_1 m_t / (1-\beta_1^{t+1}) + (1-\beta_1) g_t / (1-\beta_1^t)}
          {\sqrt{\hat v_t + \bar\epsilon} + \epsilon}

  Args:
    learning_rate, b1, b2, eps, eps_root, mu_dtype, nu_dtype, stochastic_rounding: as in
      :func:`adam`.
    nesterov: True (NAdam); False is :func:`adam`.
    rounding_seed, backend, executor_options: as in :func:`adam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.nadam(1e-1)
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init({"w": jnp.zeros(2)}))
    >>> [round(v, 5) for v in updates["w"].tolist()]
    [-0.14737, 0.14737]

  References:
    Dozat, `Incorporating Nesterov Momentum into Adam
    <https://openreview.net/pdf?id=OM0jvwB8jIp57ZJjtNEZ>`_, 2016.
  """
  return build(NADAM, dict(locals(), weight_decay=0.0, mask=None))


def nadamw(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
           b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
           eps_root: jax.typing.ArrayLike = 0.0, mu_dtype: Any | None = None,
           weight_decay: optax.ScalarOrSchedule = 1e-4, mask: Any = None, *,
           nesterov: bool = True, nu_dtype: Any | None = None,
           stochastic_rounding: bool = False, rounding_seed: int = 0, backend: str = "auto",
           executor_options: ExecutorOptions | None = None,
           state_quantization: str | None = None, quantization_block_size: int = 256,
           min_quantized_size: int = 4096
           ) -> optax.GradientTransformationExtraArgs:
  r"""NAdamW: :func:`nadam` with decoupled weight decay (:func:`adamw`'s); the same numbers
  as :func:`optax.nadamw`.

  .. math::
    u_t = -\eta_t \left( \frac{\tilde m_t}{\sqrt{\hat v_t + \bar\epsilon} + \epsilon}
          + \lambda\, p_{t-1} \right)

  with :math:`\tilde m_t` NAdam's Nesterov estimate (:func:`nadam`).

  Args:
    learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask: as in :func:`adamw`.
    nesterov, nu_dtype, stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`nadam`.
    state_quantization, quantization_block_size, min_quantized_size: 8-bit state, as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.nadamw(1e-1, weight_decay=0.1)
    >>> p = {"w": jnp.ones(2)}
    >>> updates, _ = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init(p), p)
    >>> [round(v, 5) for v in updates["w"].tolist()]
    [-0.15737, 0.13737]

  References:
    Loshchilov and Hutter, `Decoupled Weight Decay Regularization
    <https://arxiv.org/abs/1711.05101>`_, 2019.
  """
  return build(NADAMW, locals())


_MOMENTS = (("mu", 0, "mu"), ("nu", 0, "nu"))
ENTRIES = (
    Entry("adam", adam, ADAM, optax.adam,
          cases=({}, {"b1": 0.8, "b2": 0.99, "eps": 1e-6, "eps_root": 1e-8}, {"nesterov": True},
                 {"mu_dtype": jnp.float32}),
          alias=({"learning_rate": 1e-1},), moments=_MOMENTS, bytes_per_param=28),
    Entry("adamw", adamw, ADAMW, optax.adamw,
          cases=({}, {"weight_decay": 0.05, "nesterov": True},
                 {"weight_decay": 0.1, "mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)},
                 {"weight_decay": optax.linear_schedule(0.1, 0.0, 50)}),
          typical={"weight_decay": 0.1}, alias=({"learning_rate": 1e-1},), moments=_MOMENTS,
          bytes_per_param=28),
    Entry("nadam", nadam, NADAM, optax.nadam, cases=({}, {"b1": 0.8, "eps_root": 1e-8}),
          alias=({"learning_rate": 1e-2},), moments=_MOMENTS, bytes_per_param=28),
    Entry("nadamw", nadamw, NADAMW, optax.nadamw,
          cases=({}, {"weight_decay": 0.05},
                 {"weight_decay": 0.1, "mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)}),
          typical={"weight_decay": 0.1}, alias=({"learning_rate": 1e-2},), moments=_MOMENTS,
          bytes_per_param=28),
)

"""Adafactor: second moments factored into row and column means, then block-RMS clipping,
the learning rate, the parameter scale, momentum and decay (a factored reduction)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import Factored, Field, OptimizerSpec, Reduction
from optirs_jax.transforms import _checks as c
from optirs_jax.transforms._builder import build
from optirs_jax.transforms._registry import Entry

MIN_SCALE = 1e-3  # optax's scale_by_param_block_rms: the parameter scale's floor


class AdafactorState(NamedTuple):
  """State of :func:`adafactor` (optax keeps the first four in its chain's
  ``FactoredState``, the momentum in its ``EmaState``)."""

  count: jax.Array  # shape=(), dtype=jnp.int32; saturates at the int32 maximum.
  v_row: optax.Updates  # per factored leaf its row means (the leaf without axis d0), else (1,)
  v_col: optax.Updates  # per factored leaf its column means (without axis d1), else (1,)
  v: optax.Updates  # per unfactored leaf the second moment, shaped like it, else (1,)
  mu: optax.Updates  # the momentum (an EMA of the scaled updates), or None without one


def factored_dims(options, shape) -> tuple[int, int] | None:
  """``(d1, d0)``: the leaf's two largest axes (optax's ``_factored_dims``), or None when
  it is not factored (``factored`` off, fewer than two axes, the second largest under
  ``min_dim_size_to_factor``)."""
  if not options["factored"] or len(shape) < 2:
    return None
  least = c.structural_int("optirs_jax.adafactor", "min_dim_size_to_factor",
                           options["min_dim_size_to_factor"], 0)
  if least is None:  # traced: under inject_hyperparams without static_args
    raise ValueError("optirs_jax.adafactor: min_dim_size_to_factor is traced; it decides the "
                     "state's shapes: under optax.inject_hyperparams pass "
                     "static_args=('min_dim_size_to_factor',), as optax's tests do")
  order = np.argsort(shape)
  if shape[order[-2]] < least:
    return None
  return int(order[-2]), int(order[-1])


def adafactor_precondition(h, g, *, row, col, dims):
  """A factored leaf's first pass, as optax's ``scale_by_factored_rms``: the row and column
  means of ``|g|^2 + eps`` into their moving averages, and ``g`` over the root of their
  normalized outer product."""
  d1, d0 = dims
  grad_sqr = rules.abs_sq(g) + h.eps
  new_row = h.decay * row + (1.0 - h.decay) * jnp.mean(grad_sqr, axis=d0)
  new_col = h.decay * col + (1.0 - h.decay) * jnp.mean(grad_sqr, axis=d1)
  new_row, new_col = new_row.astype(row.dtype), new_col.astype(col.dtype)
  reduced_d1 = d1 - 1 if d1 > d0 else d1
  row_col_mean = jnp.mean(new_row, axis=reduced_d1, keepdims=True)
  row_factor = (new_row / row_col_mean) ** -0.5
  col_factor = new_col**-0.5
  r = g * jnp.expand_dims(row_factor, axis=d0) * jnp.expand_dims(col_factor, axis=d1)
  return r, new_row, new_col


def adafactor_rule(h, g, *, p, v, cast_lr: bool):
  """An unfactored leaf's first pass (in the kernels): ``v`` the moving average of
  ``|g|^2 + eps``, ``g / sqrt(v)``."""
  del p, cast_lr
  grad_sqr = rules.abs_sq(g) + h.eps
  new_v = (h.decay * v + (1.0 - h.decay) * grad_sqr).astype(v.dtype)
  return g * new_v**-0.5, new_v


def adafactor_finish(h, u, p, p_mean_sq, u_mean_sq, *, cast_lr: bool, masked: bool,
                     clip: bool, scale: bool, param_block: bool, decay: bool, mu=None):
  """The second pass on one leaf, optax's chain after the factored scaling, from the mean
  squares of the params and of ``u`` (the leaf's scalars, in its dtype as optax's means
  are): clip by the block RMS, the learning rate, the parameter scale, momentum, decay,
  then ``-1``."""
  with jax.numpy_dtype_promotion("standard"):
    if clip:  # optax's clip_by_block_rms
      u = u / jnp.maximum(1.0, jnp.sqrt(u_mean_sq.astype(u.dtype)) / h.clip)
    if scale:
      u = (jnp.asarray(h.lr, dtype=u.dtype) if cast_lr else h.lr) * u
    if param_block:  # optax's scale_by_param_block_rms
      rms = jnp.sqrt(p_mean_sq.astype(p.dtype))
      u = u * jnp.where(rms <= MIN_SCALE, MIN_SCALE, rms)
    new_mu = None
    if mu is not None:
      u = new_mu = rules.ema(h.momentum, h.one_minus_momentum, u, mu)
    if decay and masked:
      u = u + h.wd_rate * p
    u = -1 * u
    return u if mu is None else (u, new_mu)


def _has_decay(rate) -> bool:
  """Whether optax's ``add_decayed_weights`` adds anything (it skips a Python zero)."""
  return rate is not None and not (isinstance(rate, (int, float)) and rate == 0.0)


def adafactor_scalars(o, count) -> dict:
  """This step's scalars as optax computes them: the decay ``1 - (t + 1)^-decay_rate`` at
  ``t = count - decay_offset``, the learning rate and decay rate (schedules at ``count``)."""
  t = jnp.array(count - o["decay_offset"] + 1, jnp.float32)
  lr, wd = o["learning_rate"], o["weight_decay_rate"]
  momentum = 0.0 if o["momentum"] is None else o["momentum"]
  return dict(eps=o["eps"], decay=1.0 - t ** (-o["decay_rate"]),
              clip=1.0 if o["clipping_threshold"] is None else o["clipping_threshold"],
              lr=1.0 if lr is None else (lr(count) if callable(lr) else lr),
              momentum=momentum, one_minus_momentum=1 - momentum,
              wd_rate=0.0 if wd is None else (wd(count) if callable(wd) else wd))


def _validate(fn: str, options) -> None:
  c.structural_int(fn, "min_dim_size_to_factor", options["min_dim_size_to_factor"], 0)


ADAFACTOR = OptimizerSpec(
    name="adafactor",
    arguments=(("learning_rate", "optional schedule"), ("min_dim_size_to_factor", "number"),
               ("decay_rate", "number"), ("decay_offset", "number"),
               ("multiply_by_parameter_scale", "flag"), ("clipping_threshold", "optional number"),
               ("momentum", "optional number"), ("dtype_momentum", "dtype"),
               ("weight_decay_rate", "optional schedule"), ("eps", "number"), ("factored", "flag"),
               ("weight_decay_mask", "mask")),
    state=AdafactorState,
    fields=(Field("v", nonneg=True), Field("mu", dtype="dtype_momentum", when="momentum")),
    rule=adafactor_rule,
    hyper=("eps", "decay", "clip", "lr", "momentum", "one_minus_momentum", "wd_rate"),
    scalars=adafactor_scalars,
    reads_params=True,
    reduction=Reduction(
        inputs=("p",), outputs=("u",), finish=adafactor_finish, fields=("mu",),
        mask="weight_decay_mask", means=True,
        static=lambda o: dict(clip=o["clipping_threshold"] is not None,
                              scale=o["learning_rate"] is not None,
                              param_block=bool(o["multiply_by_parameter_scale"]),
                              decay=_has_decay(o["weight_decay_rate"]))),
    factored=Factored(dims=factored_dims, precondition=adafactor_precondition),
    validate=_validate,
)


def adafactor(learning_rate: optax.ScalarOrSchedule | None = None,
              min_dim_size_to_factor: int = 128, decay_rate: jax.typing.ArrayLike = 0.8,
              decay_offset: jax.typing.ArrayLike = 0, multiply_by_parameter_scale: bool = True,
              clipping_threshold: jax.typing.ArrayLike | None = 1.0,
              momentum: jax.typing.ArrayLike | None = None,
              dtype_momentum: Any = jnp.float32,
              weight_decay_rate: optax.ScalarOrSchedule | None = None,
              eps: jax.typing.ArrayLike = 1e-30, factored: bool = True,
              weight_decay_mask: Any = None, *, backend: str = "auto",
              executor_options: ExecutorOptions | None = None
              ) -> optax.GradientTransformationExtraArgs:
  r"""Adafactor, fused; the same arguments and numbers as :func:`optax.adafactor`.

  Per leaf, with :math:`\hat\beta_t = 1 - (t + 1)^{-c}` (``decay_rate`` :math:`c`, ``t`` the
  step less ``decay_offset``) and :math:`G = |g_t|^2 + \epsilon`: a leaf whose two largest
  axes both have at least ``min_dim_size_to_factor`` elements keeps row and column means,

  .. math::
    \begin{align*}
      R_t &= \hat\beta_t R_{t-1} + (1 - \hat\beta_t)\,\mathrm{mean}_{\text{cols}}(G), \quad
      C_t = \hat\beta_t C_{t-1} + (1 - \hat\beta_t)\,\mathrm{mean}_{\text{rows}}(G) \\
      r_t &= g_t \Big/ \sqrt{\frac{R_t}{\mathrm{mean}(R_t)} \otimes C_t},
    \end{align*}

  any other leaf one value per element, :math:`V_t = \hat\beta_t V_{t-1} + (1 -
  \hat\beta_t) G` and :math:`r_t = g_t / \sqrt{V_t}`. Then, per leaf,

  .. math::
    \begin{align*}
      s_t &= \eta_t \, \max(\mathrm{rms}(p), 10^{-3}) \,
             \frac{r_t}{\max(1, \mathrm{rms}(r_t) / d)} \\
      m_t &= \beta m_{t-1} + (1 - \beta) s_t \quad (\text{with momentum } \beta) \\
      u_t &= -(m_t + \lambda p)
    \end{align*}

  (:math:`d` = ``clipping_threshold``; :math:`\lambda` = ``weight_decay_rate`` where
  ``weight_decay_mask`` is set). Unfactored leaves run in the kernels, both passes; a
  factored leaf's row and column means are XLA's reductions, and its second pass runs
  where XLA fuses the preconditioned gradient into it (:class:`optirs_jax.spec.Factored`).
  Links before it, loss scaling and master weights are not folded into its fused apply
  (:func:`optirs_jax.apply` falls back to ``update`` then ``apply_updates``).

  Args:
    learning_rate: a number, a scalar array, a schedule ``count -> lr``, or None (no
      scaling, as optax's default).
    min_dim_size_to_factor: factor a leaf's statistics only if its two largest axes both
      have at least this many elements (a concrete int: under ``optax.inject_hyperparams``
      pass ``static_args=("min_dim_size_to_factor",)``, as optax's tests do).
    decay_rate: :math:`c`, the second moments' decay exponent.
    decay_offset: the step at which the decay schedule starts (fine-tuning).
    multiply_by_parameter_scale: scale by the parameters' RMS (at least ``1e-3``).
    clipping_threshold: :math:`d`, the RMS the preconditioned gradient is clipped to; None:
      no clipping.
    momentum: :math:`\beta`, an exponential moving average of the updates (in
      ``dtype_momentum``); None: none (no state).
    dtype_momentum: the momentum's dtype.
    weight_decay_rate: :math:`\lambda`, a number or a schedule; None: no decay.
    eps: :math:`\epsilon`, added to the squared gradients.
    factored: factor the statistics of large matrices at all.
    weight_decay_mask: an optax-style mask of the leaves to decay (a tree of bools, a
      prefix of one, or a callable of the params).
    backend, executor_options: as in :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adafactor(0.1)
    >>> p = {"w": jnp.ones((256, 128)), "b": jnp.array([3.0, 4.0])}
    >>> updates, state = tx.update(p, tx.init(p), p)
    >>> state.v_row["w"].shape, state.v_col["w"].shape, state.v["w"].shape, state.v["b"].shape
    ((128,), (256,), (1,), (2,))
    >>> updates["b"]  # -lr * rms(p) * g / |g| at the first step (the decay is 0)
    Array([-0.35355338, -0.35355338], dtype=float32)

  References:
    Shazeer and Stern, `Adafactor: Adaptive Learning Rates with Sublinear Memory Cost
    <https://arxiv.org/abs/1804.04235>`_, 2018.
  """
  return build(ADAFACTOR, locals())


def _decay_matrices(params):
  """A ``weight_decay_mask``: the leaves with two or more axes."""
  return jax.tree.map(lambda x: x.ndim >= 2, params)


ENTRIES = (
    Entry("adafactor", adafactor, ADAFACTOR, optax.adafactor,
          cases=({}, {"min_dim_size_to_factor": 4},
                 {"min_dim_size_to_factor": 4, "momentum": 0.9, "weight_decay_rate": 1e-3},
                 {"clipping_threshold": None, "multiply_by_parameter_scale": False,
                  "factored": False},
                 {"min_dim_size_to_factor": 32, "decay_rate": 0.5, "decay_offset": -3,
                  "eps": 1e-20, "clipping_threshold": 0.5, "momentum": 0.8,
                  "dtype_momentum": jnp.bfloat16, "weight_decay_rate": 1e-2,
                  "weight_decay_mask": _decay_matrices}),
          # (momentum in the params' dtype: with float32 momentum optax's updates of
          # half-precision params are float32)
          typical={"min_dim_size_to_factor": 4, "momentum": 0.9, "dtype_momentum": None,
                   "weight_decay_rate": 1e-3},
          alias=({"learning_rate": 5e-3}, {}),
          moments=(("v_row", 0, "v_row"), ("v_col", 0, "v_col"), ("v", 0, "v"),
                   ("mu", 4, "ema")),
          complex=False, bytes_per_param=24),
)

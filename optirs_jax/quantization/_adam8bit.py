"""Adam and AdamW with 8-bit block-wise quantized moments."""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax.pallas import lazy_branches
from optirs_jax.pallas.dispatch import lowering_targets
from optirs_jax.pallas.op import hyper_vector, read_hyper
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.quantization import _kernel8
from optirs_jax.quantization._blockwise import Quantized8bit, as_blocks
from optirs_jax.transforms._checks import (
  as_float,
  check_backend,
  check_executor_options,
  check_number,
  check_number_or_schedule,
  check_unit_interval,
  flatten,
  learning_rate,
  match,
  weight_decay_value,
)


class Adam8bitState(NamedTuple):
  """State of :func:`adam8bit` and :func:`adamw8bit`: per leaf, a :class:`Quantized8bit`
  (``int8`` codes for ``mu``, ``uint8`` for ``nu``) or, for leaves smaller than
  ``min_8bit_size``, a float32 array."""

  count: jax.Array
  mu: Any
  nu: Any


def _check_int(fn: str, name: str, value, lo: int, *, power_of_two: bool = False):
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo or (
      power_of_two and value & (value - 1)):
    kind = "a power of two" if power_of_two else "an int"
    raise ValueError(f"{fn}: {name}={value!r} must be {kind} >= {lo}")


def _init_leaf(x, block_size: int, min_8bit_size: int):
  # Separate buffers for every field: a step that donates the state may not see one twice.
  if x.size < min_8bit_size:
    return jnp.zeros(x.shape, jnp.float32), jnp.zeros(x.shape, jnp.float32)
  nb = -(-x.size // block_size)
  return (Quantized8bit(jnp.zeros((nb, block_size), jnp.int8), jnp.zeros((nb,), jnp.float32),
                        tuple(x.shape)),
          Quantized8bit(jnp.zeros((nb, block_size), jnp.uint8), jnp.zeros((nb,), jnp.float32),
                        tuple(x.shape)))


def _leaf(hvec, p, g, mu, nu, *, platform, l2, decoupled, fused, tiling):
  """One leaf: ``(updates or new params, new mu, new nu)``."""
  out_dtype = p.dtype if fused else g.dtype
  if not isinstance(mu, Quantized8bit):
    h = read_hyper(hvec, _kernel8.HYPER)
    p32 = p.astype(jnp.float32)
    u, mu, nu = _kernel8.adam_math(h, p32, g, mu, nu, l2=l2, decoupled=decoupled)
    return ((p32 + u) if fused else u).astype(out_dtype), mu, nu
  bs = mu.block_size
  aligned = g.size % bs == 0
  if platform != "jnp" and not aligned:
    platform = "jnp"  # a padded copy would cost more than the kernel saves
  out, muc, mua, nuc, nua = _kernel8.leaf_step(
      hvec, as_blocks(p, bs), as_blocks(g, bs), mu.codes, mu.absmax[:, None], nu.codes,
      nu.absmax[:, None], out_dtype, platform=platform, l2=l2, decoupled=decoupled,
      fused=fused, tiling=tiling)
  out = out.reshape(-1)
  if not aligned:
    out = out[:g.size]
  return (out.reshape(g.shape), Quantized8bit(muc, mua[:, 0], mu.shape),
          Quantized8bit(nuc, nua[:, 0], nu.shape))


def _make(fn: str, learning_rate_, b1, b2, eps, weight_decay, block_size, min_8bit_size,
          backend, executor_options, *, decoupled: bool
          ) -> optax.GradientTransformationExtraArgs:
  check_number_or_schedule(fn, "learning_rate", learning_rate_)
  check_unit_interval(fn, "b1", b1)
  check_unit_interval(fn, "b2", b2)
  check_number(fn, "eps", eps)
  check_number_or_schedule(fn, "weight_decay", weight_decay)
  _check_int(fn, "block_size", block_size, 2, power_of_two=True)
  _check_int(fn, "min_8bit_size", min_8bit_size, 0)
  backend = check_backend(fn, backend)
  tiling = check_executor_options(fn, executor_options).quantized_tiling

  def init_fn(params):
    leaves, _, treedef = flatten(fn, "params", params)
    pairs = [_init_leaf(x, block_size, min_8bit_size) for x in leaves]
    return Adam8bitState(jnp.zeros([], jnp.int32),
                         jax.tree.unflatten(treedef, [m for m, _ in pairs]),
                         jax.tree.unflatten(treedef, [v for _, v in pairs]))

  def step(grads, state, params, fused: bool):
    gl, paths, treedef = flatten(fn, "updates", grads)
    wd, has_wd = weight_decay_value(weight_decay, state.count)
    if params is None:
      if has_wd or fused:
        raise ValueError(f"{fn}: params are required ({'weight_decay' if has_wd else 'apply'})")
      pl_ = [jnp.zeros_like(g) for g in gl]  # read by neither the math nor the output
    else:
      pl_ = match(fn, "params", params, treedef, gl, paths)
    is_q = lambda x: isinstance(x, Quantized8bit)
    mus, mtd = jax.tree.flatten(state.mu, is_leaf=is_q)
    nus = jax.tree.leaves(state.nu, is_leaf=is_q)
    if mtd.num_leaves != treedef.num_leaves or len(nus) != len(mus):
      raise ValueError(f"{fn}: the state does not match the updates' structure; it was made "
                       "by init() for other params")
    for m, g, path in zip(mus, gl, paths):
      shape = m.shape
      if tuple(shape) != tuple(g.shape):
        raise ValueError(f"{fn}: state leaf {path} has shape {tuple(shape)} but the updates "
                         f"leaf has shape {g.shape}")
    count = state.count
    t = as_float(optax.safe_increment(count))
    neg_lr, _ = learning_rate(learning_rate_, count)
    hvec = hyper_vector(dict(b1=b1, c1=1 - b1, b2=b2, c2=1 - b2, eps=eps, bc1=1 - b1**t,
                             bc2=1 - b2**t, wd=wd, neg_lr=neg_lr), _kernel8.HYPER)
    kw = dict(l2=has_wd and not decoupled, decoupled=has_wd and decoupled, fused=fused,
              tiling=tiling)

    def run(platform):  # a branch of the arrays it is given (it may run at lowering time)
      def go(args):
        hvec, pl_, gl, mus, nus = args
        outs = [_leaf(hvec, p, g, m, v, platform=platform, **kw)
                for p, g, m, v in zip(pl_, gl, mus, nus)]
        return tuple(zip(*outs)) if outs else ((), (), ())
      return go

    args = (hvec, pl_, gl, mus, nus)
    targets = lowering_targets([(g,) for g in gl[:1]])
    other = "jnp" if backend in ("jnp", "auto") else "interpret"
    if backend == "jnp" or not gl or "cuda" not in targets:
      first, new_mu, new_nu = run(other)(args)
    else:  # the kernel's branch traced now, the other when lowered for another platform
      first, new_mu, new_nu = lazy_branches.platform_dependent(args, cuda=run("cuda"),
                                                               default=run(other))
    unflat = lambda xs: jax.tree.unflatten(treedef, list(xs))
    new_state = Adam8bitState(optax.safe_increment(count), unflat(new_mu), unflat(new_nu))
    return unflat(first), new_state

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    return step(updates, state, params, fused=False)

  def fused_apply(grads, state, params):
    return step(grads, state, params, fused=True)

  update_fn.fused_apply = fused_apply
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adam8bit(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
             eps: float = 1e-8, weight_decay: float = 0.0, *, block_size: int = 256,
             min_8bit_size: int = 4096, backend: str = "auto",
             executor_options: ExecutorOptions | None = None
             ) -> optax.GradientTransformationExtraArgs:
  r"""Adam whose moments are stored in 8 bits, block-wise quantized (Dettmers et al., 2022).

  Each step dequantizes the moments, runs Adam in float32 and requantizes:

  .. math::
    g &\leftarrow g + \lambda p \quad (\text{L2, when } \lambda \ne 0)\\
    m &\leftarrow \beta_1 m + (1-\beta_1) g,\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2\\
    u &= -\eta\,\frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

  then each block of ``block_size`` elements of ``m`` (of ``v``) is divided by its absolute
  maximum, kept as one float32 per block, and each element stored as the nearest code of
  the signed (``int8``) or unsigned (``uint8``) dynamic map (:func:`code_map`). Leaves with
  fewer than ``min_8bit_size`` elements keep float32 moments (and then equal ``optax.adam``
  to float32 rounding). For large leaves the state takes about 1.02 bytes per element and
  moment instead of 4.

  On GPU (``backend="auto"`` or ``"pallas"``) one Pallas kernel pass per 8-bit leaf
  dequantizes, updates, requantizes and writes the updates, or with
  :func:`optirs_jax.apply` the new params (in place when donated), for leaves whose size is
  a multiple of ``block_size``; other leaves, and other platforms, run the same jnp math.
  Not yet partitioned under sharding (the 8-bit leaves are computed whole on each device).

  Args:
    learning_rate: a number or an optax schedule.
    b1, b2, eps: Adam's decay rates and epsilon.
    weight_decay: L2 penalty added to the gradient (``torch.optim.Adam``'s); see
      :func:`adamw8bit` for decoupled decay.
    block_size: elements per quantization block (a power of two).
    min_8bit_size: leaves with fewer elements keep float32 moments.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.
    executor_options: the kernel's geometry (``ExecutorOptions.quantized_tiling``).

  Example:
    >>> import jax, jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adam8bit(1e-3, min_8bit_size=0)
    >>> params = {"w": jnp.ones((4, 256))}
    >>> state = tx.init(params)
    >>> state.mu["w"].codes.dtype, state.nu["w"].codes.dtype
    (dtype('int8'), dtype('uint8'))
    >>> params, state = optirs_jax.apply(tx, {"w": jnp.full((4, 256), 0.5)}, state, params)
    >>> float(params["w"][0, 0])
    0.9990000128746033
  """
  return _make("adam8bit", learning_rate, b1, b2, eps, weight_decay, block_size,
               min_8bit_size, backend, executor_options, decoupled=False)


def adamw8bit(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999,
              eps: float = 1e-8, weight_decay: float = 1e-2, *, block_size: int = 256,
              min_8bit_size: int = 4096, backend: str = "auto",
              executor_options: ExecutorOptions | None = None
              ) -> optax.GradientTransformationExtraArgs:
  r""":func:`adam8bit` with decoupled weight decay (as ``optax.adamw``):
  :math:`u = -\eta\,(\hat m / (\sqrt{\hat v} + \epsilon) + \lambda p)`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adamw8bit(1e-3)
    >>> params = {"w": jnp.ones((64, 128))}
    >>> state = tx.init(params)
    >>> state.mu["w"].nbytes / (params["w"].size * 4)  # 8-bit codes + one scale per block
    0.25390625
  """
  return _make("adamw8bit", learning_rate, b1, b2, eps, weight_decay, block_size,
               min_8bit_size, backend, executor_options, decoupled=True)


def state_nbytes(state) -> int:
  """Bytes held by the arrays of an optimizer state (8-bit codes and scales included)."""
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))

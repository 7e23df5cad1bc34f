"""Fake quantization (quantize, then dequantize) with a straight-through estimator, and the
calibration of its scales."""

from __future__ import annotations

import numbers
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
CALIBRATION_METHODS = ("max", "percentile")


def _check_axis(fn: str, x, axis):
  if axis is None:
    return None
  if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
    raise TypeError(f"{fn}: axis={axis!r} must be None (per tensor) or an int (per channel)")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"{fn}: axis={axis} is out of range for an array of {x.ndim} dimensions "
                     f"(shape {x.shape}); valid axes are None and {-x.ndim}..{x.ndim - 1}")
  return int(axis) % x.ndim


def _reduce_axes(x, axis):
  return tuple(d for d in range(x.ndim) if d != axis)


def _per_channel(v, x, axis):
  """A per-tensor (scalar) or per-channel ([x.shape[axis]]) value, broadcastable to ``x``."""
  if axis is None:
    return v
  shape = [1] * x.ndim
  shape[axis] = x.shape[axis]
  return jnp.reshape(v, shape)


def _absmax(x, axis):
  return jnp.max(jnp.abs(x), axis=_reduce_axes(x, axis) if axis is not None else None)


def _check_given(fn: str, name: str, v, x, axis, *, positive: bool):
  v = jnp.asarray(v)
  want = () if axis is None else (x.shape[axis],)
  if v.shape not in (want, ()):
    raise ValueError(f"{fn}: {name} has shape {v.shape}; valid shapes are () and {want} "
                     f"(one per index of axis {axis})" if axis is not None else
                     f"{fn}: {name} has shape {v.shape}; per tensor (axis=None) it must be a "
                     "scalar")
  if not isinstance(v, jax.core.Tracer):
    bad = np.asarray(v) <= 0 if positive else np.asarray(v) < 0
    if np.any(bad) or (positive and not np.all(np.isfinite(np.asarray(v)))):
      raise ValueError(f"{fn}: {name}={np.asarray(v)!r} must be "
                       f"{'positive and finite' if positive else 'non-negative'}")
  return v


def _safe_scale(s):
  return jnp.where(s > 0, s, jnp.ones_like(s))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fq(x, scale, zero_point, qmin, qmax):
  q = jnp.clip(jnp.round(x / scale) + zero_point, qmin, qmax)
  return ((q - zero_point) * scale).astype(x.dtype)


def _fq_fwd(x, scale, zero_point, qmin, qmax):
  q = jnp.round(x / scale) + zero_point
  inside = (q >= qmin) & (q <= qmax)
  return _fq(x, scale, zero_point, qmin, qmax), (inside, scale, zero_point)


def _fq_bwd(qmin, qmax, res, g):
  inside, scale, zero_point = res
  return (jnp.where(inside, g, jnp.zeros_like(g)), jnp.zeros_like(scale),
          jnp.zeros_like(zero_point))


_fq.defvjp(_fq_fwd, _fq_bwd)


def fake_quant(x: jax.Array, *, bits: int = 8, symmetric: bool = True, axis: int | None = None,
               scale=None, zero_point=None) -> jax.Array:
  r"""Quantize to ``bits``-bit integers and back, with a straight-through gradient.

  .. math::
    q = \mathrm{clip}(\mathrm{round}(x / s) + z,\ q_{min},\ q_{max}),\qquad
    \mathrm{fake\_quant}(x) = (q - z)\,s

  ``round`` is to nearest, ties to even. Symmetric: :math:`[q_{min}, q_{max}] =
  [-(2^{b-1}-1),\ 2^{b-1}-1]`, ``z = 0`` and, when ``scale`` is None, :math:`s = \max|x| /
  q_{max}`. Asymmetric: :math:`[0, 2^b - 1]` and, when ``scale`` is None, the range
  :math:`[\min(x, 0), \max(x, 0)]` maps onto it with the integer zero point
  :math:`z = \mathrm{round}(-\min / s)` (zero stays exact). ``axis=k`` keeps one scale (and
  zero point) per index of axis ``k`` (per channel); computed scales carry no gradient.

  The gradient with respect to ``x`` is 1 where :math:`\mathrm{round}(x/s) + z` lies in
  :math:`[q_{min}, q_{max}]` and 0 where it was clipped (PyTorch's
  ``fake_quantize_per_tensor_affine``); ``scale`` and ``zero_point`` get no gradient.

  Example:
    >>> import jax.numpy as jnp
    >>> from optirs_jax.quantization import fake_quant
    >>> x = jnp.array([0.1, -0.5, 1.27])
    >>> bool(jnp.all(jnp.abs(fake_quant(x) - x) <= 1.27 / 127 / 2))  # scale = max|x| / 127
    True
    >>> fake_quant(jnp.array([0.3, 2.0]), bits=4, scale=0.25)  # 2.0 clips to 7 * 0.25
    Array([0.25, 1.75], dtype=float32)
  """
  fn = "fake_quant"
  if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 2 <= bits <= 16:
    raise ValueError(f"{fn}: bits={bits!r} must be an int in 2..16")
  if not isinstance(symmetric, (bool, np.bool_)):
    raise TypeError(f"{fn}: symmetric={symmetric!r} must be True or False")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{fn}: x has dtype {x.dtype}; it must be a floating array")
  axis = _check_axis(fn, x, axis)
  if symmetric:
    if zero_point is not None:
      raise ValueError(f"{fn}: zero_point={zero_point!r} is only used with symmetric=False")
    qmin, qmax = -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
  else:
    qmin, qmax = 0, 2**bits - 1
  if scale is None:
    if zero_point is not None:
      raise ValueError(f"{fn}: zero_point is given without a scale; give both or neither")
    xs = jax.lax.stop_gradient(x).astype(jnp.float32)
    if symmetric:
      s = _safe_scale(_absmax(xs, axis) / qmax)
      z = jnp.zeros_like(s)
    else:
      red = _reduce_axes(xs, axis) if axis is not None else None
      lo = jnp.minimum(jnp.min(xs, axis=red), 0.0)
      hi = jnp.maximum(jnp.max(xs, axis=red), 0.0)
      s = _safe_scale((hi - lo) / qmax)
      z = jnp.clip(jnp.round(-lo / s), qmin, qmax)
  else:
    s = _check_given(fn, "scale", scale, x, axis, positive=True).astype(jnp.float32)
    if symmetric:
      z = jnp.zeros_like(s)
    else:
      if zero_point is None:
        raise ValueError(f"{fn}: symmetric=False with a given scale needs its zero_point "
                         f"(an integer in 0..{qmax})")
      z = _check_given(fn, "zero_point", zero_point, x, axis, positive=False)
      z = jnp.broadcast_to(z.astype(jnp.float32), s.shape) if s.ndim else z.astype(jnp.float32)
  s, z = _per_channel(s, x, axis), _per_channel(z, x, axis)
  return _fq(x, s, z, qmin, qmax)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fq8(x, scale, dtype):
  fmax = float(jnp.finfo(dtype).max)
  y = jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax)
  return (y.astype(dtype).astype(jnp.float32) * scale).astype(x.dtype)


def _fq8_fwd(x, scale, dtype):
  fmax = float(jnp.finfo(dtype).max)
  inside = jnp.abs(x.astype(jnp.float32) / scale) <= fmax
  return _fq8(x, scale, dtype), (inside, scale)


def _fq8_bwd(dtype, res, g):
  inside, scale = res
  return jnp.where(inside, g, jnp.zeros_like(g)), jnp.zeros_like(scale)


_fq8.defvjp(_fq8_fwd, _fq8_bwd)


def fake_quant_fp8(x: jax.Array, dtype=jnp.float8_e4m3fn, *, axis: int | None = None,
                   scale=None) -> jax.Array:
  r"""Scale, round through a real 8-bit float dtype, and scale back, with a straight-through
  gradient.

  .. math::
    \mathrm{fake\_quant\_fp8}(x) = s \cdot \mathrm{fp8}(\mathrm{clip}(x / s, -F, F))

  where ``fp8`` is the cast to ``dtype`` (``float8_e4m3fn``: F = 448; ``float8_e5m2``:
  F = 57344) and back, rounding to nearest even as the dtype does; values beyond ``F``
  saturate to it. With ``scale=None``, :math:`s = \max|x| / F` (per tensor, or per index of
  ``axis``). The gradient is 1 where :math:`|x / s| \le F`, else 0.

  Example:
    >>> import jax.numpy as jnp
    >>> from optirs_jax.quantization import fake_quant_fp8
    >>> fake_quant_fp8(jnp.array([1.0, 0.3, 500.0]), scale=1.0).tolist()  # 500 saturates
    [1.0, 0.3125, 448.0]
  """
  fn = "fake_quant_fp8"
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt not in FP8_DTYPES:
    raise ValueError(f"{fn}: dtype={dtype!r} is not supported; valid dtypes are "
                     f"{[str(d) for d in FP8_DTYPES]}")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{fn}: x has dtype {x.dtype}; it must be a floating array")
  axis = _check_axis(fn, x, axis)
  if scale is None:
    fmax = float(jnp.finfo(dt).max)
    s = _safe_scale(_absmax(jax.lax.stop_gradient(x).astype(jnp.float32), axis) / fmax)
  else:
    s = _check_given(fn, "scale", scale, x, axis, positive=True).astype(jnp.float32)
  return _fq8(x, _per_channel(s, x, axis), dt)


def calibrate(x: jax.Array, method: str = "max", *, percentile: float = 99.99,
              axis: int | None = None) -> jax.Array:
  r"""The clipping range of ``x``: :math:`\max|x|` (``"max"``) or the ``percentile``-th
  percentile of :math:`|x|` (``"percentile"``, linear interpolation), per tensor or per index
  of ``axis``. Divide by :math:`q_{max}` for :func:`fake_quant`'s ``scale``.

  Example:
    >>> import jax.numpy as jnp
    >>> from optirs_jax.quantization import calibrate, fake_quant
    >>> x = jnp.array([[0.5, -2.0], [1.0, 0.25]])
    >>> calibrate(x, axis=0)
    Array([2., 1.], dtype=float32)
    >>> fake_quant(x, axis=0, scale=calibrate(x, axis=0) / 127).shape
    (2, 2)
  """
  fn = "calibrate"
  if method not in CALIBRATION_METHODS:
    raise ValueError(f"{fn}: method={method!r} is not known; valid methods are "
                     f"{CALIBRATION_METHODS}")
  if isinstance(percentile, bool) or not isinstance(percentile, numbers.Real) or not (
      0 < percentile <= 100):
    raise ValueError(f"{fn}: percentile={percentile!r} must be a number in (0, 100]")
  x = jnp.asarray(x)
  axis = _check_axis(fn, x, axis)
  a = jnp.abs(x.astype(jnp.float32))
  red = _reduce_axes(x, axis) if axis is not None else None
  if method == "max":
    return jnp.max(a, axis=red)
  if axis is None:
    return jnp.percentile(a, percentile)
  return jnp.percentile(jnp.moveaxis(a, axis, 0).reshape(x.shape[axis], -1), percentile, axis=1)


def ema_calibrate(prev_scale, x: jax.Array, decay: float, *, axis: int | None = None):
  r"""A clipping range tracked during training:
  :math:`\mathrm{decay} \cdot \mathrm{prev} + (1 - \mathrm{decay}) \max|x|` (per tensor, or
  per index of ``axis``).

  Example:
    >>> import jax.numpy as jnp
    >>> from optirs_jax.quantization import ema_calibrate
    >>> ema_calibrate(jnp.float32(1.0), jnp.array([3.0, -2.0]), 0.9)
    Array(1.2, dtype=float32)
  """
  fn = "ema_calibrate"
  if isinstance(decay, numbers.Real) and not isinstance(decay, bool):
    if not 0 <= decay <= 1:
      raise ValueError(f"{fn}: decay={decay!r} must be in [0, 1]")
  elif not isinstance(decay, jax.Array):
    raise TypeError(f"{fn}: decay={decay!r} must be a number in [0, 1]")
  x = jnp.asarray(x)
  axis = _check_axis(fn, x, axis)
  cur = calibrate(x, "max", axis=axis)
  prev = jnp.asarray(prev_scale, jnp.float32)
  if prev.shape != cur.shape:
    raise ValueError(f"{fn}: prev_scale has shape {prev.shape} but the range of x "
                     f"{'per tensor' if axis is None else f'along axis {axis}'} has shape "
                     f"{cur.shape}")
  return decay * prev + (1 - decay) * cur

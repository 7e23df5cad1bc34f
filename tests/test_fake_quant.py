"""Fake quantization, fp8 and calibration against their stated semantics written in numpy."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from optirs_jax.quantization import calibrate, ema_calibrate, fake_quant, fake_quant_fp8


def _x(shape=(6, 37), seed=0, scale=3.0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32) * scale


def _np_fake_quant(x, bits, symmetric, axis):
  """Quantize-dequantize as stated: scale from max|x| (or min/max with zero kept exact)."""
  red = None if axis is None else tuple(d for d in range(x.ndim) if d != axis)
  keep = lambda v: v if axis is None else np.expand_dims(v, red)
  if symmetric:
    qmin, qmax = -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    s = keep(np.max(np.abs(x), axis=red) / qmax).astype(np.float32)
    z = np.zeros_like(s)
  else:
    qmin, qmax = 0, 2**bits - 1
    lo = np.minimum(np.min(x, axis=red), 0)
    hi = np.maximum(np.max(x, axis=red), 0)
    s = keep((hi - lo) / qmax).astype(np.float32)
    z = np.clip(np.round(-keep(lo) / s), qmin, qmax).astype(np.float32)
  q = np.clip(np.round(x / s) + z, qmin, qmax)
  return ((q - z) * s).astype(np.float32), s


@pytest.mark.parametrize("bits", [2, 4, 8, 16])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
def test_fake_quant_matches_numpy_and_error_is_at_most_half_a_step(bits, symmetric, axis):
  x = _x()
  y = np.asarray(fake_quant(jnp.asarray(x), bits=bits, symmetric=symmetric, axis=axis))
  ref, s = _np_fake_quant(x, bits, symmetric, None if axis is None else axis % 2)
  np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6 * float(np.max(s)))
  # Nothing is clipped with computed scales: every element is within half a step.
  assert np.all(np.abs(x - y) <= s / 2 * (1 + 1e-5) + 1e-7)


def test_per_channel_scales_follow_the_axis():
  x = _x((4, 5))
  x[2] *= 100.0  # one large row: per-row scales keep the other rows fine
  per_row = np.asarray(fake_quant(jnp.asarray(x), bits=4, axis=0))
  per_tensor = np.asarray(fake_quant(jnp.asarray(x), bits=4))
  small = np.arange(4) != 2
  assert np.abs(per_row - x)[small].max() < np.abs(per_tensor - x)[small].max() / 10
  for r in range(4):
    s = np.max(np.abs(x[r])) / 7
    np.testing.assert_allclose(per_row[r], np.clip(np.round(x[r] / s), -7, 7) * s, rtol=1e-6)


def test_given_scale_clips_and_ties_round_to_even():
  x = jnp.array([0.5, 1.5, 2.5, -2.5, 9.0, -9.0])
  assert fake_quant(x, bits=4, scale=1.0).tolist() == [0.0, 2.0, 2.0, -2.0, 7.0, -7.0]
  # asymmetric, zero point 3: range [-3, 12] * scale
  y = fake_quant(jnp.array([-4.0, -3.0, 0.0, 12.0, 13.0]), bits=4, symmetric=False,
                 scale=1.0, zero_point=3)
  assert y.tolist() == [-3.0, -3.0, 0.0, 12.0, 12.0]


@pytest.mark.parametrize("symmetric", [True, False])
def test_straight_through_gradient_is_one_inside_and_zero_where_clipped(symmetric):
  x = _x((50,), seed=3)
  w = np.random.default_rng(4).normal(size=x.shape).astype(np.float32)
  scale, zp = 0.05, (None if symmetric else 100)
  grad = jax.grad(lambda v: jnp.sum(fake_quant(v, bits=8, symmetric=symmetric, scale=scale,
                                               zero_point=zp) * w))(jnp.asarray(x))
  q = np.round(x / np.float32(scale)) + (0 if symmetric else zp)
  lo, hi = (-127, 127) if symmetric else (0, 255)
  inside = (q >= lo) & (q <= hi)
  assert 0 < inside.sum() < x.size  # both cases occur
  np.testing.assert_array_equal(np.asarray(grad), np.where(inside, w, 0.0))


def test_computed_scale_carries_no_gradient():
  x = jnp.asarray(_x((8,)))
  g = jax.grad(lambda v: jnp.sum(fake_quant(v, bits=8)))(x)
  np.testing.assert_array_equal(np.asarray(g), np.ones(8))  # max|x| is inside, nothing else


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("axis", [None, 1])
def test_fp8_equals_the_real_dtype_rounding(dtype, axis):
  x = _x((3, 40), seed=5)
  y = np.asarray(fake_quant_fp8(jnp.asarray(x), dtype, axis=axis))
  fmax = float(ml_dtypes.finfo(np.dtype(dtype)).max)
  red = None if axis is None else 0
  s = (np.max(np.abs(x), axis=red, keepdims=axis is not None) / fmax).astype(np.float32)
  ref = (x / s).astype(np.dtype(dtype)).astype(np.float32) * s
  # fp8 steps are 6% (e4m3) or 12% (e5m2) apart: 1e-6 leaves room for the scale's last bit
  # (XLA may divide by a broadcast scale as a multiply by its reciprocal) and no other code.
  np.testing.assert_allclose(y, ref, rtol=1e-6)


def test_fp8_saturates_and_its_gradient_is_zero_beyond_the_max():
  x = jnp.array([1.0, 448.0, 449.0, 1e6, -1e6])
  y = fake_quant_fp8(x, scale=1.0)
  assert y.tolist() == [1.0, 448.0, 448.0, 448.0, -448.0]
  g = jax.grad(lambda v: jnp.sum(fake_quant_fp8(v, scale=1.0)))(x)
  assert g.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
  assert fake_quant_fp8(jnp.array([60000.0]), jnp.float8_e5m2, scale=1.0).tolist() == [57344.0]


def test_calibrate_and_ema_against_numpy():
  x = _x((5, 300), seed=6)
  np.testing.assert_allclose(calibrate(jnp.asarray(x)), np.max(np.abs(x)), rtol=1e-7)
  np.testing.assert_allclose(calibrate(jnp.asarray(x), axis=0), np.max(np.abs(x), axis=1))
  np.testing.assert_allclose(calibrate(jnp.asarray(x), "percentile", percentile=99.0),
                             np.percentile(np.abs(x), 99.0), rtol=1e-5)
  np.testing.assert_allclose(calibrate(jnp.asarray(x), "percentile", percentile=90.0, axis=1),
                             np.percentile(np.abs(x), 90.0, axis=0), rtol=1e-5)
  prev = np.float32(2.0)
  np.testing.assert_allclose(ema_calibrate(prev, jnp.asarray(x), 0.99),
                             0.99 * prev + 0.01 * np.max(np.abs(x)), rtol=1e-6)
  prev_c = np.ones(5, np.float32)
  np.testing.assert_allclose(ema_calibrate(prev_c, jnp.asarray(x), 0.5, axis=0),
                             0.5 + 0.5 * np.max(np.abs(x), axis=1), rtol=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(bits=1), "bits=1 must be an int in 2..16"),
    (dict(bits=17), "bits=17"),
    (dict(bits=8.0), "bits=8.0"),
    (dict(bits=True), "bits=True"),
    (dict(axis=2), r"axis=2 is out of range .* valid axes are None and -2..1"),
    (dict(scale=-1.0), "must be positive"),
    (dict(scale=0.0), "must be positive"),
    (dict(scale=jnp.ones(3), axis=0), r"scale has shape \(3,\); valid shapes are \(\) and \(4,\)"),
    (dict(zero_point=3), "zero_point=3 is only used with symmetric=False"),
    (dict(symmetric=False, scale=0.1), "needs its zero_point"),
])
def test_fake_quant_rejects_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    fake_quant(jnp.ones((4, 5)), **kwargs)


def test_other_bad_arguments():
  with pytest.raises(TypeError, match="axis='a'"):
    fake_quant(jnp.ones(3), axis="a")
  with pytest.raises(ValueError, match=r"dtype=.*float16.* valid dtypes are \['float8_e4m3fn'"):
    fake_quant_fp8(jnp.ones(3), jnp.float16)
  with pytest.raises(ValueError, match="scale=.*must be positive"):
    fake_quant_fp8(jnp.ones(3), scale=-2.0)
  with pytest.raises(ValueError, match=r"method='mean' is not known; valid methods are \('max'"):
    calibrate(jnp.ones(3), "mean")
  with pytest.raises(ValueError, match="percentile=0"):
    calibrate(jnp.ones(3), "percentile", percentile=0)
  with pytest.raises(ValueError, match="decay=1.5 must be in"):
    ema_calibrate(1.0, jnp.ones(3), 1.5)
  with pytest.raises(ValueError, match=r"prev_scale has shape \(2,\)"):
    ema_calibrate(jnp.ones(2), jnp.ones((3, 4)), 0.9)

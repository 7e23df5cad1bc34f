r"""Dynamic tree code maps (Dettmers et al., *8-bit Optimizers via Block-wise Quantization*,
2022): 8-bit codes for values normalized to [-1, 1] by their block's absolute maximum.

A code's magnitude bits ``m`` (7 for the signed map, 8 for the unsigned one; ``M = 2^K - 1``
is the largest) read as the paper's dynamic tree: the position of the highest set bit,
``k``, picks the decade and the bits below it a linear fraction inside it,

.. math::
  \mathrm{mag}(m) = 10^{-(K-1-k)}\left(0.1 + 0.9\,\frac{j + 1/2}{2^k}\right),
  \qquad m = 2^k + j,\ 0 \le j < 2^k,

with ``mag(0) = 0`` and ``mag(M) = 1`` (the block's absmax is exact, as bitsandbytes' map
has it). The signed map stores ``sign(x) * m`` in an ``int8`` (``K = 7``: seven decades down
to 1e-7); the unsigned map stores ``m`` in a ``uint8`` (``K = 8``: eight decades, for the
second moment). Small magnitudes get fine steps, large ones coarse steps: the relative error
is about the same everywhere.

Decoding and encoding are arithmetic, not table lookups, so the same jnp functions run in the
Pallas kernels (which cannot gather from a table) and in the reference. Encoding is the
nearest code: the decade from comparisons with powers of ten, the fraction by rounding
down, then the nearer of that code and its neighbour (ties keep the smaller magnitude).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

SIGNED_BITS = 7  # magnitude bits of the signed map (one more bit is the sign)
UNSIGNED_BITS = 8


def _pow10_neg(e: jax.Array, bits: int) -> jax.Array:
  """``10^-e`` for integer ``e`` in ``[0, bits)``, from exact float32 constants."""
  out = jnp.ones(e.shape, jnp.float32)
  for d in range(1, bits):
    out = jnp.where(e == d, jnp.float32(10.0**-d), out)
  return out


def _pow10(e: jax.Array, bits: int) -> jax.Array:
  out = jnp.ones(e.shape, jnp.float32)
  for d in range(1, bits):
    out = jnp.where(e == d, jnp.float32(10.0**d), out)
  return out


def _magnitude(j: jax.Array, p: jax.Array, e: jax.Array, bits: int) -> jax.Array:
  """``10^-e (0.1 + 0.9 (j + 1/2) / p)``: the one expression both coders use, so the
  encoder's candidate values are bit for bit what the decoder returns."""
  frac = jnp.float32(0.1) + jnp.float32(0.9) * ((j.astype(jnp.float32) + 0.5) /
                                                p.astype(jnp.float32))
  return _pow10_neg(e, bits) * frac


def decode_magnitude(m: jax.Array, bits: int) -> jax.Array:
  """The float32 magnitude in [0, 1] of integer magnitude codes ``m`` (``int32``)."""
  k = jnp.zeros(m.shape, jnp.int32)
  for t in range(1, bits):
    k = k + (m >= (1 << t)).astype(jnp.int32)
  p = jnp.left_shift(jnp.ones(m.shape, jnp.int32), k)
  val = _magnitude(m - p, p, bits - 1 - k, bits)
  val = jnp.where(m == (1 << bits) - 1, jnp.float32(1.0), val)
  return jnp.where(m == 0, jnp.float32(0.0), val)


def encode_magnitude(a: jax.Array, bits: int) -> jax.Array:
  """The nearest magnitude code (``int32`` in ``[0, 2^bits)``) of ``a`` in [0, 1].

  The decade ``e`` counts the thresholds ``10^-d`` that ``a`` lies below (no logarithm);
  the fraction rounds down to a candidate code ``m0`` of that decade, whose value is
  computed in place; the one neighbour on ``a``'s side of it is decoded, and the nearer of
  the two wins."""
  top = (1 << bits) - 1
  a = a.astype(jnp.float32)
  e = jnp.zeros(a.shape, jnp.int32)
  up = jnp.ones(a.shape, jnp.float32)  # 10^e
  for d in range(1, bits):
    below = a < jnp.float32(10.0**-d)
    e = e + below.astype(jnp.int32)
    up = jnp.where(below, jnp.float32(10.0**d), up)
  k = bits - 1 - e
  p = jnp.left_shift(jnp.ones(a.shape, jnp.int32), k)
  pf = p.astype(jnp.float32)
  j = jnp.floor((a * up - jnp.float32(0.1)) / jnp.float32(0.9) * pf)
  j = jnp.clip(j, 0, pf - 1).astype(jnp.int32)
  m0 = p + j
  v0 = jnp.where(m0 == top, jnp.float32(1.0), _magnitude(j, p, e, bits))
  m1 = jnp.where(a >= v0, jnp.minimum(m0 + 1, top), jnp.maximum(m0 - 1, 0))
  v1 = decode_magnitude(m1, bits)
  d0, d1 = jnp.abs(a - v0), jnp.abs(a - v1)
  return jnp.where((d1 < d0) | ((d1 == d0) & (m1 < m0)), m1, m0)


def encode_signed(x: jax.Array) -> jax.Array:
  """``int8`` codes of ``x`` in [-1, 1] on the signed map."""
  m = encode_magnitude(jnp.abs(x), SIGNED_BITS)
  return jnp.where(x < 0, -m, m).astype(jnp.int8)


def decode_signed(c: jax.Array) -> jax.Array:
  c = c.astype(jnp.int32)
  mag = decode_magnitude(jnp.abs(c), SIGNED_BITS)
  return jnp.where(c < 0, -mag, mag)


def encode_unsigned(x: jax.Array) -> jax.Array:
  """``uint8`` codes of ``x`` in [0, 1] on the unsigned map."""
  return encode_magnitude(x, UNSIGNED_BITS).astype(jnp.uint8)


def decode_unsigned(c: jax.Array) -> jax.Array:
  return decode_magnitude(c.astype(jnp.int32), UNSIGNED_BITS)


def code_map(signed: bool) -> np.ndarray:
  """The map's values as a sorted float32 table (for inspection and plots): 255 distinct
  values for the signed map (codes -127..127), 256 for the unsigned map.

  >>> from optirs_jax.quantization import code_map
  >>> t = code_map(signed=False)
  >>> len(t), float(t[0]), float(t[-1])
  (256, 0.0, 1.0)
  """
  if signed:
    codes = jnp.arange(-127, 128, dtype=jnp.int32)
    return np.asarray(decode_signed(codes))
  return np.asarray(decode_unsigned(jnp.arange(256, dtype=jnp.int32)))

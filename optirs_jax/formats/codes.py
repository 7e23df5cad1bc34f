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

The map is defined by that arithmetic (:func:`decode_magnitude`); the coders use it as a
table of its ``2^K`` magnitudes (:func:`magnitude_table`), which is how bitsandbytes runs it
too: decoding is one lookup, encoding a binary search for the largest magnitude not above
the value (``K`` lookups and compares), then the nearer of it and the next one (ties keep
the smaller magnitude). The same jnp functions run in the reference (the table an array)
and in the Pallas kernels (the table a ``Ref``, each lookup a gather from it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

SIGNED_BITS = 7  # magnitude bits of the signed map (one more bit is the sign)
UNSIGNED_BITS = 8


@functools.lru_cache
def _magnitudes(bits: int) -> np.ndarray:
  m = np.arange(1 << bits)
  k = np.array([max(int(v).bit_length() - 1, 0) for v in m])  # the highest set bit
  p = 2.0**k
  val = 10.0 ** -(bits - 1 - k) * (0.1 + 0.9 * (m - p + 0.5) / p)
  val[0], val[-1] = 0.0, 1.0
  return val.astype(np.float32)


def magnitude_table(bits: int) -> jax.Array:
  """The ``2^bits`` magnitudes of the map indexed by their code (increasing), each the
  formula above in float64 rounded once to float32: a constant, the same in every program.

  >>> from optirs_jax.formats.codes import magnitude_table
  >>> t = magnitude_table(8)
  >>> t.shape, [round(float(v), 10) for v in t[:2]], float(t[-1])
  ((256,), [0.0, 5.5e-08], 1.0)
  """
  return jnp.asarray(_magnitudes(bits))


def _lookup(table, idx: jax.Array) -> jax.Array:
  """``table[idx]``: a gather from an array, or a load from a kernel's ``Ref``; where the
  indices are sharded on an Explicit mesh, the values are sharded as they are."""
  sharding = getattr(jax.typeof(idx), "sharding", None)
  spec = getattr(sharding, "spec", ())
  if any(s is not None for s in spec):
    return table.at[idx].get(out_sharding=sharding)
  return table[idx]


def encode_magnitude(a: jax.Array, bits: int, table=None) -> jax.Array:
  """The nearest magnitude code (``int32`` in ``[0, 2^bits)``) of ``a`` in [0, 1].

  A binary search of ``table`` (:func:`magnitude_table`, or a Pallas ``Ref`` holding it)
  finds ``m0``, the largest code whose magnitude is at most ``a``; of ``m0`` and ``m0 + 1``
  the nearer wins, the smaller on a tie. ``a`` below 0 or NaN gives 0."""
  table = magnitude_table(bits) if table is None else table
  top = (1 << bits) - 1
  a = a.astype(jnp.float32)
  # The first probe is one scalar, the same for every element: a lookup at a broadcast index
  # would be a constant XLA folds into a leaf-sized literal (minutes of compile on a
  # billion-parameter model).
  half = 1 << (bits - 1)
  m0 = jnp.where(table[half] <= a, half, 0).astype(jnp.int32)  # (sharded as a)
  for step in (1 << t for t in reversed(range(bits - 1))):
    cand = m0 + step
    m0 = jnp.where(_lookup(table, cand) <= a, cand, m0)
  m1 = jnp.minimum(m0 + 1, top)
  return jnp.where(_lookup(table, m1) - a < a - _lookup(table, m0), m1, m0)


def encode_signed(x: jax.Array, table=None) -> jax.Array:
  """``int8`` codes of ``x`` in [-1, 1] on the signed map (``table``: its magnitudes)."""
  m = encode_magnitude(jnp.abs(x), SIGNED_BITS, table)
  return jnp.where(x < 0, -m, m).astype(jnp.int8)


def decode_signed(c: jax.Array, table=None) -> jax.Array:
  table = magnitude_table(SIGNED_BITS) if table is None else table
  c = c.astype(jnp.int32)
  mag = _lookup(table, jnp.abs(c))
  return jnp.where(c < 0, -mag, mag)


def encode_unsigned(x: jax.Array, table=None) -> jax.Array:
  """``uint8`` codes of ``x`` in [0, 1] on the unsigned map (``table``: its magnitudes)."""
  return encode_magnitude(x, UNSIGNED_BITS, table).astype(jnp.uint8)


def decode_unsigned(c: jax.Array, table=None) -> jax.Array:
  table = magnitude_table(UNSIGNED_BITS) if table is None else table
  return _lookup(table, c.astype(jnp.int32))


def code_map(signed: bool) -> np.ndarray:
  """The map's values as a sorted float32 table (for inspection and plots): 255 distinct
  values for the signed map (codes -127..127), 256 for the unsigned map.

  >>> from optirs_jax.quantization import code_map
  >>> t = code_map(signed=False)
  >>> len(t), float(t[0]), float(t[-1])
  (256, 0.0, 1.0)
  """
  if signed:
    mags = np.asarray(magnitude_table(SIGNED_BITS))
    return np.concatenate([-mags[:0:-1], mags])
  return np.asarray(magnitude_table(UNSIGNED_BITS))

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
table (:func:`coder_table`). Decoding is one lookup of the code's magnitude, as
bitsandbytes does it. Encoding picks the nearest magnitude (the smaller on a tie), which is
bitsandbytes' binary search (``K`` dependent lookups) in two lookups instead. Between two
neighbouring magnitudes ``t_c < t_{c+1}`` the test "``t_{c+1} - a < a - t_c``" (float32
arithmetic, monotone in ``a``) turns true at one float32, the threshold ``θ_c``; so the code
of ``a`` is the number of thresholds at most ``a``. The float32 range down to ``θ_0`` is cut
into buckets by the exponent and the top mantissa bits of ``a`` (6 for the signed map, 7 for
the unsigned one), so fine that no bucket holds more than one threshold; the table holds
each bucket's code at its lower end. Then

.. math::
  \mathrm{code}(a) = b + [\theta_b \le a], \qquad b = \mathrm{bucket\_code}(\text{bits of } a),

the same code as the search for every float32. The same jnp functions run in the reference
(the table an array) and in the Pallas kernels (the table a ``Ref``, each lookup a gather
from it).

The coders can also compute what they look up (``coder``, as
``ExecutorOptions.dynamic_map_coder`` names them: ``"table"``, ``"arithmetic-decode"``,
``"arithmetic"``; the same codes and values either way, a question of speed only). With
``k`` the highest bit of ``m`` the magnitude is ``C_k N``, with ``N = 18 m - 16 \cdot 2^k
+ 9`` an integer below ``2^12`` and ``C_k = 10^{-(K-k)} / 2^{k+1}``; split as ``hi_k +
lo_k``, ``hi_k`` its 12 leading bits, ``hi_k N`` is exact and ``hi_k N + lo_k N`` rounds
once, to the table's float32 for every code of both maps, whether or not a compiler fuses
it into an fma. ``"arithmetic-decode"`` decodes so (two loads from ``K`` pairs of
constants instead of one from ``2^K`` magnitudes); ``"arithmetic"`` also tests the
threshold as its definition does, ``t_{b+1} - a < a - t_b`` on the two magnitudes decoded
so, instead of loading ``θ_b``.
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


_FINE_BITS = {SIGNED_BITS: 6, UNSIGNED_BITS: 7}  # mantissa bits of a bucket


@functools.lru_cache
def _thresholds(bits: int) -> np.ndarray:
  """``θ_c``: the least float32 ``a`` in ``(t_c, t_{c+1}]`` where ``t_{c+1} - a < a - t_c``
  in float32 (a bisection over the floats' bit patterns), then NaN for the top code (no
  float is at least it, infinity included: the encoder needs no clamp above)."""
  t = _magnitudes(bits)
  lo = t[:-1].view(np.int32).astype(np.int64)  # the test is false here ...
  hi = t[1:].view(np.int32).astype(np.int64)   # ... and true here
  while np.any(hi - lo > 1):
    mid = (lo + hi) // 2
    a = mid.astype(np.int32).view(np.float32)
    up = (t[1:] - a) < (a - t[:-1])
    lo, hi = np.where(up, lo, mid), np.where(up, mid, hi)
  return np.append(hi.astype(np.int32).view(np.float32), np.float32(np.nan))


@functools.lru_cache
def _bucket_grid(bits: int) -> tuple[int, int, int]:
  """``(fine, e_min, n)``: buckets of ``fine`` mantissa bits over the binades from
  ``2^e_min`` (below ``θ_0``) up to 1, ``n`` of them with the one starting at 1."""
  fine = _FINE_BITS[bits]
  e_min = int(np.floor(np.log2(_thresholds(bits)[0])))
  return fine, e_min, (-e_min << fine) + 1


@functools.lru_cache
def _bucket_codes(bits: int) -> np.ndarray:
  """Each bucket's code at its lower end; checks that no bucket holds two thresholds."""
  fine, e_min, n = _bucket_grid(bits)
  theta = _thresholds(bits)[:-1]
  first = np.arange(n + 1, dtype=np.int64) + ((127 + e_min) << fine)
  lo = (first << (23 - fine)).astype(np.int32).view(np.float32)
  codes = np.searchsorted(theta, lo, side="right")  # thresholds at most each lower end
  inside = np.searchsorted(theta, lo[1:], side="left") - codes[:-1]
  if lo[0] >= theta[0] or inside[:-1].max() > 1:
    raise AssertionError(f"the {bits}-bit map's buckets are too coarse")
  return codes[:-1].astype(np.float32)


@functools.lru_cache
def _decades(bits: int) -> np.ndarray:
  """Per decade ``k``, ``C_k = 10^-(K-k) / 2^(k+1)`` as ``hi_k + lo_k``, ``hi_k`` its 12
  leading bits: the ``K`` values of ``hi``, then the ``K`` of ``lo`` (float32)."""
  k = np.arange(bits)
  c = 10.0 ** -(bits - k) / 2.0 ** (k + 1)
  step = 2.0 ** (np.floor(np.log2(c)) - 11)
  hi = np.round(c / step) * step
  return np.concatenate([hi, c - hi]).astype(np.float32)


def coder_table(bits: int) -> jax.Array:
  """The coders' constant table of the ``2^bits`` map: its magnitudes by code
  (:func:`magnitude_table`), the thresholds ``θ_c`` (NaN after the last), each
  bucket's code, then the decades' constants ``hi_k`` and ``lo_k``, all float32
  (``2^(bits+1)`` + 1423 values for the signed map, + 3345 for the unsigned one).

  >>> from optirs_jax.formats.codes import coder_table, encode_magnitude
  >>> import jax.numpy as jnp
  >>> coder_table(8).shape
  (3857,)
  >>> encode_magnitude(jnp.array([0.0, 5.5e-08, 1.0, 0.5]), 8).tolist()
  [0, 1, 255, 184]
  """
  return jnp.asarray(_coder_values(bits))


@functools.lru_cache
def _coder_values(bits: int) -> np.ndarray:
  return np.concatenate([_magnitudes(bits), _thresholds(bits), _bucket_codes(bits),
                         _decades(bits)])


def coder_table_size(bits: int) -> int:
  """The length of :func:`coder_table` (no array built)."""
  return len(_coder_values(bits))


def _lookup(table, idx: jax.Array) -> jax.Array:
  """``table[idx]``: a gather from an array, or a load from a kernel's ``Ref``; where the
  indices are sharded on an Explicit mesh, the values are sharded as they are."""
  sharding = getattr(jax.typeof(idx), "sharding", None)
  spec = getattr(sharding, "spec", ())
  if any(s is not None for s in spec):
    return table.at[idx].get(out_sharding=sharding)
  return table[idx]


def decode_magnitude(m: jax.Array, bits: int, table=None, coder: str = "table") -> jax.Array:
  """The magnitude of code ``m`` (``int32`` in ``[0, 2^bits)``): one lookup in the
  magnitudes, or (``coder`` not ``"table"``) ``hi_k N + lo_k N`` from the decades'
  constants. ``table``: :func:`coder_table` or a ``Ref`` holding it.

  >>> from optirs_jax.formats.codes import decode_magnitude, magnitude_table
  >>> import jax.numpy as jnp
  >>> m = jnp.arange(256)
  >>> bool((decode_magnitude(m, 8, coder="arithmetic") == magnitude_table(8)).all())
  True
  """
  table = coder_table(bits) if table is None else table
  if coder == "table":
    return _lookup(table, m)
  top = (1 << bits) - 1
  base = (2 << bits) + _bucket_grid(bits)[2]  # the decades' constants
  k = (jax.lax.bitcast_convert_type(m.astype(jnp.float32), jnp.int32) >> 23) - 127
  k = jnp.clip(k, 0, bits - 1)  # the highest set bit (m = 0 gives 0 below)
  n = (18 * m - 16 * jnp.left_shift(jnp.int32(1), k) + 9).astype(jnp.float32)
  mag = _lookup(table, base + k) * n + _lookup(table, base + bits + k) * n
  return jnp.where(m == 0, jnp.float32(0), jnp.where(m == top, jnp.float32(1), mag))


def encode_magnitude(a: jax.Array, bits: int, table=None, coder: str = "table") -> jax.Array:
  """The nearest magnitude code (``int32`` in ``[0, 2^bits)``) of ``a`` in [0, 1]: of the
  largest magnitude at most ``a`` and the next one, the nearer, the smaller on a tie; ``a``
  below 0 or NaN gives 0, above 1 the top code. ``table``: :func:`coder_table` (or a
  Pallas ``Ref`` holding it); two lookups, the second indexed by the first (with
  ``coder="arithmetic"``, the bucket's code, then the threshold's test on two magnitudes
  decoded by arithmetic)."""
  table = coder_table(bits) if table is None else table
  fine, e_min, n = _bucket_grid(bits)
  top = (1 << bits) - 1
  a = a.astype(jnp.float32)
  b = (jax.lax.bitcast_convert_type(a, jnp.int32) >> (23 - fine)) - ((127 + e_min) << fine)
  b = jnp.where(a >= 0, jnp.clip(b, 0, n - 1), 0)  # (negatives and NaN: bucket 0, code 0)
  code = _lookup(table, b + (2 << bits)).astype(jnp.int32)
  if coder == "arithmetic":
    low = decode_magnitude(code, bits, table, coder)
    high = decode_magnitude(jnp.minimum(code + 1, top), bits, table, coder)
    above = (high - a < a - low) & (code < top)
    return code + above.astype(jnp.int32)
  above = _lookup(table, code + (1 << bits)) <= a  # false at the top code: θ is NaN there
  return code + above.astype(jnp.int32)


def encode_signed(x: jax.Array, table=None, coder: str = "table") -> jax.Array:
  """``int8`` codes of ``x`` in [-1, 1] on the signed map (``table``: its
  :func:`coder_table`)."""
  m = encode_magnitude(jnp.abs(x), SIGNED_BITS, table, coder)
  return jnp.where(x < 0, -m, m).astype(jnp.int8)


def decode_signed(c: jax.Array, table=None, coder: str = "table") -> jax.Array:
  """The values of ``int8`` codes on the signed map (``table``: its :func:`coder_table`,
  or with ``coder="table"`` its :func:`magnitude_table`)."""
  if table is None:
    table = magnitude_table(SIGNED_BITS) if coder == "table" else coder_table(SIGNED_BITS)
  c = c.astype(jnp.int32)
  mag = decode_magnitude(jnp.abs(c), SIGNED_BITS, table, coder)
  return jnp.where(c < 0, -mag, mag)


def encode_unsigned(x: jax.Array, table=None, coder: str = "table") -> jax.Array:
  """``uint8`` codes of ``x`` in [0, 1] on the unsigned map (``table``: its
  :func:`coder_table`)."""
  return encode_magnitude(x, UNSIGNED_BITS, table, coder).astype(jnp.uint8)


def decode_unsigned(c: jax.Array, table=None, coder: str = "table") -> jax.Array:
  """The values of ``uint8`` codes on the unsigned map (``table`` as
  :func:`decode_signed`'s)."""
  if table is None:
    table = magnitude_table(UNSIGNED_BITS) if coder == "table" else coder_table(UNSIGNED_BITS)
  return decode_magnitude(c.astype(jnp.int32), UNSIGNED_BITS, table, coder)


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

"""Stochastic rounding to bfloat16, from counter-based random bits (jnp integer ops only).

A float32 ``x`` lies between two neighbouring bfloat16 values ``lo <= x < hi``; rounding it
up with probability ``(x - lo) / (hi - lo)`` makes the result equal ``x`` in expectation,
so many updates smaller than half a bfloat16 step still move a bfloat16 value on average
(round-to-nearest drops each of them). The rounding adds 16 random bits below bfloat16's
mantissa and truncates: ``bits(x) + r`` carries into the kept bits with exactly that
probability when ``r`` is uniform on ``[0, 2^16)``.

The random bits are a hash of the seed, the step count, which output is rounded, and the
element's index in its leaf: deterministic for a given seed, different at every step and
element, and the same on every executor (the jnp reference, the grouped kernel, a kernel
in place), since each computes them from the same integers. The hash is Wellons'
``lowbias32`` (a 32-bit integer finalizer with low bias), applied three times.

>>> import jax.numpy as jnp
>>> x = jnp.full((4096,), 1.0 + 2.0**-10, jnp.float32)  # 1/8 of a bf16 step above 1.0
>>> y = stochastic_round(x, jnp.bfloat16, seed=0, count=1)
>>> sorted(set(y.astype(float).tolist()))
[1.0, 1.0078125]
>>> abs(float(jnp.mean(y.astype(jnp.float32))) - (1.0 + 2.0**-10)) < 2e-4
True
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _lowbias32(x: jax.Array) -> jax.Array:
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def split16(value) -> tuple[jax.Array, jax.Array]:
  """A non-negative 32-bit integer as its low and high 16 bits in float32 (both exact), the
  form the seed and the count travel in through a kernel's float32 scalars."""
  v = jnp.asarray(value).astype(jnp.uint32)
  return (v & 0xFFFF).astype(jnp.float32), (v >> 16).astype(jnp.float32)


def _join16(lo, hi) -> jax.Array:
  return jnp.asarray(hi).astype(jnp.uint32) << 16 | jnp.asarray(lo).astype(jnp.uint32)


def random_bits(key, salt: int, index: jax.Array) -> jax.Array:
  """``uint32`` random bits per element from ``key`` (the seed and the step count, each as
  :func:`split16` halves), an output's static ``salt`` and the elements' indices."""
  seed_lo, seed_hi, count_lo, count_hi = key
  k = _lowbias32(_join16(seed_lo, seed_hi) ^ jnp.uint32((salt * 0x9E3779B9) & 0xFFFFFFFF))
  k = _lowbias32(k ^ _join16(count_lo, count_hi))
  return _lowbias32(_lowbias32(index.astype(jnp.uint32) ^ k) + k)


def round_with_key(x: jax.Array, dtype, key, salt: int, index: jax.Array) -> jax.Array:
  """:func:`stochastic_round` with the seed and count given as :func:`split16` halves."""
  dtype = jnp.dtype(dtype)
  if dtype != jnp.dtype(jnp.bfloat16) or jnp.dtype(x.dtype) == dtype:
    return x.astype(dtype)
  x = x.astype(jnp.float32)
  r = random_bits(key, salt, index) >> 16
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  up = jax.lax.bitcast_convert_type((bits + r) & jnp.uint32(0xFFFF0000), jnp.float32)
  return jnp.where(jnp.isfinite(x), up, x).astype(dtype)


def stochastic_round(x: jax.Array, dtype, *, seed, count, salt: int = 0,
                     index: jax.Array | None = None) -> jax.Array:
  """``x`` cast to ``dtype``: stochastically to bfloat16, to nearest otherwise.

  Args:
    x: the values (computed in float32 or wider).
    dtype: the target dtype.
    seed, count: non-negative 32-bit integers (Python or traced): the run's seed and the
      step count.
    salt: a static integer telling apart several roundings in one step.
    index: each element's index in its leaf (default: its position in ``x``).
  """
  if index is None:
    index = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
  return round_with_key(x, dtype, (*split16(seed), *split16(count)), salt, index)

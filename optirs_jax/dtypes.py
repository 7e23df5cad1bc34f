"""Dtype helpers that hold whatever ``jax_numpy_dtype_promotion`` is set to."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def widened(dtype):
  """``dtype`` widened to at least float32: float16/bfloat16 -> float32; float32, float64 and
  complex dtypes unchanged (what standard promotion with float32 gives).

  >>> widened(jnp.bfloat16), widened(jnp.complex64)
  (dtype('float32'), dtype('complex64'))
  """
  with jax.numpy_dtype_promotion("standard"):
    return jnp.promote_types(dtype, jnp.float32)


def common(*arrays_or_dtypes):
  """The dtype standard promotion gives these arrays (weak Python scalars included)."""
  with jax.numpy_dtype_promotion("standard"):
    return jnp.result_type(*arrays_or_dtypes)

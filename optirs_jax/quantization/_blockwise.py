"""Block-wise 8-bit arrays: one code per element, one float32 absmax per block."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from optirs_jax.quantization import _codes


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Quantized8bit:
  """An array stored as 8-bit codes on a dynamic map, one float32 scale per block.

  ``codes`` is ``int8`` (signed map) or ``uint8`` (unsigned map) of shape
  ``[num_blocks, block_size]`` (the flattened array, zero-padded to whole blocks);
  ``absmax`` is ``float32[num_blocks]``; ``shape`` is the array's shape. The value of element
  ``i`` is ``decode(codes[i]) * absmax[block of i]``.
  """

  codes: jax.Array
  absmax: jax.Array
  shape: tuple = dataclasses.field(metadata=dict(static=True))

  @property
  def signed(self) -> bool:
    return self.codes.dtype == jnp.int8

  @property
  def block_size(self) -> int:
    return self.codes.shape[-1]

  @property
  def nbytes(self) -> int:
    return self.codes.size * self.codes.dtype.itemsize + self.absmax.size * 4

  def dequantize(self) -> jax.Array:
    """The float32 array these codes stand for."""
    return dequantize_blocks(self.codes, self.absmax[:, None]).reshape(-1)[
        :math.prod(self.shape)].reshape(self.shape)


def as_blocks(x: jax.Array, block_size: int) -> jax.Array:
  """``x`` flattened and zero-padded to ``[num_blocks, block_size]`` (a free reshape when the
  size is a multiple of the block)."""
  n = x.size
  nb = -(-n // block_size)
  flat = x.reshape(-1)
  if nb * block_size != n:
    flat = jnp.pad(flat, (0, nb * block_size - n))
  return flat.reshape(nb, block_size)


def quantize_blocks(x: jax.Array, signed: bool) -> tuple[jax.Array, jax.Array]:
  """``(codes, absmax[:, None])`` of float32 blocks ``x`` (``[rows, block_size]``)."""
  absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  safe = jnp.where(absmax > 0, absmax, jnp.float32(1.0))
  a = x / safe
  codes = _codes.encode_signed(a) if signed else _codes.encode_unsigned(a)
  return codes, absmax


def dequantize_blocks(codes: jax.Array, absmax: jax.Array) -> jax.Array:
  """float32 values of ``codes`` (``[rows, block_size]``) with ``absmax`` (``[rows, 1]``)."""
  mag = _codes.decode_signed(codes) if codes.dtype == jnp.int8 else _codes.decode_unsigned(codes)
  return mag * absmax


def quantize_blockwise(x: jax.Array, *, signed: bool = True, block_size: int = 256
                       ) -> Quantized8bit:
  """``x`` as :class:`Quantized8bit`: each block of ``block_size`` elements (row-major) is
  divided by its absolute maximum and each element stored as the nearest code of the signed
  (``int8``) or unsigned (``uint8``, for non-negative ``x``) dynamic map.

  >>> import jax.numpy as jnp
  >>> from optirs_jax.quantization import quantize_blockwise
  >>> q = quantize_blockwise(jnp.array([0.5, -1.0, 0.001, 0.0]), block_size=4)
  >>> q.codes.dtype, q.absmax
  (dtype('int8'), Array([1.], dtype=float32))
  >>> [round(v, 4) for v in q.dequantize().tolist()]
  [0.5008, -1.0, 0.0009, 0.0]
  """
  codes, absmax = quantize_blocks(as_blocks(jnp.asarray(x, jnp.float32), block_size), signed)
  return Quantized8bit(codes, absmax[:, 0], tuple(x.shape))

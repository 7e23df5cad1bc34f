"""Block-wise 8-bit arrays: one code per element, one float32 absmax per block of a row.

Two formats (``STATE_QUANTIZATIONS``): ``"dynamic8"``, the codes of Dettmers et al.'s
dynamic tree maps (:mod:`~optirs_jax.formats.codes`: ``int8`` for signed arrays,
``uint8`` for non-negative ones), and ``"fp8"``, each element normalized by its block's
absmax and stored as ``float8_e4m3fn`` times 448 (its largest finite value; decoded as the code
times ``float32(1 / 448)`` times the absmax), torchao's ``AdamWFp8`` format; one hardware
conversion each way on GPUs of compute capability 8.9 or newer. Either format normalizes
an element ``x`` as ``a = x * float32(1 / absmax)``: one division per block and a product
per element (a division per element cost the 8-bit AdamW kernel 5% of its time on an
H100); ``|a|`` may exceed 1 by an ulp, which both formats take as 1. A block whose absmax
is below float32's smallest normal number (2^-126, whose reciprocal may overflow) keeps
its absmax and stores zero codes, as a platform flushing subnormals to zero (XLA's CPU
backend) stores it.

The blocks run along the last axis: block ``j`` of a row holds its elements
``[j * block_size, (j + 1) * block_size)`` (the last block of a row may be shorter). So the
codes have the array's own shape, and the scales the shape of its leading axes and one
more, the blocks of a row: both shard as the array does (a block never straddles a shard
when each shard's part of the last axis is a whole number of blocks), and the state is a
plain NamedTuple of two arrays, which Flax NNX, ``flax.serialization``, orbax and pickle
take as they take optax's states.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optirs_jax.formats import codes as _codes

STATE_QUANTIZATIONS = ("dynamic8", "fp8")
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def check_format(fn: str, fmt) -> str:
  """``fmt`` if it is one of :data:`STATE_QUANTIZATIONS`, else a ValueError naming it."""
  if fmt not in STATE_QUANTIZATIONS:
    raise ValueError(f"{fn}: state_quantization={fmt!r} is not one of {STATE_QUANTIZATIONS}")
  return fmt


def format_of(codes) -> str:
  """The format of ``codes`` by their dtype."""
  return "fp8" if codes.dtype == FP8 else "dynamic8"


def num_blocks(last: int, block_size: int) -> int:
  """Blocks of ``block_size`` in a row of ``last`` elements (at least one)."""
  return max(1, -(-last // block_size))


class Quantized8bit(NamedTuple):
  """An array stored as 8-bit codes on a dynamic map, one float32 scale per block; or a tree
  of them, as two trees.

  ``codes`` has the array's shape, ``int8`` (the signed map) or ``uint8`` (the unsigned
  map, for non-negative arrays), or ``float8_e4m3fn`` (the ``"fp8"`` format); ``absmax``
  is ``float32`` of shape ``shape[:-1] + (num_blocks,)``, the blocks running along the last
  axis. The value of element ``[..., i]`` is ``decode(codes[..., i]) * absmax[..., i //
  block_size]``, with ``decode(c) = float32(c) * float32(1 / 448)`` for fp8 codes.

  An optimizer's moment is one of two trees shaped like the params (``codes``, and
  ``absmax`` with ``optax.MaskedNode()`` where a leaf is kept in float32, its ``codes``
  leaf then holding the values): every leaf a plain array, as Flax NNX and the
  checkpointers expect. :meth:`dequantize` and :attr:`nbytes` take either form.
  """

  codes: jax.Array
  absmax: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.codes.shape)

  @property
  def signed(self) -> bool:
    return self.codes.dtype == jnp.int8

  @property
  def block_size(self) -> int:
    """Elements per block along the last axis (a power of two; a row of one block is
    its own length)."""
    last, nb = self.codes.shape[-1], self.absmax.shape[-1]
    if nb == 1:
      return last
    return 1 << (-(-last // nb) - 1).bit_length()  # the power of two that gives nb blocks

  @property
  def nbytes(self) -> int:
    """Bytes held by the codes and scales (of every leaf, for trees)."""
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((self.codes, self.absmax)))

  def dequantize(self):
    """The float32 array these codes stand for (for trees, the tree of them)."""
    if not isinstance(self.codes, jax.Array | np.ndarray):
      masked = lambda x: isinstance(x, optax.MaskedNode)
      return jax.tree.map(
          lambda a, c: c if masked(a) else Quantized8bit(c, a).dequantize(), self.absmax,
          self.codes, is_leaf=masked)
    blocks = as_row_blocks(self.codes, self.block_size)
    return from_row_blocks(dequantize_blocks(blocks, self.absmax[..., None]), self.shape)


def as_row_blocks(x: jax.Array, block_size: int) -> jax.Array:
  """``x`` as ``[*leading, num_blocks, block_size]`` (the last axis zero-padded to whole
  blocks; a free reshape where it is a whole number of them)."""
  last = x.shape[-1]
  nb = num_blocks(last, block_size)
  width = min(block_size, last) if nb == 1 else block_size
  if nb * width != last:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * width - last)])
  return x.reshape(*x.shape[:-1], nb, width)


def from_row_blocks(blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """The inverse of :func:`as_row_blocks`: ``shape`` back from its blocks."""
  flat = blocks.reshape(*blocks.shape[:-2], -1)
  return flat if flat.shape[-1] == shape[-1] else flat[..., :shape[-1]]


def quantize_blocks(x: jax.Array, signed: bool, fmt: str = "dynamic8", table=None,
                    coder: str = "table") -> tuple[jax.Array, jax.Array]:
  """``(codes, absmax[..., None])`` of float32 blocks ``x`` (``[..., block_size]``):
  ``a = x * float32(1 / absmax)``, then the nearest code of the signed or unsigned dynamic
  map (``table``: the map's :func:`~optirs_jax.formats.codes.coder_table`, an array or a
  kernel's ``Ref``; None builds it; ``coder``: how the coder reads it, as
  ``ExecutorOptions.dynamic_map_coder`` names them), or ``float8_e4m3fn(a * 448)``
  (rounded to nearest even)."""
  absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  # A zero or subnormal absmax divides by 1: its elements are below every code but 0.
  safe = jnp.where(absmax >= jnp.finfo(jnp.float32).tiny, absmax, jnp.float32(1.0))
  a = x * (jnp.float32(1) / safe)  # one division per block, not per element
  if fmt == "fp8":
    return (a * jnp.float32(FP8_MAX)).astype(FP8), absmax
  encode = _codes.encode_signed if signed else _codes.encode_unsigned
  codes = encode(a, table, coder)
  return codes, absmax


def dequantize_blocks(codes: jax.Array, absmax: jax.Array, table=None,
                      coder: str = "table") -> jax.Array:
  """float32 values of ``codes`` (``[..., block_size]``) with ``absmax`` (``[..., 1]``);
  ``table`` and ``coder`` as :func:`quantize_blocks`'s."""
  if codes.dtype == FP8:  # a product, not a division: compilers keep it as written
    mag = codes.astype(jnp.float32) * jnp.float32(1 / FP8_MAX)
  elif codes.dtype == jnp.int8:
    mag = _codes.decode_signed(codes, table, coder)
  else:
    mag = _codes.decode_unsigned(codes, table, coder)
  return mag * absmax


def check_block_size(fn: str, block_size) -> int:
  """``block_size`` as an int: a power of two >= 2 (a concrete integer array is taken)."""
  try:
    value = int(block_size)
  except (TypeError, jax.errors.ConcretizationTypeError):
    value = None
  if (isinstance(block_size, bool) or value is None or value != block_size or value < 2
      or value & (value - 1)):
    raise ValueError(f"{fn}: block_size={block_size!r} must be a power of two >= 2 (a "
                     "concrete int: under optax.inject_hyperparams pass "
                     "static_args=('block_size',))")
  return value


def quantize_blockwise(x: jax.Array, *, signed: bool = True, block_size: int = 256,
                       state_quantization: str = "dynamic8") -> Quantized8bit:
  """``x`` as :class:`Quantized8bit`: each block of ``block_size`` elements along the last
  axis is divided by its absolute maximum and each element stored as the nearest code of
  the signed (``int8``) or unsigned (``uint8``, for non-negative ``x``) dynamic map; with
  ``state_quantization="fp8"``, as ``float8_e4m3fn`` of 448 times it (``signed`` unused).

  >>> import jax.numpy as jnp
  >>> from optirs_jax.quantization import quantize_blockwise
  >>> q = quantize_blockwise(jnp.array([0.5, -1.0, 0.001, 0.0]), block_size=4)
  >>> q.codes.dtype, q.absmax
  (dtype('int8'), Array([1.], dtype=float32))
  >>> [round(v, 4) for v in q.dequantize().tolist()]
  [0.5008, -1.0, 0.0009, 0.0]
  >>> q8 = quantize_blockwise(jnp.array([0.5, -1.0, 0.001, 0.0]), block_size=4,
  ...                         state_quantization="fp8")
  >>> q8.codes.dtype, [round(v, 4) for v in q8.dequantize().tolist()]
  (dtype(float8_e4m3fn), [0.5, -1.0, 0.001, 0.0])
  """
  bs = check_block_size("quantize_blockwise", block_size)
  x = jnp.asarray(x, jnp.float32)
  if x.ndim == 0 or x.size == 0:
    raise ValueError(f"quantize_blockwise: x has shape {x.shape}; it needs at least one axis "
                     "and one element")
  fmt = check_format("quantize_blockwise", state_quantization)
  codes, absmax = quantize_blocks(as_row_blocks(x, bs), signed, fmt)
  return Quantized8bit(from_row_blocks(codes, x.shape), absmax[..., 0])

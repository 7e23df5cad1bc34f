"""Optimizer state stored block-wise in 8 bits: any optimizer's fields, one option.

An optimizer built with ``state_quantization="dynamic8"`` or ``"fp8"`` keeps each state
field of a large float32 leaf as a :class:`~optirs_jax.formats.blockwise.Quantized8bit`
(one 8-bit code per element, one float32 absmax per block of ``quantization_block_size``
elements along the last axis): the dynamic tree map (signed for signed fields, unsigned for
the non-negative ones, ``Field.nonneg``) or ``float8_e4m3fn``. Each step decodes the fields,
runs the optimizer's own float32 step (reference or kernels) and encodes the new fields:

.. math::
  s_t = Q\big(f(g_t, D(s_{t-1}))\big)

with ``D``/``Q`` the format's decode and nearest-code encode. Where the rule's kernel runs
(a step traced for an NVIDIA GPU, or ``backend="pallas"``) and the rule has no per-leaf
norms, the leaves whose every field is quantized alike go through
:mod:`._quantized_kernel`, which does all three in one pass; the other leaves are decoded
here, stepped and encoded again (XLA drops the decodes nobody reads). Leaves under
``min_quantized_size`` elements, or not float32, keep their field as it is. A field is one
``Quantized8bit`` of two trees shaped like the params (``codes``, and ``absmax`` with
``optax.MaskedNode()`` where a leaf is kept), as ``optirs_jax.adam8bit``'s moments.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from optirs_jax.formats.blockwise import (
  Quantized8bit,
  as_row_blocks,
  check_block_size,
  check_format,
  format_of,
  quantize_blockwise,
)
from optirs_jax.transforms._checks import structural_int

BLOCK_SIZE = 256
MIN_SIZE = 4096


@dataclasses.dataclass(frozen=True)
class Quantization:
  """An optimizer's state format: ``fmt`` (``"dynamic8"`` or ``"fp8"``), the block size
  and the smallest leaf quantized (None when traced: only ``init`` reads them)."""

  fmt: str
  block_size: int | None
  min_size: int | None


def check(fn: str, arguments) -> Quantization | None:
  """The state format an optimizer's arguments ask for, or None (float state)."""
  fmt = arguments.get("state_quantization")
  if fmt is None:
    return None
  fmt = check_format(fn, fmt)
  bs = arguments.get("quantization_block_size", BLOCK_SIZE)
  if isinstance(bs, jax.core.Tracer):
    bs = None
  else:
    try:
      bs = check_block_size(fn, bs)
    except ValueError:
      raise ValueError(f"{fn}: quantization_block_size={bs!r} must be a power of two >= 2 (a "
                       "concrete int: under optax.inject_hyperparams pass static_args="
                       "('quantization_block_size',))") from None
  min_size = structural_int(fn, "min_quantized_size", arguments.get("min_quantized_size",
                                                                   MIN_SIZE), 0)
  return Quantization(fmt, bs, min_size)


def _masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def _is_quantized(x) -> bool:
  return isinstance(x, Quantized8bit)


def _encode(tree, plan, signed: bool) -> Quantized8bit:
  """``tree`` as a :class:`Quantized8bit` of two trees: each leaf with a ``(block size,
  format)`` in ``plan`` encoded (or taken as it is, where the kernel encoded it already), a
  leaf with None kept as it is."""
  leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_quantized)
  codes, scales = [], []
  for x, how in zip(leaves, plan):
    if how is None or _is_quantized(x):
      codes.append(x.codes if _is_quantized(x) else x)
      scales.append(x.absmax if _is_quantized(x) else optax.MaskedNode())
      continue
    c = quantize_blockwise(x, signed=signed, block_size=how[0], state_quantization=how[1])
    codes.append(c.codes)
    scales.append(c.absmax)
  return Quantized8bit(jax.tree.unflatten(treedef, codes), jax.tree.unflatten(treedef, scales))


class Fill:
  """A field's leaf at init, not made yet: ``like`` (the param it is shaped, and placed,
  as) and its dtype."""

  def __init__(self, like, dtype):
    self.like, self.dtype = like, dtype
    self.shape, self.ndim, self.size = like.shape, like.ndim, like.size


def _encode_constant(value, like, *, signed: bool, block_size: int, fmt: str) -> Quantized8bit:
  """A leaf shaped (and placed) as ``like`` whose every element is ``value``, encoded: one
  block encoded and its code and scale filled in. What encoding the whole leaf gives (every
  block alike), without a float32 copy of the leaf or the encoder's temporaries."""
  one = quantize_blockwise(jnp.full((block_size,), value, jnp.float32), signed=signed,
                           block_size=block_size, state_quantization=fmt)
  # The scales shaped and placed as the encoder's: each block's first element of the leaf.
  first = as_row_blocks(jnp.zeros_like(like, dtype=jnp.bool_), block_size)[..., 0]
  return Quantized8bit(jnp.full_like(like, one.codes[0], dtype=one.codes.dtype),
                       jnp.full_like(first, one.absmax[0], dtype=one.absmax.dtype))


def encode_fields(fn: str, state, fields, q: Quantization, values=None):
  """``state`` (fresh from init) with each field of ``fields`` quantized on its large float32
  leaves. ``values``: by name, the constant a field holds, whose leaves in ``state`` may be
  :class:`Fill` placeholders: the kept leaves are filled with it and the quantized ones
  encoded from it (no float32 copy of the field is made)."""
  if q.block_size is None or q.min_size is None:
    raise ValueError(f"{fn}: quantization_block_size and min_quantized_size must be concrete "
                     "at init (under optax.inject_hyperparams pass them in static_args)")
  eligible = lambda x: x.ndim >= 1 and x.size >= max(q.min_size, 1) and x.dtype == jnp.float32
  new = {}
  for f in fields:
    tree = getattr(state, f.name)
    if tree is None or f.per_leaf:
      continue
    plan = [(q.block_size, q.fmt) if eligible(x) else None for x in jax.tree.leaves(tree)]
    if values is not None and f.name in values:
      leaves, treedef = jax.tree.flatten(tree)
      v = values[f.name]
      tree = jax.tree.unflatten(treedef, [
          jnp.full_like(x.like, v, dtype=x.dtype) if how is None else _encode_constant(
              v, x.like, signed=not f.nonneg, block_size=how[0], fmt=how[1])
          for x, how in zip(leaves, plan)])
    new[f.name] = _encode(tree, plan, signed=not f.nonneg)
  return state._replace(**new)


def decode_fields(state, fields):
  """``(state with float fields, the quantized fields by name)``."""
  quantized = {f.name: getattr(state, f.name) for f in fields
               if isinstance(getattr(state, f.name), Quantized8bit)}
  return state._replace(**{k: q.dequantize() for k, q in quantized.items()}), quantized


def _plan_of(c, a):
  """A stored leaf's ``(block size, format)``, None where it is kept (a masked scale). A row
  of one block is its own length: any power of two that covers it."""
  if _masked(a):
    return None
  bs = (Quantized8bit(c, a).block_size if a.shape[-1] > 1
        else max(2, 1 << (c.shape[-1] - 1).bit_length()))
  return bs, format_of(c)


def kernel_fields(quantized, names, n: int) -> list | None:
  """Per leaf, the :class:`Quantized8bit` of each rule field of ``names`` where all of them
  are quantized in one format and block size (the kernel decodes and encodes them), else
  None; None for every leaf when a field is not quantized at all."""
  if not quantized or any(name not in quantized for name in names):
    return None
  columns = []
  for name in names:
    q = quantized[name]
    codes = jax.tree.leaves(q.codes)
    scales = jax.tree.leaves(q.absmax, is_leaf=_masked)
    if len(codes) != n or len(scales) != n:
      return None  # not the updates' structure: the float step names the mismatch
    columns.append([None if _masked(a) else Quantized8bit(c, a) for c, a in zip(codes, scales)])
  out = []
  for i in range(n):
    leaf = [col[i] for col in columns]
    plans = {None if x is None else _plan_of(x.codes, x.absmax) for x in leaf}
    out.append(leaf if len(plans) == 1 and None not in plans else None)
  return out


def reencode_fields(state, fields, quantized):
  """The step's new ``state`` with the fields that came in quantized encoded again, each
  leaf in its own format and block size (leaves the kernel encoded are taken as they
  are)."""
  new = {}
  for f in fields:
    if f.name in quantized:
      old = quantized[f.name]
      plan = [_plan_of(c, a) for c, a in zip(jax.tree.leaves(old.codes),
                                             jax.tree.leaves(old.absmax, is_leaf=_masked))]
      new[f.name] = _encode(getattr(state, f.name), plan, signed=not f.nonneg)
  return state._replace(**new)

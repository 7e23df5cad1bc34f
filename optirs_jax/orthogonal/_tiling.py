"""How a stack of matrices is laid out for a GPU's products: its long side padded, its
Gram product split to fill the cores, a kernel-written stack's layout."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

#: Stacks whose long side is above this are padded to a multiple of ``PAD`` once, before
#: the iteration: a product contracting over an unaligned axis pads its operand itself,
#: a pass over the stack in every step (GPT-2's 50257-entry vocabulary).
PAD_ABOVE, PAD = 4096, 128


def padded(long: int) -> int:
  """The fast form's long side: above 4096, padded to a multiple of 128."""
  return long + (-long % PAD if long > PAD_ABOVE else 0)


#: A Gram product whose output tiles (128 x 128) are fewer than ``_FEW_TILES``, one for each
#: of an H100's or H200's 132 cores, is split until the tiles of all its parts fill
#: ``_TILES`` (eight waves: a partial last wave then costs little; ``_TILES_16`` for 16-bit
#: stacks), while each part still contracts at least ``_MIN_SPLIT_ROWS`` rows.
_FEW_TILES, _TILES, _TILES_16, _TILE, _MIN_SPLIT_ROWS = 132, 1056, 264, 128, 1024


def gram_splits(batch: int, short: int, long: int, *, itemsize: int = 4) -> int:
  """How many parts the Gram product of ``batch`` matrices ``short x long`` (its output
  ``short x short``, contracting ``long``, elements of ``itemsize`` bytes) is split into
  along ``long``: one where the output has at least 132 tiles of 128 x 128; else a power
  of two, doubled while the tiles times the parts are fewer than 1056 (264 for 16-bit
  elements) and each part keeps at least 1024 of ``long`` (whole: ``long`` is a multiple
  of the parts).

  A GPU's matrix product runs one output tile per core at a time: GPT-2's 50257 x 768
  embedding has a Gram matrix of 36 tiles, so without a split its product (half of the
  embedding's Newton–Schulz work) keeps a quarter of an H100's cores busy; in 8 parts
  (288 tiles, 2.2 waves of 132 cores) the third, partial wave of a TF32 product costs as
  much as a full one (32 parts ran faster). A bfloat16 product runs at the peak in 8
  parts, and the parts' float32 Gram matrices are summed by a pass of their own, which
  more parts make longer: in bfloat16, GPT-2's Muon step on an H200 took 4.672 ms with 32
  parts, 4.614 with 16 and 4.569 with 8.

  >>> gram_splits(1, 768, 50304), gram_splits(12, 768, 3072), gram_splits(1, 768, 3072)
  (32, 1, 2)
  >>> gram_splits(1, 768, 50304, itemsize=2)
  8
  """
  tiles = batch * (-(-short // _TILE)) ** 2
  target = _TILES if itemsize >= 4 else _TILES_16
  parts = 1
  while (tiles < _FEW_TILES and tiles * parts < target and long % (2 * parts) == 0
         and long // (2 * parts) >= _MIN_SPLIT_ROWS):
    parts *= 2
  return parts


class Layout(NamedTuple):
  """A kernel-written stack of tall ``rows x cols`` matrices: each zero past its rows to
  ``width``, and ``transposed`` (``cols x width``) or not (``width x cols``)."""

  rows: int
  cols: int
  width: int
  transposed: bool


def layout(shape, dtype) -> Layout | None:
  """How a kernel may write the stack of a group of ``rows x cols`` matrices: tall ones
  padded as the fast form pads them, in float32 transposed, in 16 bits as they are where
  the fast form pads them; else None (the matrices one after another). A TF32 Gram
  product contracting the strided axis runs at about half the speed of one contracting
  the contiguous axis; bfloat16 products take either at the peak."""
  rows, cols = shape
  if rows <= cols:
    return None
  if jnp.dtype(dtype) == jnp.float32:
    return Layout(rows, cols, padded(rows), True)
  return Layout(rows, cols, padded(rows), False) if padded(rows) != rows else None

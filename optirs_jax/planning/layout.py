"""Flat-buffer layout of a pytree's leaves for multi-tensor kernels (pure CPU).

A Pallas optimizer kernel walks a 2-D buffer ``(rows, lanes)`` in blocks of
``block_elems = block_rows * lanes`` elements. This module decides which leaves share a
buffer and where each one sits:

* leaves are grouped by a caller-given key (their dtypes: one buffer holds one dtype per
  operand), in their original order, so the plan is deterministic;
* every leaf starts on a block boundary and is padded to whole blocks, so every block
  belongs to exactly one leaf: per-leaf reductions (LAMB's norms) are a segment sum over
  per-block partials, and Triton never sees a ragged tail;
* a leaf at least ``solo_min_elements`` long whose size is a multiple of ``solo_multiple``
  (the kernel's lane count) gets a group of its own and is used in place (a reshape, no
  copy); its last, partial block (if any) is the executor's to handle;
* a group never exceeds ``max_group_elements`` so 32-bit offsets inside a kernel are safe.

Zero-size leaves take no space and are left out of every group.

>>> plan = plan_layout([1000, 7, 4096 * 300], ["f32"] * 3, block_elems=4096,
...                    solo_min_elements=1 << 20)
>>> [(g.solo, [p.leaf for p in g.placements], g.total) for g in plan.groups]
[(False, [0, 1], 8192), (True, [2], 1228800)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where one leaf lives in its group's buffer (all counts in elements)."""

  leaf: int
  offset: int
  size: int
  padded: int


@dataclasses.dataclass(frozen=True)
class Group:
  """Leaves sharing one flat buffer."""

  key: Hashable
  placements: tuple[Placement, ...]
  total: int
  block_elems: int
  solo: bool

  @property
  def num_blocks(self) -> int:
    """Blocks covering the buffer (a solo leaf's last block may be partial)."""
    return -(-self.total // self.block_elems)

  def block_owner(self) -> np.ndarray:
    """For each block, the index (into ``placements``) of the leaf that owns it."""
    counts = [-(-p.padded // self.block_elems) for p in self.placements]
    return np.repeat(np.arange(len(self.placements), dtype=np.int32), counts)

  @property
  def padding_elements(self) -> int:
    return self.total - sum(p.size for p in self.placements)


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
  groups: tuple[Group, ...]
  block_elems: int

  @property
  def padding_fraction(self) -> float:
    """Padding elements over all elements held (0 when nothing is padded)."""
    total = sum(g.total for g in self.groups)
    return sum(g.padding_elements for g in self.groups) / total if total else 0.0


def padded_size(size: int, block_elems: int) -> int:
  """``size`` rounded up to whole blocks."""
  return -(-size // block_elems) * block_elems


def runs_in_place(size: int, *, solo_min_elements: int, solo_multiple: int) -> bool:
  """Whether :func:`plan_layout` gives a leaf of ``size`` elements a group of its own."""
  return size % solo_multiple == 0 and size >= solo_min_elements


def plan_layout(sizes: Sequence[int], keys: Sequence[Hashable], *, block_elems: int,
                solo_min_elements: int = 1 << 20, solo_multiple: int | None = None,
                max_group_elements: int = 1 << 30) -> LayoutPlan:
  """Plans the flat buffers for leaves of the given ``sizes`` (element counts).

  Args:
    sizes: number of elements of each leaf.
    keys: one hashable per leaf; only leaves with equal keys share a buffer.
    block_elems: elements per kernel block; every placement is a multiple of it.
    solo_min_elements: leaves at least this long keep their own group, used in place.
    solo_multiple: a solo leaf's size must be a multiple of this (default: ``block_elems``,
      so solo leaves are whole blocks).
    max_group_elements: upper bound on a shared group's size (elements).
  """
  if len(sizes) != len(keys):
    raise ValueError(f"got {len(sizes)} sizes but {len(keys)} keys; give one key per leaf")
  if block_elems <= 0:
    raise ValueError(f"{block_elems=} must be positive")
  solo_multiple = block_elems if solo_multiple is None else solo_multiple
  if solo_multiple <= 0:
    raise ValueError(f"{solo_multiple=} must be positive")
  if max_group_elements < block_elems:
    raise ValueError(f"{max_group_elements=} must be at least {block_elems=}")
  groups: list[Group] = []
  open_groups: dict[Hashable, list[Placement]] = {}
  order: list[Hashable] = []

  def close(key):
    placements = open_groups.pop(key)
    total = placements[-1].offset + placements[-1].padded
    groups.append(Group(key, tuple(placements), total, block_elems, solo=False))

  for leaf, (size, key) in enumerate(zip(sizes, keys)):
    size = int(size)
    if size < 0:
      raise ValueError(f"leaf {leaf} has negative size {size}")
    if size == 0:
      continue
    padded = padded_size(size, block_elems)
    if runs_in_place(size, solo_min_elements=solo_min_elements, solo_multiple=solo_multiple):
      groups.append(Group(key, (Placement(leaf, 0, size, size),), size, block_elems, solo=True))
      continue
    placements = open_groups.get(key)
    if placements is not None:
      end = placements[-1].offset + placements[-1].padded
      if end + padded > max_group_elements:
        close(key)
        placements = None
    if placements is None:
      open_groups[key] = placements = []
      order.append(key)
      end = 0
    placements.append(Placement(leaf, end, size, padded))
  for key in order:
    if key in open_groups:
      close(key)
  groups.sort(key=lambda g: g.placements[0].leaf)
  return LayoutPlan(tuple(groups), block_elems)


# Kernel arguments are passed in a parameter space of 4 KB on every CUDA version; at 8 bytes
# per pointer this leaves room for the hyper-parameter vector and the norm outputs.
MAX_POINTERS_PER_CALL = 384
# A launch also closes once it holds this many buffers and SPLIT_BLOCKS blocks: a bigger
# launch saves little per step, but its Triton compile grows faster than its leaves (H200,
# GPT-2 Adam: first call 24.8 s with 3 launches of 384 buffers, 12.8 s with 10 of 112, the
# same kernel time). Launches of small leaves still fill the pointer budget, where each
# launch's fixed cost matters and equal launches compile once.
SPLIT_POINTERS = 112
SPLIT_BLOCKS = 8192
# A grouped kernel indexes a leaf's elements with 32-bit integers.
MAX_GROUPED_LEAF_ELEMENTS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class GroupedCall:
  """Leaves one grouped kernel launch reads and writes in their own buffers (no packing).

  The launch's grid has one program per block of every leaf: leaf ``k`` (position ``k`` in
  ``leaves``) owns programs ``starts[k]`` to ``starts[k + 1] - 1``, and its last block is
  masked to ``sizes[k]`` elements.
  """

  leaves: tuple[int, ...]
  sizes: tuple[int, ...]
  starts: tuple[int, ...]  # len(leaves) + 1 program offsets; starts[-1] is the grid size
  block_elems: int

  @property
  def num_blocks(self) -> int:
    return self.starts[-1]

  def block_owner(self) -> np.ndarray:
    """For each program, the position in ``leaves`` of the leaf it works on."""
    return np.repeat(np.arange(len(self.leaves), dtype=np.int32), np.diff(self.starts))


def plan_grouped_calls(sizes: Sequence[int], *, block_elems: int, operands_per_leaf: int,
                       max_pointers: int = MAX_POINTERS_PER_CALL,
                       max_blocks: int = 2**31 - 1, split_pointers: int = SPLIT_POINTERS,
                       split_blocks: int = SPLIT_BLOCKS) -> tuple[GroupedCall, ...]:
  """Splits leaves, in order, into grouped kernel launches.

  A launch takes each leaf's operands as separate buffers, so it is bounded by the kernel's
  argument space (``operands_per_leaf`` pointers per leaf, at most ``max_pointers``) and by
  the grid size (``max_blocks`` programs). It also closes once it holds
  ``split_pointers`` buffers and ``split_blocks`` blocks (enough work that more leaves
  would mostly add compile time). Zero-size leaves are left out; a leaf of more than
  ``MAX_GROUPED_LEAF_ELEMENTS`` elements is an error (its indices would overflow).

  >>> [c.leaves for c in plan_grouped_calls([10, 0, 300, 5], block_elems=128,
  ...                                        operands_per_leaf=100, max_pointers=200)]
  [(0, 2), (3,)]
  >>> plan_grouped_calls([300], block_elems=128, operands_per_leaf=7)[0].starts
  (0, 3)
  """
  if block_elems <= 0:
    raise ValueError(f"{block_elems=} must be positive")
  if operands_per_leaf <= 0 or operands_per_leaf > max_pointers:
    raise ValueError(f"{operands_per_leaf=} must be between 1 and {max_pointers=}")
  per_call = max_pointers // operands_per_leaf
  calls: list[GroupedCall] = []
  leaves: list[int] = []
  counts: list[int] = []
  sizes_in: list[int] = []

  def close():
    if leaves:
      starts = tuple(int(s) for s in np.cumsum([0] + counts))
      calls.append(GroupedCall(tuple(leaves), tuple(sizes_in), starts, block_elems))
      leaves.clear(), counts.clear(), sizes_in.clear()

  for leaf, size in enumerate(sizes):
    size = int(size)
    if size < 0:
      raise ValueError(f"leaf {leaf} has negative size {size}")
    if size == 0:
      continue
    if size > MAX_GROUPED_LEAF_ELEMENTS:
      raise ValueError(f"leaf {leaf} has {size} elements, more than a grouped kernel's 32-bit "
                       f"indices reach ({MAX_GROUPED_LEAF_ELEMENTS=})")
    blocks = -(-size // block_elems)
    if blocks > max_blocks:
      raise ValueError(f"leaf {leaf} of {size} elements needs {blocks} blocks of "
                       f"{block_elems}, more than {max_blocks=}")
    held = sum(counts)  # blocks of the open launch
    full = len(leaves) == per_call or held + blocks > max_blocks
    enough = len(leaves) * operands_per_leaf >= split_pointers and held >= split_blocks
    if full or enough:
      close()
    leaves.append(leaf), counts.append(blocks), sizes_in.append(size)
  close()
  return tuple(calls)

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
import itertools
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
# per pointer this leaves room for the hyper-parameter vector and the norm outputs. From
# CUDA 12.1 on Volta or newer the space is 32 KB: room for 4000 buffers.
MAX_POINTERS_PER_CALL = 384
MAX_POINTERS_PER_CALL_32KB = 4000
# A launch also closes once it holds this many buffers and SPLIT_ELEMENTS elements (in whole
# blocks; 8192 blocks of 1024, where it was measured): a bigger
# launch saves little per step, but its Triton compile grows with its leaves (H200, GPT-2
# Adam: first call 24.8 s with 3 launches of 384 buffers, 12.8 s with 10 of 112, the same
# kernel time; runs 25-26: a distinct launch of 12 leaves compiles in 0.6 s, of 24 in 1.1-
# 1.8 s, of 54 in 4.1 s, while each launch costs about 2.5 us of kernel time). Launches of
# small leaves still fill the pointer budget, where each launch's fixed cost matters and
# equal launches compile once.
SPLIT_POINTERS = 112
SPLIT_ELEMENTS = 8192 * 1024
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


def repeating_stretch(sizes: Sequence[int], min_repeats: int = 2) -> tuple[int, int, int] | None:
  """The longest run of ``sizes`` that repeats a period: ``(a, b, period)`` where
  ``sizes[i] == sizes[i + period]`` for ``a <= i < b - period`` and ``b - a`` is a multiple
  of ``period`` of at least ``min_repeats`` periods (the smallest period among the longest
  runs), or None. The blocks of a transformer repeat this way.

  >>> repeating_stretch([9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 7])
  (1, 10, 3)
  >>> repeating_stretch([1, 2, 3]) is None
  True
  """
  x = np.asarray(sizes)
  best = None
  for period in range(1, len(x) // min_repeats + 1):
    if best is not None and best[1] - best[0] == len(x):
      break  # the whole sequence repeats: no longer run
    same = np.concatenate([[False], x[:-period] == x[period:], [False]])
    edges = np.flatnonzero(np.diff(same.astype(np.int8)))
    if not len(edges):
      continue
    lengths = edges[1::2] - edges[::2]
    k = int(np.argmax(lengths))
    repeats = (int(lengths[k]) + period) // period
    if repeats >= min_repeats and (best is None or repeats * period > best[1] - best[0]):
      a = int(edges[2 * k])
      best = (a, a + repeats * period, period)
  return best


def plan_grouped_calls(sizes: Sequence[int], *, block_elems: int, operands_per_leaf: int,
                       max_pointers: int = MAX_POINTERS_PER_CALL,
                       max_blocks: int = 2**31 - 1, split_pointers: int = SPLIT_POINTERS,
                       split_blocks: int | None = None,
                       repeat: bool = True) -> tuple[GroupedCall, ...]:
  """Splits leaves, in order, into grouped kernel launches.

  A launch takes each leaf's operands as separate buffers, so it is bounded by the kernel's
  argument space (``operands_per_leaf`` pointers per leaf, at most ``max_pointers``) and by
  the grid size (``max_blocks`` programs). It also closes once it holds
  ``split_pointers`` buffers and ``split_blocks`` blocks (enough work that more leaves
  would mostly add compile time; default: ``SPLIT_ELEMENTS`` elements' worth, whatever the
  block size). Zero-size leaves are left out; a leaf of more than
  ``MAX_GROUPED_LEAF_ELEMENTS`` elements is an error (its indices would overflow).

  With ``repeat``, a run of leaves whose sizes repeat a period (:func:`repeating_stretch`:
  the layers of a model) is cut at the same places in every period, so its launches are
  equal and the step traces and compiles each distinct one once: whole periods per launch
  where one fits, else every period split alike. The leaves before and after the run are
  planned the same way, apart from it.

  >>> [c.leaves for c in plan_grouped_calls([10, 0, 300, 5], block_elems=128,
  ...                                        operands_per_leaf=100, max_pointers=200)]
  [(0, 2), (3,)]
  >>> plan_grouped_calls([300], block_elems=128, operands_per_leaf=7)[0].starts
  (0, 3)
  >>> import functools
  >>> plan = functools.partial(plan_grouped_calls, [5] + [300, 100] * 4, block_elems=128,
  ...                            operands_per_leaf=7, max_pointers=28)  # 4 leaves a launch
  >>> [c.sizes for c in plan()]
  [(5,), (300, 100, 300, 100), (300, 100, 300, 100)]
  >>> [c.sizes for c in plan(repeat=False)]
  [(5, 300, 100, 300), (100, 300, 100, 300), (100,)]
  """
  if block_elems <= 0:
    raise ValueError(f"{block_elems=} must be positive")
  if operands_per_leaf <= 0 or operands_per_leaf > max_pointers:
    raise ValueError(f"{operands_per_leaf=} must be between 1 and {max_pointers=}")
  per_call = max_pointers // operands_per_leaf
  if split_blocks is None:
    split_blocks = -(-SPLIT_ELEMENTS // block_elems)
  blocks: dict[int, int] = {}
  for leaf, size in enumerate(sizes):
    size = int(size)
    if size < 0:
      raise ValueError(f"leaf {leaf} has negative size {size}")
    if size == 0:
      continue
    if size > MAX_GROUPED_LEAF_ELEMENTS:
      raise ValueError(f"leaf {leaf} has {size} elements, more than a grouped kernel's 32-bit "
                       f"indices reach ({MAX_GROUPED_LEAF_ELEMENTS=})")
    blocks[leaf] = -(-size // block_elems)
    if blocks[leaf] > max_blocks:
      raise ValueError(f"leaf {leaf} of {size} elements needs {blocks[leaf]} blocks of "
                       f"{block_elems}, more than {max_blocks=}")

  def greedy(units: Sequence[Sequence[int]]) -> list[list[int]]:
    """Units of leaves, in order, into launches, closing one before a unit that does not
    fit or once it has enough work."""
    launches: list[list[int]] = []
    open_: list[int] = []
    held = 0
    for unit in units:
      more = sum(blocks[i] for i in unit)
      full = len(open_) + len(unit) > per_call or held + more > max_blocks
      enough = len(open_) * operands_per_leaf >= split_pointers and held >= split_blocks
      if open_ and (full or enough):
        launches.append(open_)
        open_, held = [], 0
      open_ = open_ + list(unit)
      held += more
    return launches + [open_] if open_ else launches

  def split(seq: list[int]) -> list[list[int]]:
    stretch = repeating_stretch([int(sizes[i]) for i in seq]) if repeat and seq else None
    if stretch is not None:
      a, b, period = stretch
      periods = [seq[k:k + period] for k in range(a, b, period)]
      pieces = greedy([[i] for i in periods[0]])
      if len(pieces) == 1:  # a period fits a launch: whole periods per launch, as many
        # in each as the fewest launches need (the greedy's count, spread evenly)
        per = -(-len(periods) // len(greedy(periods)))
        launches = [list(itertools.chain(*periods[k:k + per]))
                    for k in range(0, len(periods), per)]
        repeated = len(periods) >= 2 * per
      else:  # every period cut where the first one is
        cuts = np.cumsum([0] + [len(p) for p in pieces])
        launches = [p[lo:hi] for p in periods for lo, hi in itertools.pairwise(cuts)]
        repeated = True
      if len(launches) > 1 and repeated:
        return split(seq[:a]) + launches + split(seq[b:])
    return greedy([[i] for i in seq])

  calls = []
  for leaves in split(list(blocks)):
    counts = [blocks[i] for i in leaves]
    starts = tuple(int(s) for s in np.cumsum([0] + counts))
    calls.append(GroupedCall(tuple(leaves), tuple(int(sizes[i]) for i in leaves), starts,
                             block_elems))
  return tuple(calls)

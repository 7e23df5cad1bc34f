"""Memory management policies: compaction, eviction, reference-count GC, prefetch.

Each is a small host-side class that decides; the caller moves the bytes.

* :func:`compaction_plan` -- the moves that slide live blocks down to close every gap,
  in an order that never overwrites a block before it has moved.
* :class:`LruEviction`, :class:`LfuEviction`, :class:`SizeAwareEviction` -- which resident
  blocks to evict to free a number of bytes (least recently used; least frequently used,
  ties by recency; largest cost-benefit ``size / (1 + uses)`` first).
* :class:`RefCountGC` -- blocks with references between them; ``collect()`` returns those
  no root reaches (cycles included: it marks from the roots, not from counts alone).
* :class:`StridePrefetcher` -- detects sequential and constant-stride access and predicts
  the next addresses.

>>> compaction_plan({0: 10, 64: 20, 200: 8})
[Move(src=64, dst=10, nbytes=20), Move(src=200, dst=30, nbytes=8)]
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Hashable, Iterable, Mapping

from optirs_jax.planning.memory import align_up


@dataclasses.dataclass(frozen=True)
class Move:
  src: int
  dst: int
  nbytes: int


def compaction_plan(live: Mapping[int, int], alignment: int = 1) -> list[Move]:
  """Moves that pack the live blocks ``{offset: nbytes}`` (aligned, not overlapping) from
  offset 0 up, keeping their order and ``alignment``. Applying them in order is safe: every move
  goes down, so a block lands only on bytes already vacated.
  """
  moves, top = [], 0
  for offset in sorted(live):
    if offset % alignment or offset < top:
      raise ValueError(f"live block at {offset} is not aligned to {alignment} or overlaps the "
                       "block before it")
    dst = align_up(top, alignment)
    if dst != offset:
      moves.append(Move(offset, dst, live[offset]))
    top = dst + live[offset]
  return moves


class _Eviction:
  def __init__(self):
    self.sizes: dict[Hashable, int] = {}
    self.clock = 0
    self.last_use: dict[Hashable, int] = {}
    self.uses: collections.Counter = collections.Counter()

  def insert(self, key: Hashable, nbytes: int) -> None:
    if nbytes <= 0:
      raise ValueError(f"nbytes={nbytes} must be positive")
    self.sizes[key] = nbytes
    self.touch(key)

  def touch(self, key: Hashable) -> None:
    if key not in self.sizes:
      raise KeyError(f"{key!r} is not resident")
    self.clock += 1
    self.last_use[key] = self.clock
    self.uses[key] += 1

  def remove(self, key: Hashable) -> None:
    for d in (self.sizes, self.last_use, self.uses):
      d.pop(key, None)

  def _order(self) -> list[Hashable]:
    raise NotImplementedError

  def victims(self, nbytes: int) -> list[Hashable]:
    """Keys to evict, in order, until at least ``nbytes`` are freed (removed from the
    policy). Raises ValueError if even evicting everything is not enough."""
    if nbytes > sum(self.sizes.values()):
      raise ValueError(f"cannot free {nbytes} B: only {sum(self.sizes.values())} B resident")
    out, freed = [], 0
    for key in self._order():
      if freed >= nbytes:
        break
      out.append(key)
      freed += self.sizes[key]
    for key in out:
      self.remove(key)
    return out


class LruEviction(_Eviction):
  """Evicts the least recently used first."""

  def _order(self):
    return sorted(self.sizes, key=lambda k: self.last_use[k])


class LfuEviction(_Eviction):
  """Evicts the least frequently used first; ties go to the least recently used."""

  def _order(self):
    return sorted(self.sizes, key=lambda k: (self.uses[k], self.last_use[k]))


class SizeAwareEviction(_Eviction):
  """Evicts where the most bytes come back per lost use: largest ``size / (1 + uses)``."""

  def _order(self):
    return sorted(self.sizes, key=lambda k: (-self.sizes[k] / (1 + self.uses[k]),
                                             self.last_use[k]))


class RefCountGC:
  """Reference counts between blocks; unreachable blocks (cycles too) are collected."""

  def __init__(self):
    self.refs: dict[Hashable, collections.Counter] = {}
    self.roots: collections.Counter = collections.Counter()

  def add(self, key: Hashable, root: bool = False) -> None:
    self.refs.setdefault(key, collections.Counter())
    if root:
      self.roots[key] += 1

  def link(self, src: Hashable, dst: Hashable) -> None:
    for k in (src, dst):
      if k not in self.refs:
        raise KeyError(f"{k!r} is not a known block")
    self.refs[src][dst] += 1

  def unlink(self, src: Hashable, dst: Hashable) -> None:
    if self.refs.get(src, {}).get(dst, 0) == 0:
      raise ValueError(f"no reference from {src!r} to {dst!r}")
    self.refs[src][dst] -= 1
    if not self.refs[src][dst]:
      del self.refs[src][dst]

  def release_root(self, key: Hashable) -> None:
    if not self.roots[key]:
      raise ValueError(f"{key!r} is not a root")
    self.roots[key] -= 1
    if not self.roots[key]:
      del self.roots[key]

  def ref_count(self, key: Hashable) -> int:
    return self.roots[key] + sum(c[key] for c in self.refs.values())

  def collect(self) -> set:
    """Removes and returns every block no root reaches."""
    seen, stack = set(), [k for k in self.roots if self.roots[k]]
    while stack:
      k = stack.pop()
      if k not in seen:
        seen.add(k)
        stack.extend(self.refs[k])
    garbage = set(self.refs) - seen
    for k in garbage:
      del self.refs[k]
    return garbage


class StridePrefetcher:
  """Predicts the next accesses once the last ``confirm`` strides agree.

  A stride equal to the access size is sequential access; any other constant stride is
  strided access. ``observe`` returns the predicted next ``depth`` addresses (empty while
  no pattern is confirmed).
  """

  def __init__(self, depth: int = 2, confirm: int = 2):
    if depth <= 0 or confirm <= 0:
      raise ValueError(f"depth={depth} and confirm={confirm} must be positive")
    self.depth, self.confirm = depth, confirm
    self.history: collections.deque = collections.deque(maxlen=confirm + 1)

  def observe(self, address: int) -> list[int]:
    self.history.append(address)
    if len(self.history) <= self.confirm:
      return []
    h = list(self.history)
    strides = {b - a for a, b in itertools.pairwise(h)}
    if len(strides) != 1 or 0 in strides:
      return []
    (stride,) = strides
    return [address + stride * i for i in range(1, self.depth + 1)]

  def pattern(self, access_bytes: int) -> str:
    """``"sequential"``, ``"strided"`` or ``"none"`` for the recent accesses."""
    h = list(self.history)
    strides = {b - a for a, b in itertools.pairwise(h)}
    if len(h) <= self.confirm or len(strides) != 1 or 0 in strides:
      return "none"
    return "sequential" if strides == {access_bytes} else "strided"


def replay(policy: _Eviction, trace: Iterable[tuple[Hashable, int]], capacity: int) -> int:
  """Runs ``(key, nbytes)`` accesses through a cache of ``capacity`` bytes; returns misses."""
  misses = 0
  for key, nbytes in trace:
    if key in policy.sizes:
      policy.touch(key)
      continue
    misses += 1
    over = sum(policy.sizes.values()) + nbytes - capacity
    if over > 0:
      policy.victims(over)
    policy.insert(key, nbytes)
  return misses

"""Allocators over an abstract address range, and device memory telemetry.

The allocators are host data structures that plan offsets inside a region of
``capacity_bytes`` (a device pool, an arena, a flat optimizer buffer); they never touch
memory. Each offers ``allocate(nbytes, alignment=...) -> offset``, ``free(offset)`` where the
scheme allows it, ``reset()``, and :class:`MemoryStats` (bytes in use, peak, fragmentation).
A request that cannot be met raises :class:`OutOfMemoryError` (a ``MemoryError``) and
changes nothing.

* :class:`ArenaAllocator` -- bump allocation; only ``reset()`` frees (per-step scratch).
* :class:`BuddyAllocator` -- power-of-two blocks split and merged with their buddy
  (Knuth, TAOCP vol. 1, 2.5); internal fragmentation up to 2x, no external fragmentation
  between buddies.
* :class:`SlabAllocator` -- fixed size classes carved from slabs; a freed slot is reused
  by the next request of its class (Bonwick, "The Slab Allocator", USENIX 1994).

:func:`device_memory_stats` reads a real device's statistics through
``jax.Device.memory_stats()`` where the backend reports them and returns ``None`` where it
does not (the CPU backend, for one); nothing here invents a number.

>>> arena = ArenaAllocator(1024)
>>> arena.allocate(100), arena.allocate(10, alignment=64)
(0, 128)
"""

from __future__ import annotations

import dataclasses
from typing import Any


class OutOfMemoryError(MemoryError):
  """The allocator cannot satisfy a request; its state is unchanged."""


@dataclasses.dataclass(frozen=True)
class MemoryStats:
  capacity_bytes: int
  bytes_in_use: int  # bytes handed out (rounded up to what the scheme reserves)
  peak_bytes_in_use: int
  largest_free_block: int
  fragmentation: float  # 1 - largest free block / free bytes (0 when nothing is free)
  live_allocations: int


def _check_request(nbytes: int, alignment: int) -> None:
  if not isinstance(nbytes, int) or nbytes <= 0:
    raise ValueError(f"nbytes={nbytes!r} must be a positive int")
  if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
    raise ValueError(f"alignment={alignment!r} must be a positive power of two")


def _check_capacity(capacity_bytes: int) -> None:
  if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
    raise ValueError(f"capacity_bytes={capacity_bytes!r} must be a positive int")


def align_up(x: int, alignment: int) -> int:
  """``x`` rounded up to a multiple of ``alignment`` (a power of two)."""
  return (x + alignment - 1) & ~(alignment - 1)


def fragmentation(free_blocks: list[int]) -> float:
  """``1 - largest / total`` over the sizes of free blocks: 0 for one block (or none)."""
  total = sum(free_blocks)
  return 0.0 if total == 0 else 1.0 - max(free_blocks) / total


class _Base:
  def __init__(self, capacity_bytes: int):
    _check_capacity(capacity_bytes)
    self.capacity_bytes = capacity_bytes
    self._peak = 0

  def _note_peak(self):
    self._peak = max(self._peak, self.bytes_in_use)

  def _record(self, offset: int, nbytes: int) -> int:
    self._live[offset] = nbytes
    self._note_peak()
    return offset

  def _release(self, offset: int) -> int:
    if offset not in self._live:
      raise ValueError(f"offset {offset} is not a live allocation")
    return self._live.pop(offset)

  @property
  def bytes_in_use(self) -> int:
    return sum(self._live.values())

  def live(self) -> dict[int, int]:
    return dict(self._live)

  def stats(self) -> MemoryStats:
    free = self.free_blocks()
    return MemoryStats(self.capacity_bytes, self.bytes_in_use, self._peak,
                       max(free, default=0), fragmentation(free), len(self.live()))


class ArenaAllocator(_Base):
  """Bump allocator: each allocation follows the last; ``reset()`` frees everything."""

  def __init__(self, capacity_bytes: int, default_alignment: int = 256):
    super().__init__(capacity_bytes)
    _check_request(1, default_alignment)
    self.default_alignment = default_alignment
    self.reset()

  def reset(self) -> None:
    self._top = 0
    self._live: dict[int, int] = {}

  def allocate(self, nbytes: int, alignment: int | None = None) -> int:
    alignment = alignment or self.default_alignment
    _check_request(nbytes, alignment)
    start = align_up(self._top, alignment)
    if start + nbytes > self.capacity_bytes:
      raise OutOfMemoryError(f"arena of {self.capacity_bytes} B cannot fit {nbytes} B at "
                             f"alignment {alignment}: {self.capacity_bytes - self._top} B left")
    self._top = start + nbytes
    return self._record(start, nbytes)

  def free(self, offset: int) -> None:
    raise NotImplementedError("an arena frees only everything at once: call reset()")

  @property
  def bytes_in_use(self) -> int:
    return self._top  # alignment gaps included: they are not reusable before reset()

  def free_blocks(self) -> list[int]:
    rest = self.capacity_bytes - self._top
    return [rest] if rest else []


class BuddyAllocator(_Base):
  """Binary buddy allocator over a power-of-two capacity with a minimum block size."""

  def __init__(self, capacity_bytes: int, min_block_bytes: int = 256):
    super().__init__(capacity_bytes)
    if capacity_bytes & (capacity_bytes - 1):
      raise ValueError(f"capacity_bytes={capacity_bytes} must be a power of two for a buddy "
                       "allocator")
    _check_request(1, min_block_bytes)
    if min_block_bytes > capacity_bytes:
      raise ValueError(f"{min_block_bytes=} exceeds {capacity_bytes=}")
    self.min_block_bytes = min_block_bytes
    self.reset()

  def reset(self) -> None:
    self._free: dict[int, set[int]] = {self.capacity_bytes: {0}}  # size -> offsets
    self._live: dict[int, int] = {}  # offset -> block size

  def _block_size(self, nbytes: int, alignment: int) -> int:
    size = max(self.min_block_bytes, 1 << (max(nbytes, alignment) - 1).bit_length())
    return size  # a block of size s sits at a multiple of s: aligned to any power <= s

  def allocate(self, nbytes: int, alignment: int = 1) -> int:
    _check_request(nbytes, alignment)
    size = self._block_size(nbytes, alignment)
    candidates = [s for s, offs in self._free.items() if s >= size and offs]
    if not candidates:
      raise OutOfMemoryError(f"buddy allocator cannot fit {nbytes} B (a {size} B block); "
                             f"largest free block is {max(self.free_blocks(), default=0)} B")
    s = min(candidates)
    offset = min(self._free[s])
    self._free[s].discard(offset)
    while s > size:  # split, keeping the lower half
      s //= 2
      self._free.setdefault(s, set()).add(offset + s)
    return self._record(offset, size)

  def free(self, offset: int) -> None:
    size = self._release(offset)
    while size < self.capacity_bytes:
      buddy = offset ^ size
      if buddy not in self._free.get(size, ()):
        break
      self._free[size].discard(buddy)
      offset, size = min(offset, buddy), size * 2
    self._free.setdefault(size, set()).add(offset)

  def free_blocks(self) -> list[int]:
    return [s for s, offs in self._free.items() for _ in offs]


class SlabAllocator(_Base):
  """Size classes (powers of two from ``min_size`` to ``slab_bytes``) carved from slabs.

  A request is rounded up to its class; each class takes whole slabs of ``slab_bytes`` from
  the region and hands out their slots. Requests larger than a slab are refused.
  """

  def __init__(self, capacity_bytes: int, slab_bytes: int = 65536, min_size: int = 64):
    super().__init__(capacity_bytes)
    for name, v in (("slab_bytes", slab_bytes), ("min_size", min_size)):
      _check_request(v, 1)
      if v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of two")
    if slab_bytes > capacity_bytes or min_size > slab_bytes:
      raise ValueError(f"need min_size <= slab_bytes <= capacity_bytes; got {min_size=}, "
                       f"{slab_bytes=}, {capacity_bytes=}")
    self.slab_bytes, self.min_size = slab_bytes, min_size
    self.reset()

  def reset(self) -> None:
    self._next_slab = 0
    self._free_slots: dict[int, list[int]] = {}  # class size -> free offsets (LIFO)
    self._live: dict[int, int] = {}

  def size_class(self, nbytes: int) -> int:
    return max(self.min_size, 1 << (nbytes - 1).bit_length())

  def allocate(self, nbytes: int, alignment: int = 1) -> int:
    _check_request(nbytes, alignment)
    size = self.size_class(max(nbytes, alignment))
    if size > self.slab_bytes:
      raise OutOfMemoryError(f"{nbytes} B is larger than a slab ({self.slab_bytes} B)")
    slots = self._free_slots.setdefault(size, [])
    if not slots:
      if self._next_slab + self.slab_bytes > self.capacity_bytes:
        raise OutOfMemoryError(f"no free {size} B slot and no room for another "
                               f"{self.slab_bytes} B slab")
      base = self._next_slab
      self._next_slab += self.slab_bytes
      slots.extend(range(base + self.slab_bytes - size, base - 1, -size))
    return self._record(slots.pop(), size)

  def free(self, offset: int) -> None:
    size = self._release(offset)
    self._free_slots[size].append(offset)
    if not self._live:  # nothing live: give every slab back, the region is one block again
      self.reset()

  def free_blocks(self) -> list[int]:
    slots = [s for s, offs in self._free_slots.items() for _ in offs]
    rest = self.capacity_bytes - self._next_slab
    return slots + ([rest] if rest else [])


# ---------------------------------------------------------------------------------- telemetry


def device_memory_stats(device: Any = None) -> dict | None:
  """The device's own memory statistics (``bytes_in_use``, ``peak_bytes_in_use``,
  ``bytes_limit``, ...) from ``jax.Device.memory_stats()``, or ``None`` where the backend
  does not report them."""
  import jax
  device = device if device is not None else jax.devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # some backends raise instead of returning None
    return None
  return dict(stats) if stats else None


@dataclasses.dataclass(frozen=True)
class HardwareUtilization:
  """A utilization reading; every field ``None`` (unknown) unless a real source gave it.

  JAX exposes no SM-utilization or bandwidth counters; callers with a real source (e.g.
  ``nvidia-smi`` or NVML polled out of band) construct this with their numbers.
  """

  compute_utilization: float | None = None  # 0..1
  memory_bandwidth_utilization: float | None = None  # 0..1
  memory_bytes_in_use: int | None = None
  source: str = "unknown"

  @classmethod
  def unknown(cls) -> HardwareUtilization:
    return cls()

  @classmethod
  def from_device(cls, device: Any = None) -> HardwareUtilization:
    """Memory in use from :func:`device_memory_stats`; the rest stays unknown."""
    stats = device_memory_stats(device)
    if stats is None or "bytes_in_use" not in stats:
      return cls.unknown()
    return cls(memory_bytes_in_use=int(stats["bytes_in_use"]), source="jax.Device.memory_stats")

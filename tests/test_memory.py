"""Allocators: unit cases and properties (no overlap, alignment, full free restores one block)."""

import hypothesis.strategies as st
import jax
import pytest
from hypothesis import given, settings

from optirs_jax.planning.memory import (
  ArenaAllocator,
  BuddyAllocator,
  HardwareUtilization,
  OutOfMemoryError,
  SlabAllocator,
  align_up,
  device_memory_stats,
  fragmentation,
)

ALLOCATORS = [lambda: ArenaAllocator(1 << 16), lambda: BuddyAllocator(1 << 16),
              lambda: SlabAllocator(1 << 16, slab_bytes=4096)]


def test_out_of_memory_is_a_memory_error_and_changes_nothing():
  for make in ALLOCATORS:
    a = make()
    a.allocate(100)
    before = a.stats()
    with pytest.raises(OutOfMemoryError) as e:
      a.allocate(1 << 20)
    assert isinstance(e.value, MemoryError)
    assert a.stats() == before


@pytest.mark.parametrize("make", ALLOCATORS)
def test_bad_requests(make):
  a = make()
  with pytest.raises(ValueError, match="nbytes=0"):
    a.allocate(0)
  with pytest.raises(ValueError, match="alignment=3"):
    a.allocate(8, alignment=3)


def test_constructor_checks():
  with pytest.raises(ValueError, match="capacity_bytes=0"):
    ArenaAllocator(0)
  with pytest.raises(ValueError, match="power of two"):
    BuddyAllocator(1000)
  with pytest.raises(ValueError, match="slab_bytes=3000 must be a power of two"):
    SlabAllocator(1 << 16, slab_bytes=3000)


def test_arena_bumps_and_resets():
  a = ArenaAllocator(1024, default_alignment=1)
  assert [a.allocate(100), a.allocate(10, alignment=64), a.allocate(1)] == [0, 128, 138]
  assert a.stats().bytes_in_use == 139 and a.stats().peak_bytes_in_use == 139
  with pytest.raises(NotImplementedError, match="reset"):
    a.free(0)
  a.reset()
  assert a.allocate(5) == 0 and a.stats().peak_bytes_in_use == 139


def test_buddy_splits_and_merges():
  b = BuddyAllocator(1024, min_block_bytes=64)
  x, y, z = b.allocate(100), b.allocate(64), b.allocate(64)  # 128, 64, 64
  assert (x, y, z) == (0, 128, 192)
  assert b.stats().bytes_in_use == 256
  b.free(y)
  b.free(x)
  b.free(z)
  assert b.free_blocks() == [1024] and b.stats().fragmentation == 0.0


def test_slab_reuses_freed_slots():
  s = SlabAllocator(1 << 16, slab_bytes=1024, min_size=64)
  a1, a2 = s.allocate(60), s.allocate(64)
  assert (a1, a2) == (0, 64)
  s.free(a1)
  assert s.allocate(33) == a1
  assert s.allocate(500) == 1024  # another class takes another slab
  with pytest.raises(OutOfMemoryError, match="larger than a slab"):
    s.allocate(2048)


def test_fragmentation_and_align():
  assert fragmentation([]) == 0.0 and fragmentation([10]) == 0.0
  assert fragmentation([10, 30]) == pytest.approx(0.25)
  assert align_up(129, 128) == 256 and align_up(128, 128) == 128


ops = st.lists(st.tuples(st.booleans(), st.integers(1, 5000), st.sampled_from([1, 8, 64, 256]),
                         st.integers(0, 1000)), max_size=60)


@pytest.mark.parametrize("kind", ["buddy", "slab", "arena"])
@settings(max_examples=100, deadline=None)
@given(ops=ops)
def test_allocator_properties(kind, ops):
  a = {"buddy": lambda: BuddyAllocator(1 << 16, min_block_bytes=32),
       "slab": lambda: SlabAllocator(1 << 16, slab_bytes=8192, min_size=32),
       "arena": lambda: ArenaAllocator(1 << 16, default_alignment=1)}[kind]()
  live = {}
  for alloc, nbytes, alignment, pick in ops:
    if alloc or not live or kind == "arena":
      try:
        off = a.allocate(nbytes, alignment=alignment)
      except OutOfMemoryError:
        continue
      assert off % alignment == 0 and off + nbytes <= a.capacity_bytes
      for o, n in live.items():  # no two live allocations overlap
        assert off + nbytes <= o or o + n <= off
      live[off] = nbytes
    else:
      off = sorted(live)[pick % len(live)]
      a.free(off)
      del live[off]
    assert a.stats().bytes_in_use >= sum(live.values())
  if kind == "arena":
    a.reset()
  else:
    for off in list(live):
      a.free(off)
  assert a.free_blocks() == [a.capacity_bytes]  # everything freed: one block again
  assert a.stats().bytes_in_use == 0


def test_telemetry_is_real_or_none():
  stats = device_memory_stats(jax.devices("cpu")[0])
  assert stats is None or "bytes_in_use" in stats
  u = HardwareUtilization.unknown()
  assert u.compute_utilization is None and u.source == "unknown"
  r = HardwareUtilization.from_device(jax.devices("cpu")[0])
  assert r.source in ("unknown", "jax.Device.memory_stats")

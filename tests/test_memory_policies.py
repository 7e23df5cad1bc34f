"""Memory management policies."""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from optirs_jax.planning.memory_policies import (
  LfuEviction,
  LruEviction,
  Move,
  RefCountGC,
  SizeAwareEviction,
  StridePrefetcher,
  compaction_plan,
  replay,
)


@settings(max_examples=200, deadline=None)
@given(blocks=st.lists(st.tuples(st.integers(0, 100), st.integers(1, 50)), max_size=20),
       alignment=st.sampled_from([1, 8, 64]))
def test_compaction_closes_gaps_and_moves_safely(blocks, alignment):
  live, top = {}, 0
  for gap, size in blocks:  # aligned, non-overlapping live blocks with gaps
    off = -(-(top + gap) // alignment) * alignment
    live[off] = size
    top = off + size
  memory = {}
  for off, size in live.items():
    for i in range(size):
      memory[off + i] = (off, i)
  for m in compaction_plan(live, alignment):
    assert m.dst < m.src and m.dst % alignment == 0
    chunk = [memory[m.src + i] for i in range(m.nbytes)]  # the block is intact when moved
    assert chunk == [(m.src, i) for i in range(m.nbytes)]
    for i, v in enumerate(chunk):
      memory[m.dst + i] = v
  end = 0  # afterwards: packed in order, aligned
  for off in sorted(live):
    dst = -(-end // alignment) * alignment
    assert [memory[dst + i] for i in range(live[off])] == [(off, i) for i in range(live[off])]
    end = dst + live[off]


def test_compaction_rejects_unaligned_blocks():
  with pytest.raises(ValueError, match="not aligned to 8"):
    compaction_plan({3: 4}, alignment=8)


def test_compaction_example():
  assert compaction_plan({0: 10, 64: 20, 208: 8}, alignment=16) == [Move(64, 16, 20),
                                                                     Move(208, 48, 8)]


def test_lru_lfu_size_aware_choose_different_victims():
  def fill(policy):
    for key, size in (("a", 10), ("b", 100), ("c", 10)):
      policy.insert(key, size)
    policy.touch("a")
    policy.touch("a")
    policy.touch("b")
    return policy
  assert fill(LruEviction()).victims(5) == ["c"]
  assert fill(LfuEviction()).victims(5) == ["c"]  # c used once, least recently among ties
  lfu = fill(LfuEviction())
  lfu.touch("c")
  lfu.touch("c")
  assert lfu.victims(5) == ["b"]  # b: 2 uses, c and a: 3
  assert fill(SizeAwareEviction()).victims(5) == ["b"]  # 100 B over 2 uses frees the most
  with pytest.raises(ValueError, match="cannot free 1000 B"):
    fill(LruEviction()).victims(1000)


def test_lru_beats_lfu_on_a_shifting_working_set():
  trace = [(k, 10) for k in "aaaabbbb"] + [(k, 10) for k in "cdcdcdcd"]
  assert replay(LruEviction(), trace, capacity=20) == 4
  assert replay(LfuEviction(), trace, capacity=20) > 4


def test_refcount_gc_collects_unreachable_cycles():
  gc = RefCountGC()
  for k in "rabcd":
    gc.add(k, root=(k == "r"))
  gc.link("r", "a")
  gc.link("a", "b")
  gc.link("c", "d")
  gc.link("d", "c")  # an unreachable cycle
  assert gc.ref_count("c") == 1
  assert gc.collect() == {"c", "d"}
  gc.unlink("r", "a")
  assert gc.collect() == {"a", "b"}
  gc.release_root("r")
  assert gc.collect() == {"r"}
  with pytest.raises(ValueError, match="no reference"):
    gc.unlink("r", "a")


def test_prefetch_detects_sequential_and_strided():
  p = StridePrefetcher(depth=2, confirm=2)
  assert p.observe(0) == [] and p.observe(64) == []
  assert p.observe(128) == [192, 256] and p.pattern(64) == "sequential"
  q = StridePrefetcher()
  for a in (0, 1000, 2000):
    out = q.observe(a)
  assert out == [3000, 4000] and q.pattern(64) == "strided"
  assert q.observe(2500) == [] and q.pattern(64) == "none"

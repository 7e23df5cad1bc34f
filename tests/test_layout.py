"""The flat-buffer layout planner: unit cases and properties over random leaf lists."""

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from optirs_jax.planning import padded_size, plan_layout


def test_small_leaves_share_a_group_and_large_aligned_ones_stand_alone():
  plan = plan_layout([1000, 7, 4096 * 300, 1], ["a"] * 4, block_elems=4096,
                     solo_min_elements=1 << 20)
  assert [(g.solo, [p.leaf for p in g.placements]) for g in plan.groups] == [
      (False, [0, 1, 3]), (True, [2])]
  shared = plan.groups[0]
  assert [p.offset for p in shared.placements] == [0, 4096, 8192]
  assert shared.total == 3 * 4096 and shared.num_blocks == 3
  np.testing.assert_array_equal(shared.block_owner(), [0, 1, 2])


def test_keys_separate_groups_and_zero_size_leaves_take_no_space():
  plan = plan_layout([10, 0, 10], ["f32", "f32", "bf16"], block_elems=128)
  assert sorted(g.key for g in plan.groups) == ["bf16", "f32"]
  assert all(p.leaf != 1 for g in plan.groups for p in g.placements)


def test_groups_are_split_at_the_size_bound():
  plan = plan_layout([300] * 10, ["k"] * 10, block_elems=128, max_group_elements=1024)
  assert all(g.total <= 1024 for g in plan.groups)
  assert sum(len(g.placements) for g in plan.groups) == 10


@pytest.mark.parametrize("kwargs, match", [
    ({"sizes": [1, 2], "keys": ["a"]}, "2 sizes but 1 keys"),
    ({"sizes": [1], "keys": ["a"], "block_elems": 0}, "block_elems=0 must be positive"),
    ({"sizes": [-1], "keys": ["a"]}, "negative size -1"),
])
def test_bad_input(kwargs, match):
  kwargs.setdefault("block_elems", 128)
  with pytest.raises(ValueError, match=match):
    plan_layout(**kwargs)


def test_a_large_ragged_leaf_stands_alone_when_its_size_fits_the_lanes():
  plan = plan_layout([128 * 1000 + 128, 128 * 1000 + 1], ["k"] * 2, block_elems=4096,
                     solo_min_elements=100_000, solo_multiple=128)
  solo, shared = sorted(plan.groups, key=lambda g: not g.solo)
  assert solo.solo and solo.total == 128 * 1001 and solo.num_blocks == 32
  assert not shared.solo and shared.total == padded_size(128 * 1000 + 1, 4096)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=40),
       keys=st.lists(st.sampled_from("abc"), min_size=40, max_size=40),
       block=st.sampled_from([1, 128, 1024]), solo=st.integers(1, 4096),
       multiple=st.sampled_from([None, 1, 8, 128]), cap=st.integers(1024, 20000))
def test_layout_properties(sizes, keys, block, solo, multiple, cap):
  keys = keys[:len(sizes)]
  plan = plan_layout(sizes, keys, block_elems=block, solo_min_elements=solo,
                     solo_multiple=multiple, max_group_elements=cap)
  placed = sorted(p.leaf for g in plan.groups for p in g.placements)
  assert placed == [i for i, s in enumerate(sizes) if s > 0]  # every non-empty leaf, once
  for g in plan.groups:
    assert len(g.block_owner()) == g.num_blocks
    if g.solo:  # used in place: no copy, no padding
      (p,) = g.placements
      assert p.size >= solo and p.size % (multiple or block) == 0
      assert (p.offset, p.padded, g.total) == (0, p.size, p.size)
      continue
    end = 0
    for p in g.placements:
      assert keys[p.leaf] == g.key and p.size == sizes[p.leaf]
      assert p.offset == end and p.offset % block == 0  # back to back, block aligned
      assert p.padded == padded_size(p.size, block) and p.padded - p.size < block
      end = p.offset + p.padded
    assert g.total == end and g.total % block == 0
    assert g.total <= max(cap, max(p.padded for p in g.placements))
  assert 0.0 <= plan.padding_fraction < 1.0

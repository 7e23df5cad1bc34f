"""The leaf table's loads and stores (optirs_jax.pallas.leaf_table) against NumPy: which leaf
owns each program, the block it reads (with the pad past the leaf's end) and what it
writes; run in interpret mode (their discharge), lowered to Triton for an abstract H200."""

import functools
import re

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from optirs_jax.pallas import leaf_table
from tests import cases
from tests.test_lowering import TRITON, abstract_target

PAD_A, PAD_B = -3.0, 7.0


def _body(*refs, starts, sizes, block, shared):
  """Per leaf inputs a, b and output y = a * b + 1; per program its owner's block index,
  the elements left, and the sum of the loaded a (pad lanes included). ``shared``: the
  store takes the owner the load's search found (one search) instead of searching again."""
  n = len(sizes)
  ins, outs = refs[:2 * n], refs[2 * n:3 * n]
  local_ref, left_ref, sum_ref = refs[3 * n:]
  pid = pl.program_id(0)
  out_rows = [outs[k:k + 1] for k in range(n)]
  # "other": the load finds other refs' pointers (the inputs'), so the store's lowering
  # cannot take the load's and searches by the owner's index.
  found = {"other": [ins[2 * k:2 * k + 1] for k in range(n)], True: out_rows}.get(shared)
  local, left, (a, b), *owner = leaf_table.load(pid, starts, sizes, block,
                                                [ins[2 * k:2 * k + 2] for k in range(n)],
                                                [PAD_A, PAD_B], outs=found)
  lane = jnp.arange(block, dtype=jnp.int32)
  leaf_table.store(pid, starts, out_rows, local * block + lane, lane < left, [a * b + 1.0],
                   owner=owner[0] if found else None)
  local_ref[...] = local[None]
  left_ref[...] = left[None]
  sum_ref[...] = jnp.sum(a)[None]


def _call(sizes, block, platform, debug=False, shared=False):
  starts = np.concatenate([[0], np.cumsum([-(-s // block) for s in sizes])]).tolist()
  grid = starts[-1]
  per_program = pl.BlockSpec((1,), lambda i: (i,))
  return pl.pallas_call(
    functools.partial(_body, starts=starts, sizes=sizes, block=block, shared=shared),
    out_shape=[jax.ShapeDtypeStruct((s,), jnp.float32) for s in sizes]
    + [jax.ShapeDtypeStruct((grid,), jnp.int32)] * 2 + [jax.ShapeDtypeStruct((grid,), jnp.float32)],
    grid=(grid,),
    in_specs=[pl.BlockSpec()] * (2 * len(sizes)),
    out_specs=[pl.BlockSpec()] * len(sizes) + [per_program] * 3,
    interpret=platform == "interpret",
    compiler_params=pltriton.CompilerParams(num_warps=1) if platform == "cuda" else None,
    debug=debug,
  ), starts


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=6),
       block=st.sampled_from([4, 8, 16]), seed=st.integers(0, 2**16),
       shared=st.sampled_from([False, True, "other"]))
def test_each_program_reads_and_writes_its_own_leafs_block(sizes, block, seed, shared):
  rng = np.random.default_rng(seed)
  a = [rng.standard_normal(s).astype(np.float32) for s in sizes]
  b = [rng.standard_normal(s).astype(np.float32) for s in sizes]
  call, starts = _call(sizes, block, "interpret", shared=shared)
  *ys, local, left, sums = jax.jit(call)(*[x for pair in zip(a, b) for x in pair])
  for y, x, z in zip(ys, a, b):
    np.testing.assert_allclose(np.asarray(y), x * z + 1, rtol=1e-6, atol=1e-6)  # fma or not
  # The owner of each program by a linear scan over the offsets, written out.
  for pid in range(starts[-1]):
    k = max(j for j in range(len(sizes)) if starts[j] <= pid)
    want_local = pid - starts[k]
    rows = a[k][want_local * block:(want_local + 1) * block]
    assert int(local[pid]) == want_local
    assert int(left[pid]) == sizes[k] - want_local * block
    np.testing.assert_allclose(float(sums[pid]), rows.sum() + PAD_A * (block - rows.size),
                               rtol=1e-5, atol=1e-5)


def test_operands_whose_values_go_unused_are_not_read():
  # Each leaf's b is loaded but unused: the kernel reads only a, in every leaf, as a masked
  # load per leaf would be dropped.
  def body(*refs, starts, sizes):
    ins, outs = refs[:2 * len(sizes)], refs[2 * len(sizes):]
    local, left, (a, _) = leaf_table.load(pl.program_id(0), starts, sizes, 4,
                                          [ins[2 * k:2 * k + 2] for k in range(len(sizes))],
                                          [0.0, 0.0])
    lane = jnp.arange(4, dtype=jnp.int32)
    leaf_table.store(pl.program_id(0), starts, [outs[k:k + 1] for k in range(len(sizes))],
                     local * 4 + lane, lane < left, [a + 1.0])

  sizes, starts = [5, 3], [0, 2, 3]
  call = pl.pallas_call(functools.partial(body, starts=starts, sizes=sizes),
                        out_shape=[jax.ShapeDtypeStruct((s,), jnp.float32) for s in sizes],
                        grid=(3,), in_specs=[pl.BlockSpec()] * 4,
                        out_specs=[pl.BlockSpec()] * 2, interpret=True)
  xs = [jnp.arange(s, dtype=jnp.float32) for s in sizes for _ in range(2)]
  assert cases.kernel_memory(jax.make_jaxpr(call)(*xs)) == [(2, 2)]  # a of 2 leaves; y of 2
  got = jax.jit(call)(*xs)
  np.testing.assert_array_equal(np.asarray(got[0]), np.arange(5) + 1.0)


def test_arguments_are_checked():
  ref = jnp.zeros(4)
  with pytest.raises(ValueError, match="one more start than leaves, got 2 starts for 2"):
    leaf_table.load(0, [0, 1], [4, 4], 4, [[ref], [ref]], [0.0])
  with pytest.raises(ValueError, match=r"same operands; got \[1, 2\]"):
    leaf_table.load(0, [0, 1, 2], [4, 4], 4, [[ref], [ref, ref]], [0.0])
  with pytest.raises(ValueError, match="same dtypes"):
    leaf_table.store(0, [0, 1, 2], [[ref], [jnp.zeros(4, jnp.int32)]], jnp.arange(4),
                     jnp.ones(4, bool), [ref])
  with pytest.raises(ValueError, match="one size per leaf, got 1 for 2 leaves"):
    leaf_table.load(0, [0, 1, 2], [4], 4, [[ref], [ref]], [0.0])


@pytest.mark.skipif(not leaf_table.AVAILABLE, reason="this jax's Triton lowering lacks what "
                    "the leaf table builds on; grouped launches branch per leaf instead")
@pytest.mark.parametrize("shared", [False, True, "other"])
def test_lowers_to_triton_with_one_unmergeable_branch_per_leaf(capsys, shared):
  # The search's leaves each hold a side-effecting inline-asm move of the leaf's start,
  # its text unique to the leaf, so the compilers keep the branches instead of selecting
  # among every leaf's pointers. Two searches (the load's, the store's), or one where the
  # store takes the load's owner.
  sizes = [5, 9, 3, 12, 1]
  call, starts = _call(sizes, 4, "cuda", debug=True, shared=shared)
  searches = 1 if shared is True else 2
  args = [jax.ShapeDtypeStruct((s,), jnp.float32) for s in sizes for _ in range(2)]
  with abstract_target("NVIDIA H200", "cuda"):
    text = jax.jit(call).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert TRITON in text
  module = capsys.readouterr().out.split("The Triton module for pallas_call")[-1]
  asm = re.findall(r'tt.elementwise_inline_asm "([^"]*)" \{([^}]*)\}', module)
  want = [f"mov.b32 $0, {starts[k]}; // leaf {k}" for k in range(len(sizes))]
  if shared == "other":  # the store's search runs over the leaves' indices
    want += [f"mov.b32 $0, {k}; // leaf {k}" for k in range(len(sizes))]
  else:
    want *= searches
  assert sorted(a for a, _ in asm) == sorted(want)
  assert all("pure = false" in attrs for _, attrs in asm)
  assert module.count("scf.if") == searches * (len(sizes) - 1)
  # Each leaf's output pointer is stored through once, whichever search found it.
  assert module.count("tt.store") == 1 + 3  # y; local, left and the sum per program


def _scaled_body(*refs, starts, sizes, block):
  """Per leaf x (its elements) and s (one value per block): y = x * s of the element's
  block, t = s + 1, both written through the load's one search (two stores by owner)."""
  n = len(sizes)
  ins, outs = refs[:2 * n], refs[2 * n:]
  pid = pl.program_id(0)
  out_rows = [outs[2 * k:2 * k + 2] for k in range(n)]
  local, left, (x, s), owner = leaf_table.load(pid, starts, sizes, block,
                                               [ins[2 * k:2 * k + 2] for k in range(n)],
                                               [0.0, 0.0], outs=out_rows, widths=[block, 1])
  lane = jnp.arange(block, dtype=jnp.int32)
  leaf_table.store(pid, starts, [row[:1] for row in out_rows], local * block + lane,
                   lane < left, [x * s], owner=owner)
  leaf_table.store(pid, starts, [row[1:] for row in out_rows], local[None], jnp.ones(1, bool),
                   [s + 1.0], owner=owner)


def _scaled_call(sizes, block, platform, debug=False):
  blocks = [-(-s // block) for s in sizes]
  starts = np.concatenate([[0], np.cumsum(blocks)]).tolist()
  shapes = [jax.ShapeDtypeStruct((n,), jnp.float32) for s, b in zip(sizes, blocks)
            for n in (s, b)]
  return pl.pallas_call(
    functools.partial(_scaled_body, starts=starts, sizes=sizes, block=block),
    out_shape=shapes, grid=(starts[-1],), in_specs=[pl.BlockSpec()] * len(shapes),
    out_specs=[pl.BlockSpec()] * len(shapes), interpret=platform == "interpret",
    compiler_params=pltriton.CompilerParams(num_warps=1) if platform == "cuda" else None,
    debug=debug), shapes


@settings(max_examples=8, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5),
       block=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_a_width_of_one_reads_and_writes_one_value_per_block(sizes, block, seed):
  rng = np.random.default_rng(seed)
  call, shapes = _scaled_call(sizes, block, "interpret")
  args = [rng.standard_normal(a.shape).astype(np.float32) for a in shapes]
  got = jax.jit(call)(*args)
  for k, size in enumerate(sizes):
    x, s = args[2 * k], args[2 * k + 1]
    np.testing.assert_array_equal(np.asarray(got[2 * k]), x * np.repeat(s, block)[:size])
    np.testing.assert_array_equal(np.asarray(got[2 * k + 1]), s + np.float32(1))


def test_widths_are_checked():
  ref = jnp.zeros(4)
  with pytest.raises(ValueError, match=r"each 4 or 1; got \(2,\)"):
    leaf_table.load(0, [0, 1], [4], 4, [[ref]], [0.0], widths=[2])


@pytest.mark.skipif(not leaf_table.AVAILABLE, reason="this jax's Triton lowering lacks what "
                    "the leaf table builds on; grouped launches branch per leaf instead")
def test_stores_of_some_of_the_found_refs_share_the_loads_search(capsys):
  # Two stores, each of one of the two refs the load found per leaf: one search in all.
  sizes = [5, 9, 3, 12]
  call, shapes = _scaled_call(sizes, 4, "cuda", debug=True)
  with abstract_target("NVIDIA H200", "cuda"):
    text = jax.jit(call).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
  assert TRITON in text
  module = capsys.readouterr().out.split("The Triton module for pallas_call")[-1]
  assert module.count("scf.if") == len(sizes) - 1
  assert module.count("tt.store") == 2

"""A grouped kernel: one launch updates many leaves, each in its own buffers, no packing.

The launch takes every leaf's operands as separate whole-array arguments (a compile-time
table of buffers, planned by :func:`optirs_jax.planning.layout.plan_grouped_calls`). Its
grid has one program per 1-D block of every leaf; program ``i`` finds the leaf that owns it
by a binary search over the static block offsets, loads its block with a mask past the
leaf's end, calls the op's rule and stores the results masked. The search yields the
owner's buffer pointers (:mod:`optirs_jax.pallas.leaf_table`), so each operand has one load
or store and the rule is traced once per run of leaves of the same dtypes: the kernel's
code and its compile grow by a few scalars per leaf. Where this jax's Triton lowering lacks
what the leaf table needs, the search branches around each leaf's own loads and stores
(:func:`for_owner`, :func:`owner_value`), a few vector memory operations per leaf.
Nothing is concatenated before the step or sliced after it, and leaves of any size or
dtype share a launch, so a tree of many leaves costs a few launches and no copies; the
state and, on the fused apply, the params are updated in place. Per-leaf norms: each
program writes its block's sum of squares, and :func:`segment_totals` adds them per leaf in
one more launch.

This is the Apex multi-tensor-apply design with the address table fixed at trace time: a
``pallas_call`` takes whole arrays, not a runtime table of pointers, so one launch serves
at most ``MAX_POINTERS_PER_CALL`` operand buffers.

Triton on GPU and interpret mode on CPU (the same masked loads). Mosaic TPU pipelines every
operand's block into VMEM for every program, so the TPU keeps the packed layout.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from optirs_jax.pallas import leaf_table
from optirs_jax.pallas.kernel import compiler_params
from optirs_jax.pallas.op import (
  ElementwiseOp,
  block_math,
  read_hyper,
)
from optirs_jax.pallas.options import Tiling
from optirs_jax.pallas.sharding import out_struct, vary_alike
from optirs_jax.planning.layout import GroupedCall

# Loads and stores through the owner's pointers (:mod:`optirs_jax.pallas.leaf_table`),
# where this jax's Triton lowering allows, rather than one branch per leaf around them.
POINTER_SELECT = True


def for_owner(pid, starts: Sequence[int], body, lo: int = 0, hi: int | None = None) -> None:
  """Runs ``body(k)`` for the leaf ``k`` whose programs ``starts[k] <= pid < starts[k + 1]``
  include ``pid`` (one of ``lo..hi - 1``): a binary search over the static offsets, so a
  program takes log2(leaves) comparisons to find its leaf instead of one per leaf (a chain
  of ``pl.when`` per leaf made a 148-leaf launch of 1K-element blocks mostly branches)."""
  hi = len(starts) - 1 if hi is None else hi
  if hi - lo == 1:
    body(lo)
    return
  mid = (lo + hi) // 2
  left = pid < starts[mid]
  pl.when(left)(lambda: for_owner(pid, starts, body, lo, mid))
  pl.when(jnp.logical_not(left))(lambda: for_owner(pid, starts, body, mid, hi))


def owner_value(pid, starts: Sequence[int], fn, lo: int, hi: int):
  """``fn(k)`` for the leaf ``k`` (one of ``lo..hi - 1``) whose programs include ``pid``: the
  binary search of :func:`for_owner` as conditionals with results (every leaf's ``fn``
  gives values of the same types)."""
  if hi - lo == 1:
    return fn(lo)
  mid = (lo + hi) // 2
  return jax.lax.cond(pid < starts[mid], lambda: owner_value(pid, starts, fn, lo, mid),
                      lambda: owner_value(pid, starts, fn, mid, hi))


def dtype_runs(signatures: Sequence) -> list[tuple[int, int]]:
  """The maximal runs ``(lo, hi)`` of consecutive equal ``signatures``.

  >>> dtype_runs(["f32", "f32", "bf16", "f32"])
  [(0, 2), (2, 3), (3, 4)]
  """
  runs: list[tuple[int, int]] = []
  for k, sig in enumerate(signatures):
    if runs and signatures[runs[-1][0]] == sig:
      runs[-1] = (runs[-1][0], k + 1)
    else:
      runs.append((k, k + 1))
  return runs


def _body(h_ref, *refs, op: ElementwiseOp, call: GroupedCall, n_in: int, n_out: int,
          skip: bool = False, pointer_select: bool = True):
  leaves = len(call.sizes)
  in_refs = refs[:leaves * n_in]
  out_refs = refs[leaves * n_in:leaves * (n_in + n_out)]
  norm_refs = refs[leaves * (n_in + n_out):]
  block = call.block_elems
  pid = pl.program_id(0)
  ins_of = lambda k: in_refs[k * n_in:(k + 1) * n_in]
  outs_of = lambda k: out_refs[k * n_out:(k + 1) * n_out]
  run_op = dataclasses.replace(op, rule=op.unguarded) if skip else op

  def run(lo: int, hi: int):
    """Leaves ``lo..hi - 1``, of one dtype signature: the rule is traced once for all of
    them, so the kernel's code grows by the search per leaf, not by the rule."""
    def locate(k):
      # The program's block in its leaf, the elements left from there, the leaf's own
      # scalars (computed or read in the branch: a branch cannot yield a constant).
      local = pid - call.starts[k]
      leaf_h = read_hyper(h_ref, (), op.leaf_hyper, k)
      return local, call.sizes[k] - local * block, *(leaf_h[n] for n in op.leaf_hyper)

    lane = jnp.arange(block, dtype=jnp.int32)
    if pointer_select:
      # One search finds the leaf's input and output pointers; the store reuses it.
      local, left, ins, owner = leaf_table.load(
        pid, call.starts[lo:hi + 1], call.sizes[lo:hi], block,
        [ins_of(k) for k in range(lo, hi)], op.pads, outs=[outs_of(k) for k in range(lo, hi)])
      # The leaf's own scalars sit at its index in the hyper-parameter vector: one load.
      leaf_h = read_hyper(h_ref, (), op.leaf_hyper, lo + owner)
      leaf_values = [leaf_h[n] for n in op.leaf_hyper]
    else:
      local, left, *leaf_values = owner_value(pid, call.starts, locate, lo, hi)
    idx = local * block + lane
    mask = lane < left
    if not pointer_select:
      def load(k):
        return tuple(pltriton.load(r.at[idx], mask=mask, other=jnp.asarray(pad, r.dtype))
                     for r, pad in zip(ins_of(k), op.pads))

      ins = owner_value(pid, call.starts, load, lo, hi)
    h = read_hyper(h_ref, op.hyper)
    h.update(zip(op.leaf_hyper, leaf_values))
    results, sources = block_math(run_op, h, ins, [r.dtype for r in outs_of(lo)],
                                  idx.astype(jnp.uint32) if op.indexed else None)

    if not n_out:  # a pass that only measures: its block sums are all it writes
      pass
    elif pointer_select:
      leaf_table.store(pid, call.starts[lo:hi + 1], [outs_of(k) for k in range(lo, hi)], idx,
                       mask, results, owner=owner)
    else:
      def store(k):
        for r, y in zip(outs_of(k), results):
          pltriton.store(r.at[idx], y, mask=mask)

      for_owner(pid, call.starts, store, lo, hi)
    for r, x in zip(norm_refs, sources):
      x = jnp.where(mask, x, 0.0)
      r[...] = jnp.sum(x * x)[None]  # the block's sum of squares, 4 bytes

  signatures = [tuple(jnp.dtype(r.dtype) for r in (*ins_of(k), *outs_of(k)))
                for k in range(leaves)]
  runs = dtype_runs(signatures)
  bounds = [call.starts[lo] for lo, _ in runs] + [call.starts[-1]]

  def body():
    for_owner(pid, bounds, lambda r: run(*runs[r]))

  if skip:  # a skipped step leaves every (in-place) buffer as it was: no loads, no stores
    pl.when(read_hyper(h_ref, op.hyper).finite > 0)(body)
  else:
    body()


def grouped_call(op: ElementwiseOp, hvec: jax.Array, leaves: Sequence[Sequence[jax.Array]],
                 out_dtypes: Sequence[Sequence], call: GroupedCall, *, platform: str,
                 tiling: Tiling, aliases: Sequence[Mapping[int, int]]):
  """Runs ``op`` over ``leaves`` (each a tuple of equal-size arrays) in one launch.

  Args:
    op: the rule and its wiring (``op.pads``: what masked-out lanes read).
    hvec: the traced hyper-parameter vector: ``f32[NHP]``, followed (for an op with
      ``leaf_hyper``) by each leaf's values (:func:`~optirs_jax.pallas.op.with_leaf_values`).
    leaves: per leaf of ``call``, the rule's inputs (any shape; read flat).
    out_dtypes: per leaf, the dtype of each rule output.
    call: the launch's plan (block size, each leaf's programs).
    platform: ``"cuda"`` or ``"interpret"``.
    tiling: the 1-D geometry (``tiling.block_elems`` must be ``call.block_elems``).
    aliases: per leaf, ``{input position: output position}`` updated in place.

  Returns:
    ``(outs, partials)``: per leaf a tuple of flat outputs, and per norm source an
    ``f32[call.num_blocks]`` of each block's sum of squares (:func:`segment_totals` adds
    them up per leaf).
  """
  if call.block_elems != tiling.block_elems:
    raise ValueError(f"{call.block_elems=} does not match the tiling's {tiling.block_elems}")
  # Flat leaves pass as they are: a no-op reshape still costs the trace ~30 us per buffer.
  operands = [x if x.ndim == 1 else x.reshape(-1) for leaf in leaves for x in leaf]
  launch = _launch(op, tuple(tuple(d) for d in out_dtypes), _by_sizes(call), tiling, platform,
                   tuple(tuple(sorted(a.items())) for a in aliases))
  results = launch(hvec, *operands)
  n_norms = len(op.norm_inputs) + len(op.norm_outputs)
  n_out = len(out_dtypes[0])
  data = results[:len(results) - n_norms]
  outs = [tuple(data[k * n_out:(k + 1) * n_out]) for k in range(len(call.leaves))]
  partials = list(results[len(results) - n_norms:])
  return outs, partials


def _by_sizes(call: GroupedCall) -> GroupedCall:
  """``call`` with its leaves numbered 0, 1, ...: a launch depends on the leaves' sizes, not
  on which leaves of the tree they are, so a tree whose leaves repeat (the blocks of a
  transformer) traces each distinct launch once."""
  return dataclasses.replace(call, leaves=tuple(range(len(call.sizes))))


@functools.lru_cache(maxsize=256)
def _launch(op, out_dtypes, call, tiling, platform, aliases):
  """One jitted launch per distinct configuration (the step's program calls it)."""
  n_out = len(out_dtypes[0])
  n_norms = len(op.norm_inputs) + len(op.norm_outputs)

  def launch(hvec, *operands):
    n_in = len(operands) // len(call.sizes)
    hvec, *operands = vary_alike([hvec, *operands])  # inside shard_map: vary as inputs do
    out_shape = [out_struct(operands[k * n_in], (size,), dt)
                 for k, (size, dts) in enumerate(zip(call.sizes, out_dtypes)) for dt in dts]
    out_shape += [out_struct(operands[0], (call.num_blocks,), jnp.float32)] * n_norms
    whole = pl.BlockSpec()
    io_aliases = {1 + k * n_in + i: k * n_out + o
                  for k, alias in enumerate(aliases) for i, o in alias}
    skip = op.skips_in_place([dict(a) for a in aliases], n_out)
    return pl.pallas_call(
        functools.partial(_body, op=op, call=call, n_in=n_in, n_out=n_out, skip=skip,
                          pointer_select=POINTER_SELECT and (
                            leaf_table.AVAILABLE or platform == "interpret")),
        out_shape=tuple(out_shape),
        grid=(call.num_blocks,),
        in_specs=[pl.BlockSpec(hvec.shape, lambda i: (0,))] + [whole] * len(operands),
        out_specs=tuple([whole] * (len(out_shape) - n_norms)
                        + [pl.BlockSpec((1,), lambda i: (i,))] * n_norms),
        input_output_aliases=io_aliases,
        interpret=platform == "interpret",
        compiler_params=compiler_params(platform, tiling),
        name=op.name,
    )(hvec, *operands)

  return jax.jit(launch)


# Block sums one program of segment_totals adds (64 KB, contiguous): a leaf of B blocks
# takes ceil(B / 4096) programs, so the largest leaf is spread over the device (one program
# per leaf took 0.2 ms on GPT-2's embedding of 37.7K blocks).
SEGMENT_ROWS = 4096


def _segment_body(bounds_ref, *refs, calls: Sequence[GroupedCall], n_src: int):
  src_refs, out_refs = refs[:len(calls) * n_src], refs[len(calls) * n_src:]
  leaf, part = pl.program_id(0), pl.program_id(1)
  # The leaf's blocks in its launch's partial sums: rows bounds[leaf] to bounds[leaf + n] - 1.
  n = sum(len(c.sizes) for c in calls)
  first = bounds_ref[leaf] + part * SEGMENT_ROWS
  rows = first + jnp.arange(SEGMENT_ROWS, dtype=jnp.int32)
  mask = rows < bounds_ref[leaf + n]

  def add(c):
    for src, out in zip(src_refs[c * n_src:(c + 1) * n_src], out_refs):
      out[...] = jnp.sum(pltriton.load(src.at[rows], mask=mask, other=0.0))[None]

  # Only the branch that picks the launch's buffers depends on the leaf: the code does not
  # grow with the number of leaves.
  offsets = tuple(itertools.accumulate((len(c.sizes) for c in calls), initial=0))
  for_owner(leaf, offsets, add)


def segment_totals(partials: Sequence[Sequence[jax.Array]], calls: Sequence[GroupedCall], *,
                   platform: str) -> list[jax.Array]:
  """Per leaf of ``calls``, the total of its blocks' partial sums, in one launch.

  Args:
    partials: per grouped launch, per norm source, its ``f32[call.num_blocks]`` of block
      sums.
    calls: the grouped launches that wrote them (leaf ``k`` of a launch owns blocks
      ``starts[k]`` to ``starts[k + 1] - 1``).
    platform: ``"cuda"`` or ``"interpret"``.

  Returns:
    Per norm source an ``f32[leaves]``, the leaves of ``calls[0]`` first. Program ``(k, j)``
    adds the ``j``-th run of ``SEGMENT_ROWS`` block sums of leaf ``k`` (zero past its end;
    each leaf's bounds are read from a small table, so one program serves every leaf),
    then one small reduction adds each leaf's runs. Every sum is in a fixed order, so the
    totals do not depend on the order programs run in; the step holds no scatter.
  """
  n_src = len(partials[0]) if partials else 0
  if not n_src:
    return []
  if len(partials) != len(calls) or any(len(p) != n_src for p in partials):
    raise ValueError(f"need {n_src} partial sums for each of {len(calls)} launches, got "
                     f"{[len(p) for p in partials]}")
  launch = _segment_launch(tuple(_by_sizes(c) for c in calls), n_src, platform)
  return list(launch(*(x for p in partials for x in p)))


@functools.lru_cache(maxsize=256)
def _segment_launch(calls: tuple[GroupedCall, ...], n_src: int, platform: str):
  """One jitted launch per distinct plan (the repeated steps of a tree share it)."""
  n = sum(len(c.sizes) for c in calls)
  runs = max(-(-(b - a) // SEGMENT_ROWS) for c in calls for a, b in itertools.pairwise(c.starts))
  bounds = np.array([c.starts[k] for c in calls for k in range(len(c.sizes))]
                    + [c.starts[k + 1] for c in calls for k in range(len(c.sizes))], np.int32)

  def launch(*partials):
    table, *partials = vary_alike([jnp.asarray(bounds), *partials])
    out_shape = tuple(out_struct(partials[0], (n * runs,), jnp.float32) for _ in range(n_src))
    totals = pl.pallas_call(
        functools.partial(_segment_body, calls=calls, n_src=n_src),
        out_shape=out_shape,
        grid=(n, runs),
        in_specs=[pl.BlockSpec()] * (1 + len(partials)),
        out_specs=tuple(pl.BlockSpec((1,), lambda k, j: (k * runs + j,)) for _ in out_shape),
        interpret=platform == "interpret",
        compiler_params=compiler_params(platform, Tiling(1, num_warps=4)),
        name="segment_totals",
    )(table, *partials)
    return tuple(t if runs == 1 else jnp.sum(t.reshape(n, runs), axis=1) for t in totals)

  return jax.jit(launch)

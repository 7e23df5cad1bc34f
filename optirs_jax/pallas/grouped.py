"""A grouped kernel: one launch updates many leaves, each in its own buffers, no packing.

The launch takes every leaf's operands as separate whole-array arguments (a compile-time
table of buffers, planned by :func:`optirs_jax.planning.layout.plan_grouped_calls`). Its
grid has one program per 1-D block of every leaf; program ``i`` finds the leaf that owns it
by a binary search over the static block offsets (:func:`for_owner`: nested branches, only
the owner's body runs), loads its block with a mask past the leaf's end, calls the op's rule
and stores the results masked. Nothing is concatenated before the step or sliced after it,
and leaves of any size or dtype share a launch, so a tree of many leaves costs a few
launches and no copies; the state and, on the fused apply, the params are updated in place.
Per-leaf norms: each program writes its block's sum of squares, and
:func:`segment_totals` adds them per leaf in one more launch.

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
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from optirs_jax.pallas.kernel import compiler_params
from optirs_jax.pallas.op import (
  LANES,
  ElementwiseOp,
  block_math,
  partial_sum_of_squares,
  read_hyper,
)
from optirs_jax.pallas.options import Tiling
from optirs_jax.pallas.sharding import out_struct, vary_alike
from optirs_jax.planning.layout import GroupedCall


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


def _body(h_ref, *refs, op: ElementwiseOp, call: GroupedCall, n_in: int, n_out: int):
  leaves = len(call.sizes)
  in_refs = refs[:leaves * n_in]
  out_refs = refs[leaves * n_in:leaves * (n_in + n_out)]
  norm_refs = refs[leaves * (n_in + n_out):]
  block = call.block_elems
  pid = pl.program_id(0)

  def leaf(k):
    h = read_hyper(h_ref, op.hyper, op.leaf_hyper, k)
    idx = (pid - call.starts[k]) * block + jnp.arange(block)
    mask = idx < call.sizes[k]
    ins = [pltriton.load(r.at[idx], mask=mask, other=jnp.asarray(pad, r.dtype))
           for r, pad in zip(in_refs[k * n_in:(k + 1) * n_in], op.pads)]
    outs = out_refs[k * n_out:(k + 1) * n_out]
    results, sources = block_math(op, h, ins, [r.dtype for r in outs],
                                  idx.astype(jnp.uint32) if op.indexed else None)
    for r, y in zip(outs, results):
      pltriton.store(r.at[idx], y, mask=mask)
    for r, x in zip(norm_refs, sources):
      r[...] = partial_sum_of_squares(jnp.where(mask, x, 0.0))

  for_owner(pid, call.starts, leaf)


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
    ``f32[call.num_blocks, 1, LANES]`` whose lane 0 holds each block's sum of squares
    (:func:`segment_totals` adds them up per leaf).
  """
  if call.block_elems != tiling.block_elems:
    raise ValueError(f"{call.block_elems=} does not match the tiling's {tiling.block_elems}")
  operands = [x.reshape(-1) for leaf in leaves for x in leaf]
  # The launch depends on the leaves' sizes, not on which leaves of the tree they are: a
  # tree whose leaves repeat (the blocks of a transformer) traces each distinct launch once.
  call = dataclasses.replace(call, leaves=tuple(range(len(call.leaves))))
  launch = _launch(op, tuple(tuple(d) for d in out_dtypes), call, tiling, platform,
                   tuple(tuple(sorted(a.items())) for a in aliases))
  results = launch(hvec, *operands)
  n_norms = len(op.norm_inputs) + len(op.norm_outputs)
  n_out = len(out_dtypes[0])
  data = results[:len(results) - n_norms]
  outs = [tuple(data[k * n_out:(k + 1) * n_out]) for k in range(len(call.leaves))]
  partials = list(results[len(results) - n_norms:])
  return outs, partials


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
    out_shape += [out_struct(operands[0], (call.num_blocks, 1, LANES), jnp.float32)] * n_norms
    whole = pl.BlockSpec()
    io_aliases = {1 + k * n_in + i: k * n_out + o
                  for k, alias in enumerate(aliases) for i, o in alias}
    return pl.pallas_call(
        functools.partial(_body, op=op, call=call, n_in=n_in, n_out=n_out),
        out_shape=tuple(out_shape),
        grid=(call.num_blocks,),
        in_specs=[pl.BlockSpec(hvec.shape, lambda i: (0,))] + [whole] * len(operands),
        out_specs=tuple([whole] * (len(out_shape) - n_norms)
                        + [pl.BlockSpec((None, 1, LANES), lambda i: (i, 0, 0))] * n_norms),
        input_output_aliases=io_aliases,
        interpret=platform == "interpret",
        compiler_params=compiler_params(platform, tiling),
        name=op.name,
    )(hvec, *operands)

  return jax.jit(launch)


# Block sums one program of segment_totals adds: a leaf of B blocks takes ceil(B / 1024)
# programs, so the largest leaf is spread over the device (one program per leaf took
# 0.2 ms on GPT-2's embedding of 37.7K blocks).
SEGMENT_ROWS = 1024


def _segment_body(*refs, call: GroupedCall, n_src: int):
  src_refs, out_refs = refs[:n_src], refs[n_src:]
  leaf, part = pl.program_id(0), pl.program_id(1)
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1)

  def add(k):
    rows = call.starts[k] + part * SEGMENT_ROWS + jnp.arange(SEGMENT_ROWS)
    mask = rows < call.starts[k + 1]
    for src, out in zip(src_refs, out_refs):
      total = jnp.sum(pltriton.load(src.at[rows * LANES], mask=mask, other=0.0))
      out[...] = jnp.where(lane == 0, total, 0.0)

  for_owner(leaf, tuple(range(len(call.sizes) + 1)), add)


def segment_totals(partials: Sequence[jax.Array], call: GroupedCall, *, platform: str
                   ) -> list[jax.Array]:
  """Per leaf of ``call``, the total of its blocks' partial sums.

  Args:
    partials: per norm source, the grouped launch's ``f32[call.num_blocks, 1, LANES]``
      (each block's sum in lane 0).
    call: the grouped launch that wrote them (leaf ``k`` owns blocks ``starts[k]`` to
      ``starts[k + 1] - 1``).
    platform: ``"cuda"`` or ``"interpret"``.

  Returns:
    Per norm source an ``f32[len(call.sizes)]``. One launch: program ``(k, j)`` adds the
    ``j``-th run of ``SEGMENT_ROWS`` block sums of leaf ``k`` (zero past its end), then
    one small reduction adds each leaf's runs. Every sum is in a fixed order, so the
    totals do not depend on the order programs run in; the step holds no scatter.
  """
  if not partials:
    return []
  call = dataclasses.replace(call, leaves=tuple(range(len(call.sizes))))
  return list(_segment_launch(call, len(partials), platform)(*partials))


@functools.lru_cache(maxsize=256)
def _segment_launch(call: GroupedCall, n_src: int, platform: str):
  """One jitted launch per distinct plan (the repeated calls of a many-leaf tree share it)."""
  n = len(call.sizes)
  runs = max(-(-(b - a) // SEGMENT_ROWS) for a, b in itertools.pairwise(call.starts))

  def launch(*partials):
    flat = vary_alike([p.reshape(-1) for p in partials])  # lane 0 of row b: element b * LANES
    out_shape = tuple(out_struct(flat[0], (n * runs, 1, LANES), jnp.float32) for _ in flat)
    totals = pl.pallas_call(
        functools.partial(_segment_body, call=call, n_src=n_src),
        out_shape=out_shape,
        grid=(n, runs),
        in_specs=[pl.BlockSpec()] * n_src,
        out_specs=tuple(pl.BlockSpec((None, 1, LANES), lambda k, j: (k * runs + j, 0, 0))
                        for _ in flat),
        interpret=platform == "interpret",
        compiler_params=compiler_params(platform, Tiling(1, num_warps=4)),
        name="segment_totals",
    )(*flat)
    return tuple(t[:, 0, 0] if runs == 1 else jnp.sum(t[:, 0, 0].reshape(n, runs), axis=1)
                 for t in totals)

  return jax.jit(launch)

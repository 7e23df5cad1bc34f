"""The launcher of block-wise 8-bit steps: every leaf of one format and block size in grouped
launches, one program per quantization block.

A leaf whose (local) last axis is a whole number of blocks is read flat: program ``i`` of a
launch finds the leaf owning it by the leaf table's search over the static block offsets
(:mod:`optirs_jax.pallas.leaf_table`, as :mod:`optirs_jax.pallas.grouped`'s float launches
do), loads its block of each operand and one scale per 8-bit field, runs the caller's
``step`` on the block and stores the results through the pointers the search found. GPT-2
small's 50 large leaves are five launches instead of fifty, each program the same work
(on an H100, ``adamw8bit`` 0.886 ms a launch a leaf, 0.768 grouped: run 75). Both 8-bit
kernels use it: the spec builder's (:mod:`._quantized_kernel`) and 8-bit Adam's
(:mod:`optirs_jax.quantization._kernel8`). Also the constants' vector both carry (the dynamic
maps' coder tables after the step's scalars) and where a leaf's step runs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from optirs_jax.formats.codes import SIGNED_BITS, UNSIGNED_BITS, coder_table, coder_table_size
from optirs_jax.pallas import leaf_table, sharding
from optirs_jax.pallas.grouped import dtype_runs, for_owner
from optirs_jax.pallas.kernel import compiler_params
from optirs_jax.pallas.op import NHP
from optirs_jax.pallas.options import Tiling
from optirs_jax.planning.layout import (
  MAX_GROUPED_LEAF_ELEMENTS,
  GroupedCall,
  plan_grouped_calls,
)


def rows_per_program(num_blocks: int, most: int) -> int:
  """The largest power of two up to ``most`` and ``num_blocks`` (Triton blocks are powers
  of two)."""
  return max(1, min(1 << (most.bit_length() - 1), 1 << (num_blocks.bit_length() - 1)))


def with_tables(hvec: jax.Array) -> jax.Array:
  """A step's vector: its ``NHP`` scalars, then the signed and unsigned dynamic maps'
  coder tables (:func:`~optirs_jax.formats.codes.coder_table`: constants carried in the
  one operand every call takes, so a partitioned call captures no constant)."""
  return jnp.concatenate([hvec[:NHP], coder_table(SIGNED_BITS), coder_table(UNSIGNED_BITS)])


def tables_of(hvec) -> tuple[jax.Array, jax.Array]:
  """``(signed map, unsigned map)`` coder tables of a :func:`with_tables` vector."""
  n, m = coder_table_size(SIGNED_BITS), coder_table_size(UNSIGNED_BITS)
  return hvec[NHP:NHP + n], hvec[NHP + n:NHP + n + m]


def kernel_place(leaf, block_size: int, platform: str) -> str:
  """Where a leaf's block-wise step runs on ``platform`` (``"cuda"``, ``"interpret"`` or
  ``"jnp"``; ``leaf``: its equal-shape arrays and scales, the first shaped as the leaf): in
  its kernel where its (local) last axis is a whole number of blocks, else ``"jnp"`` (a
  scalar or empty leaf; a short last block; on CUDA a block that is not a power of two, as
  Triton's blocks are, where a row of one short block reads as a block of the row's length;
  in interpret mode a leaf varying inside a ``shard_map``, whose axes Pallas' interpreter
  cannot check)."""
  first = leaf[0]
  if platform == "interpret" and any(sharding.varying_axes(x) for x in leaf):
    return "jnp"
  if (platform == "jnp" or first.ndim == 0 or first.size == 0 or first.shape[-1] % block_size
      or (platform == "cuda" and block_size & (block_size - 1))):
    return "jnp"
  return platform


def grouped_members(leaves, places, *, grouped: bool, tiling: Tiling) -> list[int]:
  """The leaves (positions) that share grouped launches: with ``grouped`` and one block a
  program, every kernel leaf (``places``: :func:`kernel_place`'s) but one past the grouped
  launch's 32-bit element indices, which takes a launch of its own."""
  if not grouped or tiling.block_rows != 1:
    return []
  return [i for i, w in enumerate(places)
          if w != "jnp" and leaves[i][0].size <= MAX_GROUPED_LEAF_ELEMENTS]


def _grouped_body(h_ref, *refs, step, call: GroupedCall, n_fields: int, n_extras: int,
                  n_tail: int, n_tables: int):
  leaves, bs = len(call.sizes), call.block_elems
  n_in, n_out = 1 + 2 * n_fields + n_extras, 1 + 2 * n_fields + n_tail
  ins, rest = refs[:leaves * n_in], refs[leaves * n_in:]
  tables = tuple(rest[:n_tables]) if n_tables else (None, None)
  outs = rest[n_tables:]
  ins_of = lambda k: ins[k * n_in:(k + 1) * n_in]
  outs_of = lambda k: outs[k * n_out:(k + 1) * n_out]
  scales = [2 + 2 * k for k in range(n_fields)]  # the fields' scales, in and out
  data = [j for j in range(n_out) if j not in scales]
  pid = pl.program_id(0)
  lane = jnp.arange(bs, dtype=jnp.int32)

  def run(lo: int, hi: int):
    # One search finds the leaf's pointers; its block of each operand (one scale a field).
    local, _, vals, owner = leaf_table.load(
      pid, call.starts[lo:hi + 1], call.sizes[lo:hi], bs, [ins_of(k) for k in range(lo, hi)],
      [0] * n_in, outs=[outs_of(k) for k in range(lo, hi)],
      widths=[1 if j in scales else bs for j in range(n_in)])
    idx = local * bs + lane
    # The block stays 1-D ([bs] values, [1] scales): a reshape to [1, bs] had Triton
    # convert the codes' layouts through shared memory.
    out, new, tail = step(
      h_ref, vals[0], [(vals[1 + 2 * k], vals[2 + 2 * k]) for k in range(n_fields)],
      vals[1 + 2 * n_fields:], tables, idx.astype(jnp.uint32),
      (outs_of(lo)[0].dtype, *(r.dtype for r in outs_of(lo)[n_out - n_tail:])))
    results = [out, *(x for pair in new for x in pair), *tail]
    starts = call.starts[lo:hi + 1]
    rows = lambda cols: [[outs_of(k)[j] for j in cols] for k in range(lo, hi)]
    # Every block is whole (the leaves' last axes are whole numbers of blocks): no lane is
    # masked, and each scale is the element ``local`` of its field's scales.
    leaf_table.store(pid, starts, rows(data), idx, lane < bs, [results[j] for j in data],
                     owner=owner)
    leaf_table.store(pid, starts, rows(scales), local[None], jnp.ones(1, bool),
                     [results[j] for j in scales], owner=owner)

  signatures = [tuple(jnp.dtype(r.dtype) for r in (*ins_of(k), *outs_of(k)))
                for k in range(leaves)]
  runs = dtype_runs(signatures)
  for_owner(pid, [call.starts[lo] for lo, _ in runs] + [call.starts[-1]],
            lambda r: run(*runs[r]))


def grouped_blocks(step, hvec, leaves, out_dtypes, *, n_fields: int, fmt: str,
                   block_size: int, platform: str, tiling: Tiling, max_buffers: int,
                   in_place, name: str):
  """Leaves ``(g, codes, scales, ... per field, *extras)`` whose (local) last axes are whole
  numbers of blocks, in grouped launches (:mod:`optirs_jax.pallas.grouped`'s design: one
  program per quantization block of every leaf, which finds its leaf by a search over the
  static block offsets, :mod:`optirs_jax.pallas.leaf_table`): per leaf ``(out, codes,
  scales, ... per field, *tail)`` (``out_dtypes``: per leaf, those outputs' dtypes).

  Each program runs ``step(h_ref, g, fields, extras, tables, index, dtypes)`` on its block:
  ``[block]`` arrays and per field ``(codes [block], scale [1])``; ``tables``: the dynamic
  map's coder tables (refs), ``index``: the elements' ``uint32`` indices in the leaf,
  ``dtypes``: the first output's and the tail's. It returns ``(out, [(codes, scale) per
  field], [tail])``. ``in_place(extras, dtypes)``: a leaf's ``{input: output}`` positions
  (among its operands and outputs: the inputs ``(g, codes and scales per field,
  *extras)``, the outputs ``(out, codes and scales per field, *tail)``) updated in place;
  ``max_buffers``: operand buffers a launch holds at most."""
  n_in = len(leaves[0])
  n_out = len(out_dtypes[0])
  n_extras, n_tail = n_in - 1 - 2 * n_fields, n_out - 1 - 2 * n_fields
  tables = tables_of(hvec) if fmt == "dynamic8" else ()
  calls = plan_grouped_calls([leaf[0].size for leaf in leaves], block_elems=block_size,
                             operands_per_leaf=n_in + n_out,
                             max_pointers=max(n_in + n_out, max_buffers - len(tables)))
  results: list = [None] * len(leaves)
  for call in calls:
    members = [leaves[i] for i in call.leaves]
    dts = [out_dtypes[i] for i in call.leaves]
    flat = [x.reshape(-1) for leaf in members for x in leaf]
    hv, *rest = sharding.vary_alike((hvec, *flat, *tables))
    flat, tabs = rest[:len(flat)], rest[len(flat):]
    out_shape = [sharding.out_struct(flat[k * n_in], (x.size,), dt)
                 for k, (leaf, dt_row) in enumerate(zip(members, dts))
                 for x, dt in zip((leaf[0], *leaf[1:1 + 2 * n_fields], *([leaf[0]] * n_tail)),
                                  dt_row)]
    aliases = {}
    for k, leaf in enumerate(members):
      for i, o in in_place(leaf[1 + 2 * n_fields:], dts[k]).items():
        aliases[1 + k * n_in + i] = k * n_out + o
    whole = pl.BlockSpec()
    got = pl.pallas_call(
        functools.partial(_grouped_body, step=step, call=call, n_fields=n_fields,
                          n_extras=n_extras, n_tail=n_tail, n_tables=len(tabs)),
        out_shape=tuple(out_shape),
        grid=(call.num_blocks,),
        in_specs=([pl.BlockSpec((NHP,), lambda i: (0,))] + [whole] * len(flat)
                  + [pl.BlockSpec(t.shape, lambda i: (0,)) for t in tabs]),
        out_specs=tuple([whole] * len(out_shape)),
        input_output_aliases=aliases,
        interpret=platform == "interpret",
        compiler_params=compiler_params(platform, tiling),
        name=name,
    )(hv, *flat, *tabs)
    for k, i in enumerate(call.leaves):
      leaf = leaves[i]
      shapes = (leaf[0].shape, *(x.shape for x in leaf[1:1 + 2 * n_fields]),
                *([leaf[0].shape] * n_tail))
      results[i] = tuple(y.reshape(shape) for y, shape in
                         zip(got[k * n_out:(k + 1) * n_out], shapes))
  return results

r"""Quantized state inside the kernel: decode, the optimizer's rule and encode in one pass.

For a leaf whose every rule field is stored block-wise in 8 bits (:mod:`._quantized`), one
Pallas program per ``tiling.block_rows`` quantization blocks reads the gradient, each
field's codes and block scales (and the params, where the rule reads them), decodes the
fields, runs the optimizer's elementwise rule (the same op the float kernels run), and
writes the update (or, on the fused apply, the new params) and each field's new codes and
scales (and, with master weights, reads the half-precision gradient and the float32 master
and writes the master back in place):

.. math::
  (u, s'_1, \dots, s'_n) = \mathrm{rule}(g, D(s_1), \dots, D(s_n), p), \qquad
  s_k \leftarrow Q(s'_k)

block by block, ``D``/``Q`` the format's decode and nearest-code encode (the dynamic map's
by its tables, read from the kernel's operands; ``float8_e4m3fn``'s by one conversion). So a
field costs its 8-bit codes (and 4 bytes per block) each way instead of a float32 read and
write plus an XLA decode and encode around the kernel: Lion moves 4 + 4 + 2 + 4 = 14 bytes
per parameter on the fused apply instead of 20.

The leaves whose (local) last axis is a whole number of blocks run in grouped launches
(:func:`~._quantized_launch.grouped_blocks`: one program per quantization block of every
leaf of a launch); ``ExecutorOptions.large_leaf_policy="in-place"``, or more than one block
a program, gives each leaf its own launch on ``[blocks, block_size]`` rows instead (the same
numbers). On each device a leaf's own shard (:func:`optirs_jax.pallas.sharding.run_local`);
other leaves, and other platforms, run the same math in jnp on the whole leaf.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax.numpy as jnp
from jax.experimental import pallas as pl

from optirs_jax.formats.blockwise import (
  Quantized8bit,
  as_row_blocks,
  dequantize_blocks,
  from_row_blocks,
  quantize_blocks,
)
from optirs_jax.pallas import lazy_branches, sharding
from optirs_jax.pallas.kernel import block_index, compiler_params
from optirs_jax.pallas.op import NHP, ElementwiseOp, block_math, hyper_vector, read_hyper
from optirs_jax.pallas.options import Tiling
from optirs_jax.transforms._quantized_launch import (
  grouped_blocks,
  grouped_members,
  kernel_place,
  rows_per_program,
  tables_of,
  with_tables,
)


def block_step(op: ElementwiseOp, h, g, fields, extras, out_dtypes, *,
               signed: Sequence[bool], fmt: str, tables=(None, None), index=None,
               coder: str = "table"):
  """Blocks in, blocks out: ``(out, [(codes, absmax) per field], [tail outputs])``.
  ``fields``: each field's ``(codes [..., block], absmax [..., 1])``; ``out_dtypes``: the
  first output's dtype, then those of the outputs after the fields (the float32 master
  copy, in master mode); ``signed``: per field, whether it is stored on the signed map;
  ``tables``: the signed and unsigned maps' coder tables (arrays or a kernel's refs;
  None builds them); ``coder``: how the dynamic map's coders read them."""
  table = lambda s: tables[0] if s else tables[1]
  n = len(fields)
  decoded = [dequantize_blocks(c, a, table(s), coder) for (c, a), s in zip(fields, signed)]
  outs, _ = block_math(op, h, [g, *decoded, *extras],
                       [out_dtypes[0]] + [jnp.float32] * n + list(out_dtypes[1:]), index)
  new = [quantize_blocks(x, signed=s, fmt=fmt, table=table(s), coder=coder)
         for x, s in zip(outs[1:1 + n], signed)]
  return outs[0], new, list(outs[1 + n:])


def _body(h_ref, *refs, op: ElementwiseOp, n_fields: int, n_extras: int, signed, fmt: str,
          n_tables: int, coder: str):
  g_ref = refs[0]
  field_refs = refs[1:1 + 2 * n_fields]
  extra_refs = refs[1 + 2 * n_fields:1 + 2 * n_fields + n_extras]
  rest = refs[1 + 2 * n_fields + n_extras:]
  tables = tuple(rest[:n_tables]) if n_tables else (None, None)
  o_ref, *outs = rest[n_tables:]
  field_out, tail_out = outs[:2 * n_fields], outs[2 * n_fields:]
  index = None
  if op.indexed:  # the element's index in its (local) leaf: whole rows per program
    shape = g_ref.shape
    index = block_index(shape, pl.program_id(0) * shape[0] * shape[1])
  out, new, tail = block_step(
      op, read_hyper(h_ref, op.hyper), g_ref[...],
      [(field_refs[2 * k][...], field_refs[2 * k + 1][...]) for k in range(n_fields)],
      [r[...] for r in extra_refs], (o_ref.dtype, *(r.dtype for r in tail_out)),
      signed=signed, fmt=fmt, tables=tables, index=index, coder=coder)
  o_ref[...] = out
  for k, (c, a) in enumerate(new):
    field_out[2 * k][...] = c
    field_out[2 * k + 1][...] = a
  for r, x in zip(tail_out, tail):
    r[...] = x


def _rows(op, hvec, g, fields, extras, out_dtypes, *, signed, fmt, platform: str,
          tiling: Tiling, coder: str):
  """One leaf's kernel on ``[blocks, block_size]`` views (``fields``' scales
  ``[blocks, 1]``): ``(out, [(codes, absmax) per field], [tail outputs])``. The outputs
  take the buffers of the extras the op aliases them to (of one dtype): the first output
  the params' on the fused apply, a tail output the master copy's."""
  n = len(fields)
  flat_fields = [x for f in fields for x in f]
  tables = tables_of(hvec) if fmt == "dynamic8" else ()
  hvec, g, *rest = sharding.vary_alike((hvec, g, *flat_fields, *extras, *tables))
  flat_fields, extras, tables = rest[:2 * n], rest[2 * n:2 * n + len(extras)], rest[
      2 * n + len(extras):]
  nb, bs = g.shape
  rows = rows_per_program(nb, tiling.block_rows)
  programs = nb // rows
  row_spec = pl.BlockSpec((rows, bs), lambda i: (i, 0))
  col_spec = pl.BlockSpec((rows, 1), lambda i: (i, 0))
  field_specs = [row_spec, col_spec] * n
  out_dtype, tail_dtypes = out_dtypes[0], out_dtypes[1:]
  out_shape = [sharding.out_struct(g, g.shape, out_dtype)]
  for k in range(n):
    out_shape += [sharding.out_struct(g, g.shape, flat_fields[2 * k].dtype),
                  sharding.out_struct(g, (nb, 1), jnp.float32)]
  out_shape += [sharding.out_struct(g, g.shape, dt) for dt in tail_dtypes]
  # Operand positions count the vector first.
  aliases = {1 + i: o for i, o in _in_place_aliases(
    op, n, extras, [x.dtype for x in out_shape]).items()}
  results = pl.pallas_call(
      functools.partial(_body, op=op, n_fields=n, n_extras=len(extras), signed=tuple(signed),
                        fmt=fmt, n_tables=len(tables), coder=coder),
      out_shape=tuple(out_shape),
      grid=(programs,),
      in_specs=([pl.BlockSpec((NHP,), lambda i: (0,)), row_spec] + field_specs
                + [row_spec] * len(extras)
                + [pl.BlockSpec(t.shape, lambda i: (0,)) for t in tables]),
      out_specs=tuple([row_spec] + field_specs + [row_spec] * len(tail_dtypes)),
      input_output_aliases=aliases,
      interpret=platform == "interpret",
      compiler_params=compiler_params(platform, tiling),
      name=f"{op.name}_{fmt}",
  )(hvec, g, *flat_fields, *extras, *tables)
  out, new = results[0], [(results[1 + 2 * k], results[2 + 2 * k]) for k in range(n)]
  tail = list(results[1 + 2 * n:])
  start = programs * rows
  if start == nb:
    return out, new, tail
  cut = lambda x: x[start:]
  index = block_index((nb - start, bs), start * bs) if op.indexed else None
  t_out, t_new, t_tail = block_step(
      op, read_hyper(hvec, op.hyper), cut(g),
      [(cut(flat_fields[2 * k]), cut(flat_fields[2 * k + 1])) for k in range(n)],
      [cut(x) for x in extras], out_dtypes, signed=signed, fmt=fmt, tables=tables_of(hvec),
      index=index, coder=coder)
  return (out.at[start:].set(t_out), [(c.at[start:].set(tc), a.at[start:].set(ta))
                                      for (c, a), (tc, ta) in zip(new, t_new)],
          [x.at[start:].set(t) for x, t in zip(tail, t_tail)])


def _in_place_aliases(op, n: int, extras, out_dtypes) -> dict[int, int]:
  """``{input: output}`` positions of a leaf's flat operands ``(g, codes and scales per
  field, *extras)`` and outputs ``(out, codes and scales per field, *tail)``: each field's
  codes and scales, and the extras the op aliases to its first output or its tail (of that
  output's dtype)."""
  aliases = {1 + j: 1 + j for j in range(2 * n)}
  # The op's own positions: inputs (g, *fields, *extras), outputs (u, *fields, *tail).
  for i, o in op.aliases:
    if i > n and (o == 0 or o > n):
      out = 0 if o == 0 else o + n
      if extras[i - n - 1].dtype == out_dtypes[out]:
        aliases[n + i] = out
  return aliases


def _op_step(h_ref, g, fields, extras, tables, index, out_dtypes, *, op: ElementwiseOp,
             signed, fmt: str, coder: str):
  """:func:`block_step` of ``op`` as :func:`grouped_blocks` calls its ``step``."""
  return block_step(op, read_hyper(h_ref, op.hyper), g, fields, extras, out_dtypes,
                    signed=signed, fmt=fmt, tables=tables,
                    index=index if op.indexed else None, coder=coder)


def _whole(op, hvec, g, fields, extras, out_dtypes, *, signed, fmt, block_size: int,
           coder: str):
  """One leaf in jnp: the fields decoded whole, the rule on the flat leaf, each new field
  encoded by rows of blocks (a last axis of part of a block included)."""
  tables = tables_of(hvec)
  table = lambda s: tables[0] if s else tables[1]
  decoded = [from_row_blocks(dequantize_blocks(as_row_blocks(c, block_size), a[..., None],
                                               table(s), coder), g.shape)
             for (c, a), s in zip(fields, signed)]
  flat = [x.reshape(-1) for x in (g, *decoded, *extras)]
  index = block_index(flat[0].shape) if op.indexed else None
  n = len(fields)
  outs, _ = block_math(op, read_hyper(hvec, op.hyper), flat,
                       [out_dtypes[0]] + [jnp.float32] * n + list(out_dtypes[1:]), index)
  new = []
  for x, s in zip(outs[1:1 + n], signed):
    c, a = quantize_blocks(as_row_blocks(x.reshape(g.shape), block_size), signed=s, fmt=fmt,
                           table=table(s), coder=coder)
    new.append((from_row_blocks(c, g.shape), a[..., 0]))
  return outs[0].reshape(g.shape), new, [x.reshape(g.shape) for x in outs[1 + n:]]


def _local(hvec, leaves, *, op, n_fields, signed, fmt, block_size, out_dtypes, platform,
           tiling, coder, grouped=False, max_buffers=0):
  """Leaves ``(g, codes, scales, ... per field, *extras)`` on this device's shards: per leaf
  ``(out, codes, scales, ... per field)``. A kernel where the (local) last axis is a whole
  number of blocks and a kernel platform runs (with ``grouped`` and one block a program,
  the grouped launches of :func:`grouped_blocks`; else one launch a leaf); the jnp math on the
  whole leaf elsewhere."""
  places = [kernel_place(leaf, block_size, platform) for leaf in leaves]
  outs: list = [None] * len(leaves)
  if idx := grouped_members(leaves, places, grouped=grouped, tiling=tiling):
    step = functools.partial(_op_step, op=op, signed=tuple(signed), fmt=fmt, coder=coder)
    got = grouped_blocks(step, hvec, [leaves[i] for i in idx], [out_dtypes[i] for i in idx],
                         n_fields=n_fields, fmt=fmt, block_size=block_size,
                         platform=platform, tiling=tiling, max_buffers=max_buffers,
                         in_place=functools.partial(_in_place_aliases, op, n_fields),
                         name=f"{op.name}_{fmt}_grouped")
    for i, r in zip(idx, got):
      outs[i] = r
  for i, (leaf, dts) in enumerate(zip(leaves, out_dtypes)):
    if outs[i] is not None:
      continue
    g, rest = leaf[0], leaf[1:]
    fields = [(rest[2 * k], rest[2 * k + 1]) for k in range(n_fields)]
    extras = rest[2 * n_fields:]
    if places[i] == "jnp":
      out, new, tail = _whole(op, hvec, g, fields, extras, (dts[0], *dts[1 + 2 * n_fields:]),
                              signed=signed, fmt=fmt, block_size=block_size, coder=coder)
    else:
      rows = lambda x: x.reshape(-1, block_size)
      out, new, tail = _rows(op, hvec, rows(g),
                             [(rows(c), a.reshape(-1, 1)) for c, a in fields],
                             [rows(x) for x in extras], (dts[0], *dts[1 + 2 * n_fields:]),
                             signed=signed, fmt=fmt, platform=places[i], tiling=tiling,
                             coder=coder)
      out = out.reshape(g.shape)
      new = [(c.reshape(g.shape), a.reshape(f[1].shape)) for (c, a), f in zip(new, fields)]
      tail = [x.reshape(g.shape) for x in tail]
    outs[i] = (out, *(x for pair in new for x in pair), *tail)
  return outs, [()] * len(leaves)


def execute(op: ElementwiseOp, h, leaves: Sequence[tuple], *, n_fields: int,
            signed: Sequence[bool], out_dtypes: Sequence, cuda: bool, other: str,
            tiling: Tiling, coder: str = "table", grouped: bool = True,
            max_buffers: int = 1512) -> list[tuple]:
  """Runs ``op`` on leaves whose ``n_fields`` rule fields are :class:`Quantized8bit`.

  Args:
    op: the float rule and its wiring (its inputs ``(g, *fields, *extras)``, its outputs
      ``(u, *fields, *tail)``: the tail, in master mode, the new float32 master copy).
    h: this step's scalars.
    leaves: per leaf ``(g, Quantized8bit per field, *extras)``, every field of a leaf in one
      format and block size.
    n_fields, signed: the quantized fields, and per field whether its map is signed.
    out_dtypes: per leaf, the dtypes of the rule's first output and of its tail.
    cuda: whether to trace the Triton kernel (for a step lowered for an NVIDIA GPU).
    other: how other platforms run it: ``"jnp"`` or ``"interpret"`` (Pallas' interpreter).
    tiling: quantization blocks per program and the Triton launch settings.
    coder: how the dynamic map's coders read their tables
      (``ExecutorOptions.dynamic_map_coder``: the same codes either way).
    grouped: whether the kernel leaves of one format and block size share grouped
      launches (at most ``max_buffers`` operand buffers each) rather than one launch
      each (the same numbers either way).

  Returns:
    Per leaf ``(out, Quantized8bit per field, *tail)``.
  """
  hvec = with_tables(hyper_vector(h, op.hyper))
  plans = [(leaf[1].block_size, leaf[1].codes.dtype) for leaf in leaves]
  flat = [(leaf[0], *(x for q in leaf[1:1 + n_fields] for x in q), *leaf[1 + n_fields:])
          for leaf in leaves]
  scales_in = tuple(2 + 2 * k for k in range(n_fields))

  def run(platform):  # every group of one block size and format: one run_local each
    def go(args):
      hvec, flat = args
      results: list = [None] * len(flat)
      for bs, dt in dict.fromkeys(plans):
        idx = [i for i, plan in enumerate(plans) if plan == (bs, dt)]
        fmt = "fp8" if dt == jnp.float8_e4m3fn else "dynamic8"
        dts = [(out_dtypes[i][0], *(x.dtype for x in flat[i][1:1 + 2 * n_fields]),
                *out_dtypes[i][1:]) for i in idx]
        local = functools.partial(_local, op=op, n_fields=n_fields, signed=tuple(signed),
                                  fmt=fmt, block_size=bs, out_dtypes=dts, platform=platform,
                                  tiling=tiling, coder=coder, grouped=grouped,
                                  max_buffers=max_buffers)
        outs, _ = sharding.run_local(local, hvec, [flat[i] for i in idx], dts, 0,
                                     blocked=sharding.Blocked(bs, scales_in, scales_in))
        for j, i in enumerate(idx):
          results[i] = outs[j]
      return results
    return go

  if cuda:  # the kernel's branch traced now, the other when lowered for another platform
    results = lazy_branches.platform_dependent((hvec, flat), cuda=run("cuda"),
                                               default=run(other))
  else:
    results = run(other)((hvec, flat))
  return [(r[0], *(Quantized8bit(r[1 + 2 * k], r[2 + 2 * k]) for k in range(n_fields)),
           *r[1 + 2 * n_fields:]) for r in results]

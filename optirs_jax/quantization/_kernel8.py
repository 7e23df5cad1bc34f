"""One pass of 8-bit Adam over a leaf's blocks: dequantize both moments, update, requantize,
and write the updates (or the new params) — as a Pallas kernel, or in jnp on whole leaves.

The leaves whose last axis is a whole number of blocks share grouped launches
(:func:`local_step`, through :func:`~optirs_jax.transforms._quantized_launch.grouped_blocks`:
one program per block of every leaf). With ``ExecutorOptions.large_leaf_policy="in-place"``
or more than one block a program, each leaf is its own launch (:func:`leaf_step`), viewed as
``[num_blocks, block_size]`` rows (a free reshape when its size is a multiple of the
block); a program takes ``rows_per_program`` whole rows, so each row's absmax is a reduction
inside one program, and rows past the last whole program are computed in jnp and written in
place.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from optirs_jax.formats.blockwise import (
  as_row_blocks,
  dequantize_blocks,
  from_row_blocks,
  quantize_blocks,
)
from optirs_jax.pallas import sharding
from optirs_jax.pallas.op import NHP, Hyper, read_hyper
from optirs_jax.pallas.options import DEFAULT_OPTIONS, Tiling
from optirs_jax.spec import apply_prologue, prologue_names
from optirs_jax.transforms._quantized_launch import (
  grouped_blocks,
  grouped_members,
  kernel_place,
  rows_per_program,
  tables_of,
  with_tables,
)

__all__ = ["HYPER", "adam_math", "block_step", "hyper_names", "leaf_step", "local_step",
           "rows_per_program", "tables_of", "with_tables"]

# The scalars of one step, in the order of the kernel's hyper-parameter vector
# (``pallas.op.hyper_vector(values, HYPER)``).
HYPER = ("b1", "c1", "b2", "c2", "eps", "bc1", "bc2", "wd", "neg_lr")


def hyper_names(prologue: tuple[str, ...] = ()) -> tuple[str, ...]:
  """The vector's names: Adam's, then those of the chain links folded in (``prologue``:
  their kinds, :data:`optirs_jax.spec.PROLOGUE_SCALARS`)."""
  return HYPER + prologue_names(prologue)


def adam_math(h: Hyper, p, g, mu, nu, *, l2: bool, decoupled: bool, prologue=()):
  r"""Adam on float32 arrays: ``(u, mu, nu)`` with ``u = -lr * (m̂ / (sqrt(v̂) + eps) [+ wd p])``
  (optax's order of operations; the links of ``prologue`` transform the gradient first, in
  its dtype, as optax's links before the optimizer do; ``l2`` then adds ``wd * p``)."""
  g = apply_prologue(prologue, h, g, p).astype(jnp.float32)
  if l2:
    g = g + h.wd * p
  mu = h.c1 * g + h.b1 * mu
  nu = h.c2 * (g * g) + h.b2 * nu
  u = (mu / h.bc1) / (jnp.sqrt(nu / h.bc2) + h.eps)
  if decoupled:
    u = u + h.wd * p
  return h.neg_lr * u, mu, nu


def block_step(h: Hyper, p, g, muc, mua, nuc, nua, out_dtype, *, l2, decoupled, fused,
               fmt: str = "dynamic8", tables=(None, None), prologue=(), coder="table"):
  """Blocks in, blocks out: ``(out, mu codes, mu absmax, nu codes, nu absmax)``, the
  moments requantized in ``fmt``; ``tables``: the signed and unsigned maps' coder tables
  (arrays or a kernel's refs; None builds them); ``coder``: how the coders read them."""
  p32 = p.astype(jnp.float32)
  st, ut = tables
  u, mu, nu = adam_math(h, p32, g, dequantize_blocks(muc, mua, st, coder),
                        dequantize_blocks(nuc, nua, ut, coder), l2=l2, decoupled=decoupled,
                        prologue=prologue)
  out = (p32 + u) if fused else u
  muc, mua = quantize_blocks(mu, signed=True, fmt=fmt, table=st, coder=coder)
  nuc, nua = quantize_blocks(nu, signed=False, fmt=fmt, table=ut, coder=coder)
  return out.astype(out_dtype), muc, mua, nuc, nua


def _body(h_ref, p_ref, g_ref, muc_ref, mua_ref, nuc_ref, nua_ref, *refs, **kw):
  """The dynamic map's two tables come after the operands (refs: each lookup a gather from
  them); the fp8 format has none."""
  tables = refs[:2] if len(refs) == 7 else (None, None)
  o_ref, muc_o, mua_o, nuc_o, nua_o = refs[-5:]
  h = read_hyper(h_ref, hyper_names(kw["prologue"]))
  outs = block_step(h, p_ref[...], g_ref[...], muc_ref[...], mua_ref[...], nuc_ref[...],
                    nua_ref[...], o_ref.dtype, tables=tables, **kw)
  for ref, x in zip((o_ref, muc_o, mua_o, nuc_o, nua_o), outs):
    ref[...] = x


def leaf_step(hvec, p2, g2, muc, mua, nuc, nua, out_dtype, *, platform: str, l2: bool,
              decoupled: bool, fused: bool, tiling: Tiling = DEFAULT_OPTIONS.quantized_tiling,
              fmt: str = "dynamic8", prologue: tuple[str, ...] = (), coder: str = "table"):
  """One leaf's step on ``[num_blocks, block_size]`` views; ``mua``/``nua`` are
  ``[num_blocks, 1]``. ``platform``: ``"jnp"``, ``"cuda"`` or ``"interpret"``; ``tiling``:
  quantization blocks per program (``block_rows``) and the Triton launch settings; ``fmt``:
  the codes' format; ``prologue``: the kinds of the chain links folded in; ``coder``: how
  the dynamic map's coders read their tables."""
  kw = dict(l2=l2, decoupled=decoupled, fused=fused, fmt=fmt, prologue=prologue, coder=coder)
  names = hyper_names(prologue)
  args = (p2, g2, muc, mua, nuc, nua)
  if platform == "interpret" and any(sharding.varying_axes(x) for x in args):
    platform = "jnp"  # Pallas' interpreter cannot check varying axes inside a shard_map
  if platform == "cuda" and p2.shape[-1] & (p2.shape[-1] - 1):
    platform = "jnp"  # a row of one short block (Triton's blocks are powers of two)
  if platform == "jnp":
    return block_step(read_hyper(hvec, names), *args, out_dtype, tables=tables_of(hvec), **kw)
  tables = tables_of(hvec) if fmt == "dynamic8" else ()
  hvec, *args = sharding.vary_alike((hvec, *args, *tables))  # a kernel's operands vary alike
  args, tables = args[:6], args[6:]
  p2, muc, mua, nuc = args[0], args[2], args[3], args[4]
  nb, bs = p2.shape
  rows = rows_per_program(nb, tiling.block_rows)
  programs = nb // rows
  row_spec = pl.BlockSpec((rows, bs), lambda i: (i, 0))
  col_spec = pl.BlockSpec((rows, 1), lambda i: (i, 0))
  specs = [row_spec, row_spec, row_spec, col_spec, row_spec, col_spec]
  out_shape = (sharding.out_struct(p2, p2.shape, out_dtype),
               sharding.out_struct(p2, muc.shape, muc.dtype),
               sharding.out_struct(p2, mua.shape, jnp.float32),
               sharding.out_struct(p2, nuc.shape, nuc.dtype),
               sharding.out_struct(p2, mua.shape, jnp.float32))
  aliases = {3: 1, 4: 2, 5: 3, 6: 4}
  if fused and p2.dtype == out_dtype:
    aliases[1] = 0
  results = pl.pallas_call(
      functools.partial(_body, **kw),
      out_shape=out_shape,
      grid=(programs,),
      in_specs=([pl.BlockSpec((NHP,), lambda i: (0,))] + specs
                + [pl.BlockSpec(t.shape, lambda i: (0,)) for t in tables]),
      out_specs=(row_spec, row_spec, col_spec, row_spec, col_spec),
      input_output_aliases=aliases,
      interpret=platform == "interpret",
      compiler_params=(pltriton.CompilerParams(num_warps=tiling.num_warps,
                                               num_stages=tiling.num_stages)
                       if platform == "cuda" else None),
      name="adam8bit" if fmt == "dynamic8" else "adam_fp8",
  )(hvec, *args, *tables)
  start = programs * rows
  if start == nb:
    return results
  tail = block_step(read_hyper(hvec, names), *(x[start:] for x in args), out_dtype,
                    tables=tables_of(hvec), **kw)
  return tuple(y.at[start:].set(t) for y, t in zip(results, tail))


def _adam_block(h_ref, g, fields, extras, tables, index, dtypes, **kw):
  """8-bit Adam's block as :func:`~optirs_jax.transforms._quantized_launch.grouped_blocks`
  calls it: the params are the one extra operand."""
  del index
  h = read_hyper(h_ref, hyper_names(kw["prologue"]))
  out, mc, ma, nc, na = block_step(h, extras[0], g, *fields[0], *fields[1], dtypes[0],
                                   tables=tables, **kw)
  return out, [(mc, ma), (nc, na)], []


def local_step(hvec, leaves, *, block_size, platform, l2, decoupled, fused, tiling,
               out_dtypes, fmt, prologue, coder, grouped=False, max_buffers=0):
  """8-bit leaves ``(p, g, mu codes, mu scales, nu codes, nu scales)`` of one block size on
  this device's shards: ``(out, mu codes, mu scales, nu codes, nu scales)`` each. A kernel
  where :func:`~optirs_jax.transforms._quantized_launch.kernel_place` says so (with
  ``grouped`` and one block a program, in grouped launches; else one launch a leaf); the
  jnp math on row blocks elsewhere."""
  outs: list = [None] * len(leaves)
  h = read_hyper(hvec, hyper_names(prologue))
  kw = dict(l2=l2, decoupled=decoupled, fused=fused, fmt=fmt, prologue=prologue, coder=coder)
  places = [kernel_place(leaf, block_size, platform) for leaf in leaves]
  if idx := grouped_members(leaves, places, grouped=grouped, tiling=tiling):
    in_place = lambda extras, dts: {j: j for j in range(1, 5)} | (
      {5: 0} if fused and extras[0].dtype == dts[0] else {})
    got = grouped_blocks(
      functools.partial(_adam_block, **kw), hvec,
      [(g, muc, mua, nuc, nua, p) for p, g, muc, mua, nuc, nua in (leaves[i] for i in idx)],
      [out_dtypes[i] for i in idx], n_fields=2, fmt=fmt, block_size=block_size,
      platform=platform, tiling=tiling, max_buffers=max_buffers, in_place=in_place,
      name="adam8bit_grouped" if fmt == "dynamic8" else "adam_fp8_grouped")
    for i, r in zip(idx, got):
      outs[i] = r
  bs = block_size
  for i, ((p, g, muc, mua, nuc, nua), dts) in enumerate(zip(leaves, out_dtypes)):
    if outs[i] is not None:
      continue
    if places[i] != "jnp":
      res = leaf_step(hvec, p.reshape(-1, bs), g.reshape(-1, bs), muc.reshape(-1, bs),
                      mua.reshape(-1, 1), nuc.reshape(-1, bs), nua.reshape(-1, 1), dts[0],
                      platform=places[i], tiling=tiling, **kw)
      outs[i] = tuple(y.reshape(x.shape) for y, x in zip(res, (p, muc, mua, nuc, nua)))
      continue
    p3, g3, mc3, nc3 = (as_row_blocks(x, bs) for x in (p, g, muc, nuc))
    out, mc, ma, nc, na = block_step(h, p3, g3, mc3, mua[..., None], nc3, nua[..., None],
                                     dts[0], tables=tables_of(hvec), **kw)
    outs[i] = (from_row_blocks(out, p.shape), from_row_blocks(mc, p.shape), ma[..., 0],
               from_row_blocks(nc, p.shape), na[..., 0])
  return outs, [()] * len(leaves)

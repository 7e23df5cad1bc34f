"""The blockwise kernel: an elementwise op over blocks of flat buffers of one shape.

The kernel body loads one block of every input, calls the op's rule (the same jnp function
the reference uses) with the hyper-parameters read from one traced ``f32[NHP]`` vector, and
stores every result cast to its output dtype. When the op asks for norms it also writes,
per block, the lane-wise partial sums of squares of the chosen inputs and outputs
(``f32[num_blocks, 1, lanes]``): per-leaf norms are a segment sum over them, reduced on the
device inside the same pass. No output block is written by more than one grid step, so the
result does not depend on the order programs run in.

Backends: Triton on GPU (explicit ``pltriton.CompilerParams``: without it jax 0.10.2 picks
Mosaic GPU), Mosaic GPU when asked (``platform="mosaic_gpu"``:
:mod:`optirs_jax.pallas.mosaic_gpu`), Mosaic on TPU (hyper-parameters in SMEM), interpret
mode anywhere else.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from optirs_jax.pallas import mosaic_gpu
from optirs_jax.pallas.op import NHP, ElementwiseOp, block_math, partial_sum_of_squares, read_hyper
from optirs_jax.pallas.options import Tiling
from optirs_jax.pallas.sharding import out_struct, vary_alike


def compiler_params(platform: str, tiling: Tiling):
  """The launch settings ``pallas_call`` needs on ``platform`` (None in interpret mode)."""
  if platform == "cuda":
    return pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)
  if platform == "tpu":
    return pltpu.CompilerParams(dimension_semantics=("parallel",))
  return None


def block_index(block_shape, start=0) -> jax.Array:
  """The ``uint32`` index in its buffer of each element of the block at ``start`` (in
  elements) of a row-major buffer whose blocks are ``block_shape``."""
  flat = jax.lax.broadcasted_iota(jnp.uint32, block_shape, 0)
  if len(block_shape) == 2:
    flat = flat * block_shape[1] + jax.lax.broadcasted_iota(jnp.uint32, block_shape, 1)
  return flat + jnp.asarray(start).astype(jnp.uint32)


def _body(h_ref, *refs, op: ElementwiseOp, n_in: int, n_out: int):
  # inputs: h_ref, n_in data blocks; outputs: n_out data blocks, then partial norms.
  in_refs, out_refs, norm_refs = refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]
  shape = in_refs[0].shape
  index = None
  if op.indexed:  # blocks are whole rows (2-D) or a run of the flat buffer (1-D)
    index = block_index(shape, pl.program_id(0) * math.prod(shape))
  outs, sources = block_math(op, read_hyper(h_ref, op.hyper), [r[...] for r in in_refs],
                             [r.dtype for r in out_refs], index)
  for r, x in zip(out_refs, outs):
    r[...] = x
  for r, x in zip(norm_refs, sources):
    r[...] = partial_sum_of_squares(x)


def elementwise_call(op: ElementwiseOp, hvec: jax.Array, inputs: Sequence[jax.Array],
                     out_dtypes: Sequence, *, platform: str, tiling: Tiling,
                     aliases: Mapping[int, int]):
  """Runs ``op`` blockwise over 2-D ``inputs`` of one shape ``(rows, tiling.lanes)``.

  Args:
    op: the rule and its wiring.
    hvec: ``f32[NHP]`` traced hyper-parameter vector (``op.hyper``'s layout).
    inputs: 2-D arrays; rows past the last whole block are computed by the same math in
      jnp and written in place.
    out_dtypes: dtype of each rule output.
    platform: ``"cuda"`` (Triton), ``"mosaic_gpu"``, ``"tpu"`` or ``"interpret"``.
    tiling: the block geometry.
    aliases: ``{input position: output position}`` to update in place.

  Returns:
    The outputs (each of the inputs' shape), then per norm source an
    ``f32[num_blocks, 1, lanes]`` of partial sums of squares.
  """
  rows, lanes = inputs[0].shape
  if lanes != tiling.lanes:
    raise ValueError(f"inputs of shape {inputs[0].shape} must have {tiling.lanes} lanes")
  for x in inputs:
    if x.shape != inputs[0].shape:
      raise ValueError(f"all inputs must share one shape; got {x.shape} and {inputs[0].shape}")
  kw = dict(platform=platform, tiling=tiling, aliases=aliases)
  if platform == "mosaic_gpu":
    return _mosaic_gpu(op, hvec, inputs, out_dtypes, tiling)
  if not tiling.flat:
    return _call(op, hvec, inputs, out_dtypes, (tiling.block_rows, lanes), **kw)
  # 1-D blocks of block_elems over the flattened buffers (free reshapes both ways).
  results = _call(op, hvec, [x.reshape(-1) for x in inputs], out_dtypes, (tiling.block_elems,),
                  **kw)
  n_out = len(out_dtypes)
  return tuple(y.reshape(rows, lanes) for y in results[:n_out]) + tuple(results[n_out:])


def _call(op, hvec, inputs, out_dtypes, block_shape, *, platform, tiling, aliases):
  rows = inputs[0].shape[0]
  num_blocks, tail_rows = divmod(rows, block_shape[0])
  if num_blocks == 0:
    return _tail(op, hvec, inputs, out_dtypes, 0)
  block = pl.BlockSpec(block_shape, lambda i: (i,) + (0,) * (len(block_shape) - 1))
  norm_block = pl.BlockSpec((None, 1, tiling.lanes), lambda i: (i, 0, 0))
  if platform == "tpu":
    hspec = pl.BlockSpec(memory_space=pltpu.SMEM)
  else:
    hspec = pl.BlockSpec((NHP,), lambda i: (0,))
  n_norms = len(op.norm_inputs) + len(op.norm_outputs)
  hvec, *inputs = vary_alike([hvec, *inputs])  # inside shard_map: outputs vary as inputs do
  out_shape = [out_struct(inputs[0], inputs[0].shape, dt) for dt in out_dtypes]
  out_shape += [out_struct(inputs[0], (num_blocks, 1, tiling.lanes), jnp.float32)] * n_norms
  # The grid covers whole blocks only; rows past the last whole block (a leaf used in place
  # whose size is not a multiple of the block) are computed below and written in place.
  results = pl.pallas_call(
      functools.partial(_body, op=op, n_in=len(inputs), n_out=len(out_dtypes)),
      out_shape=tuple(out_shape),
      grid=(num_blocks,),
      in_specs=[hspec] + [block] * len(inputs),
      out_specs=tuple([block] * len(out_dtypes) + [norm_block] * n_norms),
      input_output_aliases={i + 1: o for i, o in aliases.items()},
      interpret=platform == "interpret",
      compiler_params=compiler_params(platform, tiling),
      name=op.name,
  )(hvec, *inputs)
  if not tail_rows:
    return results
  start = num_blocks * block_shape[0]
  tail = _tail(op, hvec, [x[start:] for x in inputs], out_dtypes,
               start * math.prod(inputs[0].shape[1:]))
  n_out = len(out_dtypes)
  data = [y.at[start:].set(t) for y, t in zip(results[:n_out], tail[:n_out])]
  partials = [jnp.concatenate([p, t]) for p, t in zip(results[n_out:], tail[n_out:])]
  return tuple(data + partials)


def _mosaic_gpu(op, hvec, inputs, out_dtypes, tiling):
  """The Mosaic GPU kernel over the blocks its thread blocks share equally; the rows past
  them in jnp, written in place."""
  rows, lanes = inputs[0].shape
  row_bytes = lanes * (sum(x.dtype.itemsize for x in inputs)
                       + sum(jnp.dtype(d).itemsize for d in out_dtypes))
  geo = mosaic_gpu.geometry(rows, row_bytes, block_rows=tiling.block_rows,
                            stages=tiling.num_stages, programs=tiling.programs)
  covered = geo.covered_rows
  if covered == 0:
    return _tail(op, hvec, inputs, out_dtypes, 0)
  results = mosaic_gpu.elementwise_call(op, hvec, inputs, out_dtypes, geo)
  if covered == rows:
    return results
  tail = _tail(op, hvec, [x[covered:] for x in inputs], out_dtypes, covered * lanes)
  return tuple(y.at[covered:].set(t) for y, t in zip(results, tail))


def whole_leaf(op: ElementwiseOp, hvec: jax.Array, leaf: Sequence[jax.Array], out_dtypes,
               position: int = 0):
  """The kernel's math on a whole leaf in jnp (what interpret mode runs inside a
  ``shard_map``, where Pallas' interpreter cannot check varying axes): its outputs and the
  float32 sums of squares of the op's norm sources. ``position``: the leaf's place in
  ``hvec``'s per-leaf values."""
  flat = [x.reshape(-1) for x in leaf]
  index = block_index(flat[0].shape) if op.indexed else None
  h = read_hyper(hvec, op.hyper, op.leaf_hyper, position)
  outs, sources = block_math(op, h, flat, out_dtypes, index)
  return (tuple(y.reshape(leaf[0].shape) for y in outs),
          tuple(jnp.sum(x * x) for x in sources))


def _tail(op, hvec, inputs, out_dtypes, start):
  """The kernel's math on a partial block, in jnp (one fused XLA op on a few rows)."""
  index = block_index(inputs[0].shape, start) if op.indexed else None
  outs, sources = block_math(op, read_hyper(hvec, op.hyper), inputs, out_dtypes, index)
  return tuple(outs) + tuple(partial_sum_of_squares(x)[None] for x in sources)

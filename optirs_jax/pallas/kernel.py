"""One generic Pallas kernel: an elementwise rule over blocks of 2-D flat buffers.

The kernel body loads one ``(block_rows, lanes)`` block of every input, calls the
optimizer's rule (the same jnp function the reference uses) with hyper-parameters read
from one traced ``f32[NHP]`` vector, and stores every result cast to its output dtype.
Optionally it also writes, per block, the lane-wise partial sums of squares of chosen
inputs and outputs (``f32[num_blocks, 1, lanes]``): LAMB's per-leaf norms are a segment
sum over them, reduced on the device inside the same pass. No output block is written by
more than one grid step, so the result does not depend on the order programs run in.

Backends: Triton on GPU (explicit ``pltriton.CompilerParams``: without it jax 0.10.2 picks
Mosaic GPU), Mosaic on TPU (hyper-parameters in SMEM), interpret mode anywhere else.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from optirs_jax.rules import Hyper

NHP = 32  # hyper-parameter vector length: a power of two, 128 bytes of f32.
LANES = 128


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Block geometry and launch settings of the kernel on one platform."""

  block_rows: int
  lanes: int = LANES
  num_warps: int = 4
  num_stages: int = 1
  flat: bool = False  # 1-D blocks of block_elems over the flattened buffer (GPU)

  @property
  def block_elems(self) -> int:
    return self.block_rows * self.lanes


# Interpret mode reuses the GPU geometry, so CPU tests exercise the GPU layout.
TILINGS: Mapping[str, Tiling] = {
    # 2-D blocks of (32, 128), 4 warps. On an H200 every geometry tried ran one 268M-leaf Adam
    # step within 1.81-1.84 ms, at the copy bandwidth, except 1-D blocks of 8192 (1.94 ms)
    # (benchmarks/tiling_variants.py, benchmarks/NOTES.md); this one is what the suite ran.
    "cuda": Tiling(block_rows=32, num_warps=4),
    "tpu": Tiling(block_rows=512),
    "interpret": Tiling(block_rows=32),
}


def block_math(h: Hyper, blocks: Sequence[jax.Array], rule: Callable, out_dtypes: Sequence,
               norm_inputs: Sequence[int] = (), norm_outputs: Sequence[int] = ()):
  """What the kernel computes on one block: outputs and lane-wise partial sums of squares.

  Computes in float32 and rounds once on store (half-precision leaves included); a norm of
  an output squares the value as stored.
  """
  ins = [x.astype(jnp.float32) for x in blocks]
  outs = [x.astype(dt) for x, dt in zip(rule(h, *ins), out_dtypes)]
  sources = [ins[i] for i in norm_inputs] + [outs[i] for i in norm_outputs]
  return outs, [partial_sum_of_squares(x.astype(jnp.float32)) for x in sources]


def partial_sum_of_squares(x: jax.Array) -> jax.Array:
  """A ``(1, LANES)`` row whose lanes add up to ``sum(x**2)``: lane-wise sums of a 2-D
  block, or a 1-D block's total in lane 0."""
  if x.ndim == 2:
    return jnp.sum(x * x, axis=0, keepdims=True)
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
  return jnp.where(lane == 0, jnp.sum(x * x), 0.0)


def _body(h_ref, *refs, rule, names, n_in, n_out, norm_inputs, norm_outputs):
  # inputs: h_ref, n_in data blocks; outputs: n_out data blocks, then partial norms.
  h = Hyper({name: h_ref[i] for i, name in enumerate(names)})
  in_refs, out_refs, norm_refs = refs[:n_in], refs[n_in:n_in + n_out], refs[n_in + n_out:]
  outs, sums = block_math(h, [r[...] for r in in_refs], rule, [r.dtype for r in out_refs],
                          norm_inputs, norm_outputs)
  for r, x in zip(out_refs + norm_refs, outs + sums):
    r[...] = x


def _compiler_params(platform: str, tiling: Tiling):
  if platform == "cuda":
    return pltriton.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages)
  if platform == "tpu":
    return pltpu.CompilerParams(dimension_semantics=("parallel",))
  return None


def hyper_vector(h: Mapping, names: Sequence[str]) -> jax.Array:
  """Packs the named scalars into one ``f32[NHP]`` vector (zeros after the last)."""
  if len(names) > NHP:
    raise ValueError(f"{len(names)=} hyper-parameters do not fit the {NHP=} vector")
  values = [jnp.asarray(h[n], jnp.float32).reshape(()) for n in names]
  values += [jnp.zeros((), jnp.float32)] * (NHP - len(values))
  return jnp.stack(values)


def elementwise_call(rule: Callable, names: Sequence[str], hvec: jax.Array,
                     inputs: Sequence[jax.Array], out_dtypes: Sequence, *, platform: str,
                     aliases: Mapping[int, int] = {}, norm_inputs: Sequence[int] = (),
                     norm_outputs: Sequence[int] = (), name: str = "optirs_kernel"):
  """Runs ``rule`` blockwise over 2-D ``inputs`` of equal shape ``(rows, lanes)``.

  Args:
    rule: ``rule(h, *blocks) -> tuple of blocks``; ``h`` holds the named scalars.
    names: hyper-parameter names, in the order of ``hvec``.
    hvec: ``f32[NHP]`` traced hyper-parameter vector.
    inputs: 2-D arrays with the platform's lanes; rows past the last whole block are
      computed by the same math in jnp and written in place.
    out_dtypes: dtype of each rule output.
    platform: ``"cuda"``, ``"tpu"`` or ``"interpret"``.
    aliases: ``{input position: output position}`` to update in place.
    norm_inputs / norm_outputs: which inputs / outputs get per-block partial sums of
      squares; these come back after the data outputs as ``f32[num_blocks, 1, lanes]``.
  """
  tiling = TILINGS[platform]
  rows, lanes = inputs[0].shape
  if lanes != tiling.lanes:
    raise ValueError(f"inputs of shape {inputs[0].shape} must have {tiling.lanes} lanes")
  for x in inputs:
    if x.shape != inputs[0].shape:
      raise ValueError(f"all inputs must share one shape; got {x.shape} and {inputs[0].shape}")
  kw = dict(platform=platform, aliases=aliases, norm_inputs=norm_inputs,
            norm_outputs=norm_outputs, name=name)
  if not tiling.flat:
    return _call(rule, names, hvec, inputs, out_dtypes, tiling, (tiling.block_rows, lanes), **kw)
  # 1-D blocks of block_elems over the flattened buffers (free reshapes both ways).
  results = _call(rule, names, hvec, [x.reshape(-1) for x in inputs], out_dtypes, tiling,
                  (tiling.block_elems,), **kw)
  n_out = len(out_dtypes)
  return tuple(y.reshape(rows, lanes) for y in results[:n_out]) + tuple(results[n_out:])


def _call(rule, names, hvec, inputs, out_dtypes, tiling, block_shape, *, platform, aliases,
          norm_inputs, norm_outputs, name):
  rows = inputs[0].shape[0]
  lanes = tiling.lanes
  num_blocks, tail_rows = divmod(rows, block_shape[0])
  if num_blocks == 0:
    return _tail(rule, names, hvec, inputs, out_dtypes, norm_inputs, norm_outputs)
  block = pl.BlockSpec(block_shape, lambda i: (i,) + (0,) * (len(block_shape) - 1))
  norm_block = pl.BlockSpec((None, 1, lanes), lambda i: (i, 0, 0))
  if platform == "tpu":
    hspec = pl.BlockSpec(memory_space=pltpu.SMEM)
  else:
    hspec = pl.BlockSpec((NHP,), lambda i: (0,))
  n_norms = len(norm_inputs) + len(norm_outputs)
  out_shape = [jax.ShapeDtypeStruct(inputs[0].shape, dt) for dt in out_dtypes]
  out_shape += [jax.ShapeDtypeStruct((num_blocks, 1, lanes), jnp.float32)] * n_norms
  body = functools.partial(_body, rule=rule, names=tuple(names), n_in=len(inputs),
                           n_out=len(out_dtypes), norm_inputs=tuple(norm_inputs),
                           norm_outputs=tuple(norm_outputs))
  # The grid covers whole blocks only; rows past the last whole block (a leaf used in place
  # whose size is not a multiple of the block) are computed below and written in place.
  results = pl.pallas_call(
      body,
      out_shape=tuple(out_shape),
      grid=(num_blocks,),
      in_specs=[hspec] + [block] * len(inputs),
      out_specs=tuple([block] * len(out_dtypes) + [norm_block] * n_norms),
      input_output_aliases={i + 1: o for i, o in aliases.items()},
      interpret=platform == "interpret",
      compiler_params=_compiler_params(platform, tiling),
      name=name,
  )(hvec, *inputs)
  if not tail_rows:
    return results
  start = num_blocks * block_shape[0]
  tail = _tail(rule, names, hvec, [x[start:] for x in inputs], out_dtypes, norm_inputs,
               norm_outputs)
  n_out = len(out_dtypes)
  data = [y.at[start:].set(t) for y, t in zip(results[:n_out], tail[:n_out])]
  partials = [jnp.concatenate([p, t]) for p, t in zip(results[n_out:], tail[n_out:])]
  return tuple(data + partials)


def _tail(rule, names, hvec, inputs, out_dtypes, norm_inputs, norm_outputs):
  """The kernel's math on a partial block, in jnp (one fused XLA op on a few rows)."""
  h = Hyper({name: hvec[i] for i, name in enumerate(names)})
  outs, sums = block_math(h, inputs, rule, out_dtypes, norm_inputs, norm_outputs)
  return tuple(outs) + tuple(x[None] for x in sums)

"""The blockwise kernel on Mosaic GPU: an elementwise op over blocks of 2-D buffers.

The same block math as the Triton kernel (:func:`~optirs_jax.pallas.op.block_math`),
written for ``jax.experimental.pallas.mosaic_gpu``: ``plgpu.kernel`` launches ``programs``
thread blocks; each streams its share of ``(block_rows, 128)`` blocks through shared memory
with ``plgpu.emit_pipeline`` (TMA copies in and out, ``stages`` blocks in flight) and reads
the hyper-parameters as scalars from global memory.

Limits (Mosaic GPU on jax 0.10-0.11): no CPU interpret mode, at most 256 elements per block
dimension, no ``input_output_aliases`` through ``plgpu.kernel`` (outputs are new buffers),
and only elementwise ops: per-leaf norms and element indices stay on Triton.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from optirs_jax.pallas.op import ElementwiseOp, block_math, read_hyper
from optirs_jax.pallas.options import MOSAIC_GPU_MAX_BLOCK_ROWS

CUSTOM_CALL_TARGET = "mosaic_gpu_v2"
# Shared memory a thread block may allocate on an H100/H200 (227 KB; Mosaic GPU refuses a
# kernel past it at lowering).
SMEM_BYTES = 232448
# Whether Pallas puts a warpgroup barrier around every shared-memory store (its safe
# default). The kernel reads only input blocks and writes only output blocks, and the
# pipeline's commit_smem orders the writes before the copies out, so the barriers are not
# needed for correctness; run 17 measured both (benchmarks/NOTES.md; the script,
# benchmarks/mosaic_tiling.py, is in git history).
_AUTO_BARRIERS = True


def supports(op: ElementwiseOp) -> bool:
  """Whether Mosaic GPU runs ``op`` (elementwise: no per-leaf norms, indices, scalars)."""
  return not (op.has_norms or op.indexed or op.leaf_hyper)


class Geometry(NamedTuple):
  """One launch: ``programs`` thread blocks, each streaming ``per`` blocks of
  ``block_rows`` rows with ``stages`` of them in flight."""

  block_rows: int
  programs: int
  per: int
  stages: int

  @property
  def covered_rows(self) -> int:
    """The rows the kernel computes (the rest are left to the caller)."""
    return self.programs * self.per * self.block_rows


def geometry(rows: int, row_bytes: int, *, block_rows: int, stages: int,
             programs: int | None) -> Geometry:
  """The launch over ``rows`` rows, at most the asked geometry, that fits in shared memory.

  ``emit_pipeline`` holds ``min(stages, per)`` blocks of every operand, each
  ``block_rows * row_bytes`` bytes (``row_bytes``: one row of every input and output), in
  :data:`SMEM_BYTES`: blocks are halved until one of each fits, then the stages lowered.
  At most ``programs`` thread blocks (``None``: one per block) take equal runs of whole
  blocks; the rows past them are the caller's.
  """
  if not 1 <= block_rows <= MOSAIC_GPU_MAX_BLOCK_ROWS:
    raise ValueError(f"{block_rows=} must be in [1, {MOSAIC_GPU_MAX_BLOCK_ROWS}] on Mosaic GPU")
  while block_rows > 1 and block_rows * row_bytes > SMEM_BYTES:
    block_rows //= 2
  blocks = rows // block_rows
  programs = max(1, min(programs or blocks, blocks))
  per = blocks // programs
  stages = max(1, min(stages, per, SMEM_BYTES // (block_rows * row_bytes)))
  return Geometry(block_rows, programs, per, stages)


def elementwise_call(op: ElementwiseOp, hvec: jax.Array, inputs: Sequence[jax.Array],
                     out_dtypes: Sequence, geo: Geometry):
  """Runs ``op`` over the whole blocks of 2-D ``inputs`` of one shape ``(rows, lanes)``.

  Returns the outputs, of the inputs' shape, written over their first ``geo.covered_rows``
  rows (see :func:`geometry`); the caller computes the rest and writes it in place.
  """
  if not supports(op):
    raise ValueError(f"op {op.name} needs norms, indices or per-leaf scalars; Mosaic GPU runs "
                     "elementwise ops only")
  rows, lanes = inputs[0].shape
  if geo.per == 0:
    raise ValueError(f"{rows=} hold no whole block of {geo.block_rows} rows")
  block_rows, per = geo.block_rows, geo.per
  n_in = len(inputs)
  out_type = tuple(jax.ShapeDtypeStruct((rows, lanes), dt) for dt in out_dtypes)

  def body(h_ref, *refs):
    in_refs, out_refs = refs[:n_in], refs[n_in:]
    h = read_hyper(h_ref, op.hyper)
    first = jax.lax.axis_index("programs") * per
    spec = pl.BlockSpec((block_rows, lanes), lambda j: (first + j, 0))

    def step(_, *blocks):
      ins, outs = blocks[:n_in], blocks[n_in:]
      results, _ = block_math(op, h, [r[...] for r in ins], [r.dtype for r in outs])
      for r, x in zip(outs, results):
        r[...] = x

    plgpu.emit_pipeline(step, grid=(per,), in_specs=[spec] * n_in,
                        out_specs=[spec] * len(out_dtypes),
                        max_concurrent_steps=geo.stages)(*in_refs, *out_refs)

  params = plgpu.CompilerParams(unsafe_no_auto_barriers=not _AUTO_BARRIERS)
  kernel = plgpu.kernel(body, out_type=out_type, grid=(geo.programs,),
                        grid_names=("programs",), compiler_params=params)
  return tuple(kernel(hvec, *inputs))


@functools.cache
def sm_count() -> int:
  """Streaming multiprocessors of the first CUDA device (132 on an H100/H200 when the
  process has none, e.g. exporting from a CPU host)."""
  try:
    return int(getattr(jax.devices("cuda")[0], "core_count", 132) or 132)
  except RuntimeError:
    return 132


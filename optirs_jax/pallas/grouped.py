"""A grouped kernel: one launch updates many leaves, each in its own buffers, no packing.

The launch takes every leaf's operands as separate whole-array arguments (a compile-time
table of buffers, planned by :func:`optirs_jax.planning.layout.plan_grouped_calls`). Its
grid has one program per 1-D block of every leaf; program ``i`` finds the leaf that owns it
by comparing ``i`` with the static block offsets (one branch per leaf, only the owner's
runs), loads its block with a mask past the leaf's end, calls the optimizer's rule and
stores the results masked. Nothing is concatenated before the step or sliced after it, and
leaves of any size or dtype share a launch, so a tree of many leaves costs a few launches
and no copies; the state and, on the fused apply, the params are updated in place.

This is the Apex multi-tensor-apply design with the address table fixed at trace time: a
``pallas_call`` takes whole arrays, not a runtime table of pointers, so one launch serves
at most ``MAX_POINTERS_PER_CALL`` operand buffers.

Triton on GPU and interpret mode on CPU (the same masked loads). Mosaic TPU pipelines every
operand's block into VMEM for every program, so the TPU keeps the packed layout.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from optirs_jax.pallas.kernel import LANES, NHP, Tiling, block_math, partial_sum_of_squares
from optirs_jax.planning.layout import GroupedCall
from optirs_jax.rules import Hyper

# 1-D blocks of 1024 elements, 4 warps: the fastest geometry on one 268M leaf on an H200
# (1.810 ms for Adam, benchmarks/NOTES.md "tiling").
TILINGS: Mapping[str, Tiling] = {
    "cuda": Tiling(block_rows=8, num_warps=4, flat=True),
    "interpret": Tiling(block_rows=8, flat=True),
}


def _body(h_ref, *refs, rule, names, call: GroupedCall, n_in, n_out, pads, norm_inputs,
          norm_outputs):
  leaves = len(call.leaves)
  in_refs = refs[:leaves * n_in]
  out_refs = refs[leaves * n_in:leaves * (n_in + n_out)]
  norm_refs = refs[leaves * (n_in + n_out):]
  block = call.block_elems
  h = Hyper({name: h_ref[i] for i, name in enumerate(names)})
  pid = pl.program_id(0)
  for k in range(leaves):

    @pl.when((pid >= call.starts[k]) & (pid < call.starts[k + 1]))
    def _(k=k):
      idx = (pid - call.starts[k]) * block + jnp.arange(block)
      mask = idx < call.sizes[k]
      ins = [pltriton.load(r.at[idx], mask=mask, other=jnp.asarray(pad, r.dtype))
             for r, pad in zip(in_refs[k * n_in:(k + 1) * n_in], pads)]
      outs = out_refs[k * n_out:(k + 1) * n_out]
      results, _ = block_math(h, ins, rule, [r.dtype for r in outs])
      for r, y in zip(outs, results):
        pltriton.store(r.at[idx], y, mask=mask)
      sources = [ins[i] for i in norm_inputs] + [results[i] for i in norm_outputs]
      for r, x in zip(norm_refs, sources):
        r[...] = partial_sum_of_squares(jnp.where(mask, x.astype(jnp.float32), 0.0))


def grouped_call(rule: Callable, names: Sequence[str], hvec: jax.Array,
                 leaves: Sequence[Sequence[jax.Array]], out_dtypes: Sequence[Sequence],
                 call: GroupedCall, *, platform: str, pads: Sequence[float],
                 aliases: Sequence[Mapping[int, int]], norm_inputs: Sequence[int] = (),
                 norm_outputs: Sequence[int] = (), name: str = "optirs_grouped"):
  """Runs ``rule`` over ``leaves`` (each a tuple of equal-size arrays) in one launch.

  Args:
    rule, names, hvec: as for :func:`optirs_jax.pallas.kernel.elementwise_call`.
    leaves: per leaf of ``call``, the rule's inputs (any shape; read flat).
    out_dtypes: per leaf, the dtype of each rule output.
    call: the launch's plan (block size, each leaf's programs).
    platform: ``"cuda"`` or ``"interpret"``.
    pads: per input position, the value masked-out lanes read (a finite value, so no
      lane past the end computes an inf or NaN).
    aliases: per leaf, ``{input position: output position}`` updated in place.
    norm_inputs / norm_outputs: inputs / outputs whose per-block sums of squares to return.

  Returns:
    ``(outs, partials)``: per leaf a tuple of flat outputs, and per norm source an
    ``f32[call.num_blocks]`` of per-block sums of squares (``call.block_owner()`` maps
    blocks to leaves).
  """
  tiling = TILINGS[platform]
  if call.block_elems != tiling.block_elems:
    raise ValueError(f"{call.block_elems=} does not match the {platform} block "
                     f"({tiling.block_elems})")
  operands = [x.reshape(-1) for leaf in leaves for x in leaf]
  # The launch depends on the leaves' sizes, not on which leaves of the tree they are.
  call = dataclasses.replace(call, leaves=tuple(range(len(call.leaves))))
  key = (rule, tuple(names), tuple(tuple(d) for d in out_dtypes), call, platform,
         tuple(pads), tuple(tuple(sorted(a.items())) for a in aliases), tuple(norm_inputs),
         tuple(norm_outputs), name)
  launch = _LAUNCHES.pop(key, None)
  if launch is None:
    launch = jax.jit(functools.partial(_launch, rule, names, out_dtypes, call, tiling, platform,
                                       pads, aliases, norm_inputs, norm_outputs, name))
  _LAUNCHES[key] = launch  # most recently used last
  while len(_LAUNCHES) > _MAX_LAUNCHES:
    del _LAUNCHES[next(iter(_LAUNCHES))]
  results = launch(hvec, *operands)
  n_norms = len(norm_inputs) + len(norm_outputs)
  n_out = len(out_dtypes[0])
  data = results[:len(results) - n_norms]
  outs = [tuple(data[k * n_out:(k + 1) * n_out]) for k in range(len(call.leaves))]
  partials = [p[:, 0, 0] for p in results[len(results) - n_norms:]]
  return outs, partials


# One jitted launch per distinct configuration: a tree whose leaves repeat (the blocks of a
# transformer) traces and lowers each distinct launch once; the step's module calls it.
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 256


def _launch(rule, names, out_dtypes, call, tiling, platform, pads, aliases, norm_inputs,
            norm_outputs, name, hvec, *operands):
  n_out = len(out_dtypes[0])
  n_in = len(operands) // len(call.leaves)
  whole = pl.BlockSpec()
  n_norms = len(norm_inputs) + len(norm_outputs)
  out_shape = [jax.ShapeDtypeStruct((size,), dt)
               for size, dts in zip(call.sizes, out_dtypes) for dt in dts]
  out_shape += [jax.ShapeDtypeStruct((call.num_blocks, 1, LANES), jnp.float32)] * n_norms
  body = functools.partial(_body, rule=rule, names=tuple(names), call=call, n_in=n_in,
                           n_out=n_out, pads=tuple(pads), norm_inputs=tuple(norm_inputs),
                           norm_outputs=tuple(norm_outputs))
  io_aliases = {1 + k * n_in + i: k * n_out + o
                for k, alias in enumerate(aliases) for i, o in alias.items()}
  return pl.pallas_call(
      body,
      out_shape=tuple(out_shape),
      grid=(call.num_blocks,),
      in_specs=[pl.BlockSpec((NHP,), lambda i: (0,))] + [whole] * len(operands),
      out_specs=tuple([whole] * (len(out_shape) - n_norms)
                      + [pl.BlockSpec((None, 1, LANES), lambda i: (i, 0, 0))] * n_norms),
      input_output_aliases=io_aliases,
      interpret=platform == "interpret",
      compiler_params=(pltriton.CompilerParams(num_warps=tiling.num_warps,
                                               num_stages=tiling.num_stages)
                       if platform == "cuda" else None),
      name=name,
  )(hvec, *operands)

"""The packed layout: leaves concatenated per dtype into flat buffers, or used in place.

:func:`optirs_jax.planning.plan_layout` decides which leaves share a buffer: a leaf of at
least ``solo_min_blocks`` blocks and a whole number of lanes runs in place (a reshape, no
copy); the others are packed back to back, each padded to whole blocks with the op's pad
values, run through one :func:`~optirs_jax.pallas.kernel.elementwise_call`, and sliced back
out. The TPU's layout (its grid pipelines whole blocks); on the GPU the grouped launches
(:mod:`optirs_jax.pallas.grouped`) avoid the copies.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from optirs_jax.pallas.kernel import elementwise_call
from optirs_jax.pallas.op import ElementwiseOp
from optirs_jax.pallas.options import Tiling
from optirs_jax.planning.layout import Group, plan_layout


def _pack(xs: Sequence[jax.Array], group: Group, pad_value, lanes: int) -> jax.Array:
  """The group's leaves back to back, each padded to whole blocks, as ``(rows, lanes)``."""
  if group.solo:
    return xs[0].reshape(-1, lanes)
  parts, pads = [], {}
  for x, place in zip(xs, group.placements):
    parts.append(x.reshape(-1))
    n = place.padded - place.size
    if n:  # one constant per distinct pad length: fewer ops to trace and compile
      if n not in pads:
        pads[n] = jnp.full((n,), pad_value, x.dtype)
      parts.append(pads[n])
  return jnp.concatenate(parts).reshape(-1, lanes)


def _unpack(y: jax.Array, group: Group, shapes) -> list[jax.Array]:
  """Inverse of :func:`_pack` for one output buffer: one split, then reshapes."""
  if group.solo:
    return [y.reshape(shapes[0])]
  sizes = []
  for place in group.placements:
    sizes += [place.size] + ([place.padded - place.size] if place.padded > place.size else [])
  pieces = jnp.split(y.reshape(-1), list(itertools.accumulate(sizes))[:-1])
  out, k = [], 0
  for place, shape in zip(group.placements, shapes):
    out.append(pieces[k].reshape(shape))
    k += 2 if place.padded > place.size else 1
  return out


def run_packed(op: ElementwiseOp, hvec: jax.Array, leaves: Sequence[tuple],
               out_dtypes: Sequence[tuple], *, platform: str, tiling: Tiling,
               solo_min_elements: int):
  """Runs ``op`` over ``leaves`` in the packed layout.

  Returns ``(outs, partials)``: per leaf the outputs, and per buffer a list
  ``(leaf positions, per-block partial sums per norm source, block owner)`` for the
  caller's per-leaf norms.
  """
  keys = [(tuple(x.dtype for x in leaf), dts) for leaf, dts in zip(leaves, out_dtypes)]
  plan = plan_layout([leaf[0].size for leaf in leaves], keys, block_elems=tiling.block_elems,
                     solo_min_elements=solo_min_elements, solo_multiple=tiling.lanes)
  outs: list = [None] * len(leaves)
  norm_parts = []
  for group in plan.groups:
    members = [p.leaf for p in group.placements]
    in_dtypes, dts = group.key
    packed = [_pack([leaves[i][s] for i in members], group, op.pads[s], tiling.lanes)
              for s in range(len(in_dtypes))]
    results = elementwise_call(op, hvec, packed, dts, platform=platform, tiling=tiling,
                               aliases=op.in_place(in_dtypes, dts))
    data, partials = results[:len(dts)], results[len(dts):]
    columns = [_unpack(y, group, [leaves[i][0].shape for i in members]) for y in data]
    for j, i in enumerate(members):
      outs[i] = tuple(col[j] for col in columns)
    if partials:
      norm_parts.append((members, [jnp.sum(part[:, 0, :], axis=1) for part in partials],
                         group.block_owner()))
  return outs, norm_parts

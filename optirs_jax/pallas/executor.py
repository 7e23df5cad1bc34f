"""The two executors of a rule over a list of leaves, and the per-platform dispatch.

``execute`` takes the leaves as tuples of arrays (``(g, p, mu, nu)`` for Adam, ...), runs
the rule either as the jnp reference (one fused XLA computation per leaf) or as Pallas
kernels -- grouped launches over the leaves' own buffers
(:mod:`optirs_jax.pallas.grouped`, planned by
:func:`optirs_jax.planning.layout.plan_grouped_calls`; the GPU default) or in-place and
packed flat buffers (planned by :func:`optirs_jax.planning.plan_layout`; the TPU's) -- and
returns the rule's outputs per leaf (and per-leaf norms when asked).

With ``backend="auto"`` the choice is made per platform at lowering time with
``jax.lax.platform_dependent``: CPU (and any other platform) runs the reference, CUDA the
Triton kernel, TPU the Mosaic kernel. Leaves whose dtypes a kernel does not take (complex,
float64, float16 on TPU) run through the reference inside the kernel branch.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from optirs_jax.pallas import grouped
from optirs_jax.pallas.kernel import TILINGS, elementwise_call, hyper_vector
from optirs_jax.planning.layout import (MAX_GROUPED_LEAF_ELEMENTS, plan_grouped_calls,
                                        plan_layout, runs_in_place)

Leaf = tuple  # one leaf's arrays, in the rule's argument order

KERNEL_DTYPES = {
    "cuda": frozenset({jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}),
    "tpu": frozenset({jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}),
    "interpret": frozenset({jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                            jnp.dtype(jnp.float16)}),
}
# Leaves of at least this many blocks run in place, one launch each; smaller ones are packed.
SOLO_MIN_BLOCKS = 64
# What the kernel backend does with the leaves it would pack (smaller than SOLO_MIN_BLOCKS
# blocks, or not a whole number of lanes): "group" them: a few launches that each read and
# write many leaves in their own buffers (optirs_jax.pallas.grouped; the TPU packs instead);
# "pack" them into one buffer per dtype (one launch, plus a concatenation in and one slice
# per leaf and output back); run each "solo" in place (one launch per leaf; leaves not a
# whole number of lanes are still packed); or hand them to the "reference" (one XLA fusion
# per leaf). On an H200, GPT-2 small's Adam step costs the device 1.17 ms grouped against
# 2.40 ms packed (benchmarks/NOTES.md, "grouped kernel"); benchmarks/policy_variants.sh
# measures them.
SMALL_LEAF_POLICIES = ("group", "pack", "solo", "reference")
SMALL_LEAF_POLICY = "group"
# What the kernel backend does with the leaves large enough to run in place: join the
# small leaves' grouped launches ("group", where the small leaves are grouped: fewest
# launches; on one 268M leaf as fast as in place) or one launch each ("in-place").
LARGE_LEAF_POLICIES = ("group", "in-place")
LARGE_LEAF_POLICY = "group"
# On the optax-contract path (``update`` without the fused apply) with backend="auto", the
# leaves large enough to run in place go to the reference when the rule needs no per-leaf
# norm: XLA then fuses the update with whatever consumes it (optax.apply_updates), as it
# does for optax. A kernel must write the updates out for apply_updates to read back: 44
# B/param instead of 28, measured at 0.71-0.77x optax on one 268M leaf for Adam, SGD,
# RMSprop and Adagrad (benchmarks/NOTES.md, run 2), where optax ran at the copy bandwidth.
IN_PLACE_UPDATES_ON_REFERENCE = True
# Pallas, for every platform it runs on: a dtype outside this set is an error on backend="pallas".
PALLAS_DTYPES = KERNEL_DTYPES["cuda"]


def norm_dtype(x: jax.Array):
  """The dtype a per-leaf norm is carried in: float64 for 64-bit leaves, else float32."""
  return jnp.float64 if jnp.finfo(x.dtype).bits > 32 else jnp.float32


def _reference(rule, h, leaves, norm_of):
  outs = [tuple(rule(h, *leaf)) for leaf in leaves]
  if norm_of is None:
    return outs, None
  norms = []
  for leaf, out in zip(leaves, outs):
    xs = [leaf[i] for i in norm_of[0]] + [out[i] for i in norm_of[1]]
    norms.append(tuple(jnp.linalg.norm(x).astype(norm_dtype(leaf[0])) for x in xs))
  return outs, norms


def _pack(xs: Sequence[jax.Array], group, pad_value, lanes: int) -> jax.Array:
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


def _unpack(y: jax.Array, group, shapes) -> list[jax.Array]:
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


def _output_dtypes(rule, h, leaves) -> list[tuple]:
  """The rule's output dtypes per leaf, as the reference computes them (one abstract
  evaluation per distinct tuple of input dtypes: the rule is elementwise)."""
  cache: dict[tuple, tuple] = {}
  out = []
  for leaf in leaves:
    key = tuple(jnp.dtype(x.dtype) for x in leaf)
    if key not in cache:
      scalars = [jax.ShapeDtypeStruct((), dt) for dt in key]
      cache[key] = tuple(a.dtype for a in jax.eval_shape(lambda *a: tuple(rule(h, *a)),
                                                         *scalars))
    out.append(cache[key])
  return out


def _kernel(rule, h, names, leaves, pads, norm_of, aliases, platform, name,
            in_place_on_reference=False):
  tiling = TILINGS[platform]
  supported = KERNEL_DTYPES[platform]
  policy, large_policy = SMALL_LEAF_POLICY, LARGE_LEAF_POLICY
  if policy not in SMALL_LEAF_POLICIES:
    raise ValueError(f"SMALL_LEAF_POLICY={policy!r} is not one of {SMALL_LEAF_POLICIES}")
  if large_policy not in LARGE_LEAF_POLICIES:
    raise ValueError(f"LARGE_LEAF_POLICY={large_policy!r} is not one of {LARGE_LEAF_POLICIES}")
  groups = policy == "group" and platform in grouped.TILINGS
  solo_min = SOLO_MIN_BLOCKS * tiling.block_elems
  leaf_out_dtypes = _output_dtypes(rule, h, leaves)

  def route(leaf):  # "reference", "group" or "plan" (plan_layout: in place or packed)
    if not all(x.dtype in supported for x in leaf) or leaf[0].size == 0:
      return "reference"
    if runs_in_place(leaf[0].size, solo_min_elements=solo_min, solo_multiple=tiling.lanes):
      if in_place_on_reference:
        return "reference"
      fits = leaf[0].size <= MAX_GROUPED_LEAF_ELEMENTS
      return "group" if groups and large_policy == "group" and fits else "plan"
    if policy == "reference":  # a leaf the default plan would pack
      return "reference"
    return "group" if groups else "plan"

  routes = [route(leaf) for leaf in leaves]
  outs: list = [None] * len(leaves)
  norms: list = [None] * len(leaves)
  ref_idx = [i for i, r in enumerate(routes) if r == "reference"]
  if ref_idx:
    r_outs, r_norms = _reference(rule, h, [leaves[i] for i in ref_idx], norm_of)
    for j, i in enumerate(ref_idx):
      outs[i] = r_outs[j]
      norms[i] = r_norms[j] if r_norms is not None else None
  if len(ref_idx) == len(leaves):
    return outs, (norms if norm_of is not None else None)
  hvec = hyper_vector(h, names)
  norm_in, norm_out = norm_of if norm_of is not None else ((), ())

  def in_place(in_dtypes, out_dtypes):
    return {i: o for o, i in aliases.items()
            if o < len(out_dtypes) and i < len(in_dtypes) and in_dtypes[i] == out_dtypes[o]}

  def set_norms(members, partials, owner):
    sums = [jax.ops.segment_sum(part, jnp.asarray(owner), num_segments=len(members),
                                indices_are_sorted=True) for part in partials]
    for j, i in enumerate(members):
      norms[i] = tuple(jnp.sqrt(s[j]) for s in sums)

  g_idx = [i for i, r in enumerate(routes) if r == "group"]
  if g_idx:
    g_tiling = grouped.TILINGS[platform]
    n_ops = len(leaves[g_idx[0]]) + len(leaf_out_dtypes[g_idx[0]])
    for call in plan_grouped_calls([leaves[i][0].size for i in g_idx],
                                   block_elems=g_tiling.block_elems, operands_per_leaf=n_ops):
      members = [g_idx[k] for k in call.leaves]
      alias = [in_place(tuple(x.dtype for x in leaves[i]), leaf_out_dtypes[i])
               for i in members]
      results, partials = grouped.grouped_call(
          rule, names, hvec, [leaves[i] for i in members],
          [leaf_out_dtypes[i] for i in members], call, platform=platform, pads=pads,
          aliases=alias, norm_inputs=norm_in, norm_outputs=norm_out, name=name)
      for i, res in zip(members, results):
        outs[i] = tuple(y.reshape(leaves[i][0].shape) for y in res)
      if partials:
        set_norms(members, partials, call.block_owner())

  k_idx = [i for i, r in enumerate(routes) if r == "plan"]
  if not k_idx:
    return outs, (norms if norm_of is not None else None)
  keys = [(tuple(x.dtype for x in leaves[i]), leaf_out_dtypes[i]) for i in k_idx]
  plan = plan_layout([leaves[i][0].size for i in k_idx], keys, block_elems=tiling.block_elems,
                     solo_min_elements=1 if policy == "solo" else solo_min,
                     solo_multiple=tiling.lanes)
  for group in plan.groups:
    members = [k_idx[p.leaf] for p in group.placements]
    in_dtypes, out_dtypes = group.key
    packed = [_pack([leaves[i][s] for i in members], group, pads[s], tiling.lanes)
              for s in range(len(in_dtypes))]
    results = elementwise_call(rule, names, hvec, packed, out_dtypes, platform=platform,
                               aliases=in_place(in_dtypes, out_dtypes), norm_inputs=norm_in,
                               norm_outputs=norm_out, name=name)
    data, partials = results[:len(out_dtypes)], results[len(out_dtypes):]
    shapes = [leaves[i][0].shape for i in members]
    columns = [_unpack(y, group, shapes) for y in data]
    for j, i in enumerate(members):
      outs[i] = tuple(col[j] for col in columns)
    if partials:
      set_norms(members, [jnp.sum(part[:, 0, :], axis=1) for part in partials],
                group.block_owner())
  return outs, (norms if norm_of is not None else None)


def check_pallas_dtypes(leaves: Sequence[Leaf], paths: Sequence[str]) -> None:
  """Raises a TypeError naming the leaf when ``backend='pallas'`` cannot take its dtype."""
  for leaf, path in zip(leaves, paths):
    for x in leaf:
      dt = jnp.dtype(x.dtype)
      if dt not in PALLAS_DTYPES and not jnp.issubdtype(dt, jnp.complexfloating):
        valid = sorted(str(d) for d in PALLAS_DTYPES)
        raise TypeError(f"backend='pallas' cannot run leaf {path} of dtype {dt}; valid dtypes "
                        f"are {valid} (complex leaves run on the reference); use "
                        "backend='auto' or 'jnp' for other dtypes")


def execute(rule: Callable, h: Mapping, names: Sequence[str], leaves: Sequence[Leaf], *,
            backend: str, pads: Sequence[float],
            norm_of: tuple[Sequence[int], Sequence[int]] | None = None,
            aliases: Mapping[int, int] = {}, name: str = "optirs_kernel",
            fused_apply: bool = False):
  """Runs ``rule`` on every leaf with the chosen backend.

  Args:
    rule: the elementwise rule, static options already bound.
    h: hyper-parameters of this step, as optax would use them (Python floats stay floats).
    names: the rule's hyper-parameter names (the kernel vector's layout).
    leaves: per leaf, the rule's array arguments.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.
    pads: the value each argument is padded with in a flat buffer; chosen so that padding
      yields a zero, finite update.
    norm_of: ``(input positions, output positions)`` whose per-leaf L2 norms to return.
    aliases: ``{output position: input position}`` that may share a buffer: the state and,
      on the fused apply path, the params. (Not the updates onto the gradients: a gradient
      buffer the caller still holds would make XLA copy it first.)
    name: the kernel's name in the compiled program.
    fused_apply: whether the rule's first output is the new params (the fused apply path)
      rather than the updates; see ``IN_PLACE_UPDATES_ON_REFERENCE``.

  Returns:
    ``(outs, norms)``: per leaf the rule's outputs, and per leaf a tuple of norms (or None).
  """
  leaves = [tuple(leaf) for leaf in leaves]
  reference = lambda: _reference(rule, h, leaves, norm_of)
  kernel = lambda platform, on_reference=False: (
      lambda: _kernel(rule, h, names, leaves, pads, norm_of, aliases, platform, name,
                      on_reference))
  if backend == "jnp" or not leaves:
    return reference()
  if backend == "auto":
    on_ref = IN_PLACE_UPDATES_ON_REFERENCE and not fused_apply and norm_of is None
    return jax.lax.platform_dependent(cpu=reference, cuda=kernel("cuda", on_ref),
                                      tpu=kernel("tpu", on_ref), default=reference)
  if backend == "pallas":
    return jax.lax.platform_dependent(cuda=kernel("cuda"), tpu=kernel("tpu"),
                                      default=kernel("interpret"))
  raise ValueError(f"{backend=} is not one of ('auto', 'jnp', 'pallas')")


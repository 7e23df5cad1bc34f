"""The two executors of an op over a list of leaves, and the choice between them per platform.

:func:`execute` runs an :class:`~optirs_jax.pallas.op.ElementwiseOp` on every leaf, either as
the jnp reference (one fused XLA computation per leaf) or as Pallas kernels, and returns the
rule's outputs per leaf (and per-leaf norms when the op asks). On the kernel path each leaf
is routed by the :class:`~optirs_jax.pallas.options.ExecutorOptions`: to grouped launches
over the leaves' own buffers (:mod:`optirs_jax.pallas.grouped`; the GPU default), to the
packed or in-place layout (:mod:`optirs_jax.pallas.packed`; the TPU's), or to the reference
(dtypes a kernel does not take: complex, float64, float16 on TPU).

With ``backend="auto"`` the choice is made per platform at lowering time with
``jax.lax.platform_dependent``: CPU (and any other platform) runs the reference, CUDA the
Triton kernel, TPU the Mosaic kernel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from optirs_jax.pallas.grouped import grouped_call
from optirs_jax.pallas.op import ElementwiseOp, Hyper, call_rule, hyper_vector, output_dtypes
from optirs_jax.pallas.options import DEFAULT_OPTIONS, ExecutorOptions
from optirs_jax.pallas.packed import run_packed
from optirs_jax.planning.layout import (MAX_GROUPED_LEAF_ELEMENTS, plan_grouped_calls,
                                        runs_in_place)

Leaf = tuple  # one leaf's arrays, in the rule's argument order

KERNEL_DTYPES = {
    "cuda": frozenset({jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}),
    "tpu": frozenset({jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)}),
    "interpret": frozenset({jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16),
                            jnp.dtype(jnp.float16)}),
}
# Pallas, for every platform it runs on: a dtype outside this set is an error on backend="pallas".
PALLAS_DTYPES = KERNEL_DTYPES["cuda"]


def norm_dtype(x: jax.Array):
  """The dtype a per-leaf norm is carried in: float64 for 64-bit leaves, else float32."""
  return jnp.float64 if jnp.finfo(x.dtype).bits > 32 else jnp.float32


def reference(op: ElementwiseOp, h: Mapping, leaves: Sequence[Leaf]):
  """The jnp reference: the rule on each leaf, norms by ``jnp.linalg.norm``."""
  h = Hyper(h)
  index = lambda x: jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape)
  outs = [tuple(call_rule(op, h, leaf, index(leaf[0]) if op.indexed else None))
          for leaf in leaves]
  if not op.has_norms:
    return outs, None
  norms = []
  for leaf, out in zip(leaves, outs):
    xs = [leaf[i] for i in op.norm_inputs] + [out[i] for i in op.norm_outputs]
    norms.append(tuple(jnp.linalg.norm(x).astype(norm_dtype(leaf[0])) for x in xs))
  return outs, norms


def _route(op: ElementwiseOp, leaf: Leaf, platform: str, options: ExecutorOptions,
           large_on_reference: bool) -> str:
  """``"reference"``, ``"group"`` or ``"packed"`` (the packed or in-place layout)."""
  tiling = options.tiling(platform)
  if not all(x.dtype in KERNEL_DTYPES[platform] for x in leaf) or leaf[0].size == 0:
    return "reference"
  groups = options.groups(platform)
  if runs_in_place(leaf[0].size, solo_min_elements=options.solo_min_blocks * tiling.block_elems,
                   solo_multiple=tiling.lanes):
    if large_on_reference:
      return "reference"
    fits = leaf[0].size <= MAX_GROUPED_LEAF_ELEMENTS
    return "group" if groups and options.large_leaf_policy == "group" and fits else "packed"
  if options.small_leaf_policy == "reference":  # a leaf the default plan would pack
    return "reference"
  if groups:
    return "group"
  # An indexed op needs each element's index in its leaf: a leaf packed with others (not in
  # place under the "solo" policy either) runs on the reference instead.
  solo = options.small_leaf_policy == "solo" and runs_in_place(
      leaf[0].size, solo_min_elements=tiling.block_elems, solo_multiple=tiling.lanes)
  return "reference" if op.indexed and not solo else "packed"


def _kernels(op: ElementwiseOp, h: Mapping, leaves: Sequence[Leaf], platform: str,
             options: ExecutorOptions, large_on_reference: bool = False):
  routes = [_route(op, leaf, platform, options, large_on_reference) for leaf in leaves]
  outs: list = [None] * len(leaves)
  norms: list = [None] * len(leaves)
  picked = lambda route: [i for i, r in enumerate(routes) if r == route]
  if ref_idx := picked("reference"):
    r_outs, r_norms = reference(op, h, [leaves[i] for i in ref_idx])
    for j, i in enumerate(ref_idx):
      outs[i] = r_outs[j]
      norms[i] = r_norms[j] if r_norms is not None else None
  if len(ref_idx) == len(leaves):
    return outs, (norms if op.has_norms else None)
  hvec = hyper_vector(h, op.hyper)
  out_dtypes = output_dtypes(op, h, leaves)

  def set_norms(members, partials, owner):
    # Each norm is rounded to its array's dtype, as jnp.linalg.norm of that array would be.
    sums = [jax.ops.segment_sum(part, jnp.asarray(owner), num_segments=len(members),
                                indices_are_sorted=True) for part in partials]
    for j, i in enumerate(members):
      dtypes = ([leaves[i][k].dtype for k in op.norm_inputs]
                + [out_dtypes[i][k] for k in op.norm_outputs])
      norms[i] = tuple(jnp.sqrt(s[j]).astype(dt).astype(norm_dtype(leaves[i][0]))
                       for s, dt in zip(sums, dtypes))

  if g_idx := picked("group"):
    tiling = options.grouped_tiling
    n_ops = len(leaves[g_idx[0]]) + len(out_dtypes[g_idx[0]])
    for call in plan_grouped_calls([leaves[i][0].size for i in g_idx],
                                   block_elems=tiling.block_elems, operands_per_leaf=n_ops):
      members = [g_idx[k] for k in call.leaves]
      aliases = [op.in_place(tuple(x.dtype for x in leaves[i]), out_dtypes[i]) for i in members]
      results, partials = grouped_call(op, hvec, [leaves[i] for i in members],
                                       [out_dtypes[i] for i in members], call,
                                       platform=platform, tiling=tiling, aliases=aliases)
      for i, res in zip(members, results):
        outs[i] = tuple(y.reshape(leaves[i][0].shape) for y in res)
      if partials:
        set_norms(members, partials, call.block_owner())

  if p_idx := picked("packed"):
    tiling = options.tiling(platform)
    solo_min = 1 if options.small_leaf_policy == "solo" else options.solo_min_blocks
    p_outs, parts = run_packed(op, hvec, [leaves[i] for i in p_idx],
                               [out_dtypes[i] for i in p_idx], platform=platform, tiling=tiling,
                               solo_min_elements=solo_min * tiling.block_elems)
    for j, i in enumerate(p_idx):
      outs[i] = p_outs[j]
    for members, partials, owner in parts:
      set_norms([p_idx[k] for k in members], partials, owner)
  return outs, (norms if op.has_norms else None)


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


def execute(op: ElementwiseOp, h: Mapping, leaves: Sequence[Leaf], *, backend: str,
            options: ExecutorOptions = DEFAULT_OPTIONS, fused_apply: bool = False):
  """Runs ``op`` on every leaf with the chosen backend.

  Args:
    op: the rule and its wiring.
    h: hyper-parameters of this step, as optax would use them (Python floats stay floats
      on the reference, so XLA sees optax's exact expressions).
    leaves: per leaf, the rule's array arguments.
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.
    options: the kernels' layout and launch options.
    fused_apply: whether the rule's first output is the new params (the fused apply path)
      rather than the updates; see ``ExecutorOptions.updates_on_reference``.

  Returns:
    ``(outs, norms)``: per leaf the rule's outputs, and per leaf a tuple of norms (or None).
  """
  leaves = [tuple(leaf) for leaf in leaves]
  ref = lambda: reference(op, h, leaves)
  kernel = lambda platform, on_ref=False: lambda: _kernels(op, h, leaves, platform, options,
                                                           on_ref)
  if backend == "jnp" or not leaves:
    return ref()
  if backend == "auto":
    on_ref = options.updates_on_reference and not fused_apply and not op.has_norms
    return jax.lax.platform_dependent(cpu=ref, cuda=kernel("cuda", on_ref),
                                      tpu=kernel("tpu", on_ref), default=ref)
  if backend == "pallas":
    return jax.lax.platform_dependent(cuda=kernel("cuda"), tpu=kernel("tpu"),
                                      default=kernel("interpret"))
  raise ValueError(f"{backend=} is not one of ('auto', 'jnp', 'pallas')")

"""Loads and stores at the buffers of a program's own leaf, picked by pointer, not by branch.

A grouped launch (:mod:`optirs_jax.pallas.grouped`) holds many leaves' buffers, and each
program works on one block of one leaf. Written with Pallas's own primitives, the program
needs one branch per leaf around that leaf's loads and stores (a ref cannot be chosen at
run time), so the kernel's code, and Triton's compile, grow by several vector memory
operations per leaf.

:func:`load` and :func:`store` take every leaf's refs and lower, on Triton, to one search
over the static block offsets (nested ``scf.if``, log2(leaves) deep) that yields the
owner's *pointers*, first block and size (scalars), then one masked vector load or store
per operand: the Apex multi-tensor-apply address table, resolved at compile time. Given
the output refs too (``outs``), the load's search also yields their pointers and the leaf's
index, which the store takes (``owner``): one search per program. The code
per leaf is a few scalars, so Triton compiles a launch in about half the time (H200, jax
0.11.2: GPT-2 Adam's launches 0.49-0.60 s instead of 1.07-1.29 s, 2000 leaves' 4.1 s instead
of 7.3-7.6 s). On CUDA each leaf's branch holds an inline-asm mark that keeps it a branch
(see ``_owner_values``): unmarked, the compilers turn the search into selects over every
leaf's pointers, which every program runs. In interpret mode the primitives are discharged
into the same semantics over arrays (one switch for the load, one conditional update per
leaf for the store).

The Triton rules build on Pallas's lowering helpers (``jax._src.pallas.triton.lowering``),
which are not public; :data:`AVAILABLE` says whether this jax has them, and
:mod:`~optirs_jax.pallas.grouped` falls back to one branch per leaf where it does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as jax_core
from jax._src.interpreters import partial_eval as pe
from jax._src.state import discharge as state_discharge
from jax._src.state import types as state_types

try:
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith as arith_dialect
  from jax._src.lib.mlir.dialects import scf as scf_dialect
  from jax._src.lib.triton import dialect as tt_dialect
  from jax._src.pallas.triton import lowering as triton_lowering
  AVAILABLE = hasattr(tt_dialect, "elementwise_inline_asm") and all(
    hasattr(triton_lowering, name) for name in (
      "register_lowering", "_load", "_store", "_add", "_bcast_to", "_ensure_ir_value",
      "_ir_constant", "_sub", "_mul", "_make_range", "_set_attr"))
except ImportError:  # a jaxlib without the Triton bindings
  AVAILABLE = False

#: Whether the Triton search marks each leaf's branch (see ``_owner_values``) so that it
#: stays a branch; ``False`` lets the compilers flatten the search into selects, as before
#: (``benchmarks/grouped_tiling.py``'s ``:select`` measures it beside the default).
MARKED_BRANCHES = True

#: Whether the loads and stores ask the caches to evict their lines first (PTX
#: ``L1::evict_first``): each byte is touched once, so nothing is worth keeping. Off by
#: default; ``benchmarks/grouped_tiling.py``'s ``:stream`` plan flag times it.
STREAMING_HINTS = False

load_p = jax_core.Primitive("optirs_leaf_load")
load_p.multiple_results = True
store_p = jax_core.Primitive("optirs_leaf_store")
store_p.multiple_results = True


def load(pid, starts: Sequence[int], sizes: Sequence[int], block: int,
         refs: Sequence[Sequence], others, outs: Sequence[Sequence] | None = None,
         widths: Sequence[int] | None = None):
  """The program's block of the leaf ``k`` with ``starts[k] <= pid < starts[k + 1]``.

  Args:
    pid: the program's index (``int32`` scalar).
    starts: static program offsets of the leaves, ``len(refs) + 1`` of them, increasing.
    sizes: static element counts of the leaves.
    block: elements per program.
    refs: per leaf, its operands' flat refs (every leaf alike in count and dtypes).
    others: per operand, the scalar that lanes past the leaf's end read.
    outs: per leaf, the refs a later :func:`store` writes (every leaf alike), found by the
      same search: pass the returned ``owner`` to that store (or to several, each writing
      some of these refs), which then needs no search of its own.
    widths: per operand, ``block`` (the default: the block's elements) or 1: one value
      per block, the element ``local`` of a ref of one value per block of its leaf (a
      block's scale), never masked.

  Returns:
    ``(local, left, values)``: the block's index in its leaf (``pid - starts[k]``), the
    elements from its start to the leaf's end (``sizes[k] - local * block``), and per
    operand the ``[block]`` elements ``local * block + arange(block)`` (``other`` where
    that is not below ``sizes[k]``; ``[1]``, the element ``local``, at width 1); with
    ``outs``, ``(local, left, values, owner)``, ``owner`` being ``k``.
  """
  n_ops = _check(starts, refs)
  if len(sizes) != len(refs):
    raise ValueError(f"need one size per leaf, got {len(sizes)} for {len(refs)} leaves")
  n_outs = 0 if outs is None else _check(starts, outs)
  flat = [r for leaf in (*refs, *(outs or ())) for r in leaf]
  others = [jnp.asarray(o, r.dtype) for o, r in zip(others, refs[0], strict=True)]
  widths = (int(block),) * n_ops if widths is None else tuple(int(w) for w in widths)
  if len(widths) != n_ops or any(w not in (1, int(block)) for w in widths):
    raise ValueError(f"need one width per operand, each {block} or 1; got {widths} for "
                     f"{n_ops} operands")
  local, left, owner, *values = load_p.bind(
    jnp.asarray(pid, jnp.int32), *others, *flat, starts=tuple(int(s) for s in starts),
    sizes=tuple(int(s) for s in sizes), block=int(block), n_ops=n_ops, n_outs=n_outs,
    widths=widths)
  return (local, left, values) if outs is None else (local, left, values, owner)


def store(pid, starts: Sequence[int], refs: Sequence[Sequence], idx, mask, values, *,
          owner=None) -> None:
  """``ref[idx] = value`` where ``mask``, per operand, into the refs of the leaf owning
  ``pid`` (arguments as in :func:`load`; ``values``: one ``[B]`` array per operand, cast
  to its refs' dtype). ``owner``: the leaf, as returned by a :func:`load` given these
  ``refs`` (or more, per leaf) as its ``outs``; its search then serves the store too."""
  n_ops = _check(starts, refs)
  flat = [r for leaf in refs for r in leaf]
  values = [jnp.asarray(v).astype(r.dtype) for v, r in zip(values, refs[0], strict=True)]
  if owner is not None:  # the leaf's index is its own program: leaf k starts at k
    pid, starts = owner, range(len(refs) + 1)
  store_p.bind(jnp.asarray(pid, jnp.int32), idx, mask, *values, *flat,
               starts=tuple(int(s) for s in starts), n_ops=n_ops,
               by_owner=owner is not None)


def _check(starts, refs) -> int:
  if len(starts) != len(refs) + 1 or not refs:
    raise ValueError(f"need one more start than leaves, got {len(starts)} starts for "
                     f"{len(refs)} leaves")
  n_ops = len(refs[0])
  if any(len(leaf) != n_ops for leaf in refs):
    raise ValueError(f"every leaf needs the same operands; got {[len(r) for r in refs]}")
  dtypes = [tuple(r.dtype for r in leaf) for leaf in refs]
  if len(set(dtypes)) != 1:
    raise ValueError(f"every leaf's operands need the same dtypes; got {sorted(set(dtypes))}")
  return n_ops


def _rows(rest, n_ops):
  """(the per-operand scalars or values, per-leaf rows of refs) of a primitive's operands
  after its leading ones."""
  ops, flat = rest[:n_ops], rest[n_ops:]
  return ops, [flat[k:k + n_ops] for k in range(0, len(flat), n_ops)]


def _load_rows(rest, n_ops, n_outs, leaves):
  """(the per-operand scalars, per-leaf rows of the loaded refs, per-leaf rows of the
  ``outs`` refs) of a load's operands after ``pid``."""
  end = n_ops * (1 + leaves)
  others, rows = _rows(rest[:end], n_ops)
  outs = rest[end:]
  return others, rows, [outs[k:k + n_outs] for k in range(0, len(outs), n_outs)] if n_outs else []


def _read_effects(n_ops, leaves):
  return {state_types.ReadEffect(1 + n_ops + j) for j in range(leaves * n_ops)}


@load_p.def_effectful_abstract_eval
def _load_abstract_eval(pid, *rest, starts, sizes, block, n_ops, n_outs, widths):
  del pid, starts, n_outs, block
  refs = rest[n_ops:]
  index = jax_core.ShapedArray((), jnp.int32)
  outs = [jax_core.ShapedArray((w,), r.dtype) for r, w in zip(refs[:n_ops], widths)]
  return [index, index, index, *outs], _read_effects(n_ops, len(sizes))


def _load_dce(used_outs, eqn):
  """Drops the operands whose loaded values go unused (a fused step does not read the
  params it overwrites), in every leaf, as a load per leaf unused would be dropped, and
  the ``outs`` refs where no store takes the owner."""
  if not any(used_outs):
    return [False] * len(eqn.invars), None
  n_ops, n_outs, leaves = eqn.params["n_ops"], eqn.params["n_outs"], len(eqn.params["sizes"])
  keep = [i for i in range(n_ops) if used_outs[3 + i]] or [0]
  keep_outs = n_outs if used_outs[2] else 0
  if len(keep) == n_ops and keep_outs == n_outs:
    return [True] * len(eqn.invars), eqn
  pid, *rest = eqn.invars
  others, rows, out_rows = _load_rows(rest, n_ops, n_outs, leaves)
  refs = [row[i] for row in rows for i in keep]
  out_refs = [r for row in out_rows for r in row] if keep_outs else []
  outvars = [*eqn.outvars[:3], *(eqn.outvars[3 + i] for i in keep)]
  new = pe.new_jaxpr_eqn(
    [pid, *(others[i] for i in keep), *refs, *out_refs], outvars, load_p,
    dict(eqn.params, n_ops=len(keep), n_outs=keep_outs,
         widths=tuple(eqn.params["widths"][i] for i in keep)), _read_effects(len(keep), leaves),
    eqn.source_info, eqn.ctx)
  used_ins = [True, *(i in keep for i in range(n_ops)),
              *(i in keep for _ in rows for i in range(n_ops)),
              *[bool(keep_outs)] * (leaves * n_outs)]
  return used_ins, new


pe.dce_rules[load_p] = _load_dce


@store_p.def_effectful_abstract_eval
def _store_abstract_eval(pid, idx, mask, *rest, starts, n_ops, by_owner):
  del pid, idx, mask, starts, by_owner
  return [], {state_types.WriteEffect(3 + n_ops + j) for j in range(len(rest) - n_ops)}


def _owner(pid, starts):
  """The leaf whose programs include ``pid`` (interpret mode)."""
  return jnp.searchsorted(jnp.asarray(np.asarray(starts[1:-1], np.int32)), pid, side="right")


def _discharge_rule(prim):
  """Registers ``rule(*args, **params)`` as ``prim``'s discharge rule, whose leading
  arguments are ``(in_avals, out_avals)`` on jax 0.10 and one context on 0.11."""
  leading = 1 if hasattr(state_discharge, "DischargeContext") else 2

  def register(rule):
    state_discharge.register_discharge_rule(prim)(
      lambda *args, **params: rule(*args[leading:], **params))
    return rule

  return register


@_discharge_rule(load_p)
def _load_discharge(pid, *rest, starts, sizes, block, n_ops, n_outs, widths):
  others, rows, _ = _load_rows(rest, n_ops, n_outs, len(sizes))
  owner = _owner(pid, starts)
  local = pid - jnp.asarray(np.asarray(starts[:-1], np.int32))[owner]
  left = jnp.asarray(np.asarray(sizes, np.int32))[owner] - local * block
  lane = jnp.arange(block, dtype=jnp.int32)
  at = {block: (local * block + lane, lane < left), 1: (local[None], jnp.ones(1, bool))}

  def branch(row):
    return lambda: [jnp.where(at[w][1], jnp.take(r, at[w][0], mode="clip"), o)
                    for r, o, w in zip(row, others, widths)]

  values = jax.lax.switch(owner, [branch(row) for row in rows])
  return [None] * (1 + len(rest)), [local, left, owner.astype(jnp.int32), *values]


@_discharge_rule(store_p)
def _store_discharge(pid, idx, mask, *rest, starts, n_ops, by_owner):
  del by_owner  # an owner is its own program among programs 0, 1, 2, ...
  values, rows = _rows(rest, n_ops)
  owner = _owner(pid, starts)

  def write(row):
    return [r.at[jnp.where(mask, idx, r.size)].set(v, mode="drop") for r, v in zip(row, values)]

  new = []
  for k, row in enumerate(rows):
    new += jax.lax.cond(owner == k, write, list, list(row))
  return [None] * (3 + n_ops) + new, []


if AVAILABLE:
  tl = triton_lowering

  def _owner_values(ctx, pid, starts, rows, types, lo=0, hi=None):
    """``[start, *rows[k]]`` (``rows[k]``: scalars of ``types``) for the leaf ``k`` owning
    ``pid`` among ``lo..hi - 1``, ``start`` its first program: nested ``scf.if`` on the
    static offsets, log2(leaves) deep, each leaf's row in its own branch.

    Branches that only pick values the compilers turn into selects, so every program
    would load and select every leaf's pointers (XLA's SASS for an H200 of Adam's launch
    of 106 leaves of 7 buffers: 1117 constant loads and 106 selects, against 8 vector
    loads; ``benchmarks/results/2026-12-05-cpu-xla-sass.txt``). On CUDA each leaf's start
    therefore comes out of an inline-asm move with side effects, its text unique to the
    leaf: a branch holding it cannot be speculated, nor merged with its sibling, so a
    program runs log2(leaves) uniform branches and loads only its own leaf's pointers (the
    same launch: no select, 3 LDC and 743 ULDC in all, 7 per leaf)."""
    hi = len(rows) if hi is None else hi
    if hi - lo == 1:
      start = tl._ir_constant(starts[lo], pid.type)
      if MARKED_BRANCHES and ctx.context.platform == "cuda":
        start = tt_dialect.elementwise_inline_asm(
          [pid.type], f"mov.b32 $0, {int(starts[lo])}; // leaf {lo}", constraints="=r,r",
          pure=False, packed_element=1, args=[pid])
      return [start, *rows[lo]()]
    mid = (lo + hi) // 2
    left = arith_dialect.cmpi(arith_dialect.CmpIPredicate.slt, pid,
                              tl._ir_constant(starts[mid], pid.type))
    if_op = scf_dialect.IfOp(left, [pid.type, *types], has_else=True)
    with ir.InsertionPoint.at_block_begin(if_op.then_block):
      scf_dialect.yield_(_owner_values(ctx, pid, starts, rows, types, lo, mid))
    with ir.InsertionPoint.at_block_begin(if_op.else_block):
      scf_dialect.yield_(_owner_values(ctx, pid, starts, rows, types, mid, hi))
    return list(if_op.results_)

  def _evict():
    return "evict_first" if STREAMING_HINTS else None

  def _aligned(pointers):
    """``pointers`` (a splat) marked 16-byte aligned, as Pallas marks every kernel
    argument, so Triton vectorizes the loads and stores whatever it makes of the search."""
    tl._set_attr(pointers, "tt.divisibility",
                 ir.DenseIntElementsAttr.get(np.asarray([16], np.int32)))
    return pointers

  def _found_outs(ctx) -> list:
    """``(owner, rows, pointers)`` of the loads given ``outs`` in the kernel being lowered,
    for the stores that take their ``owner`` (and the same refs): the search's results are
    MLIR values of the load's rule, which a jaxpr value cannot carry (pointers have no jax
    dtype)."""
    return ctx.context.__dict__.setdefault("_optirs_leaf_outs", [])

  @tl.register_lowering(load_p)
  def _load_lowering(ctx, pid, *rest, starts, sizes, block, n_ops, n_outs, widths):
    others, rows, out_rows = _load_rows(rest, n_ops, n_outs, len(sizes))
    i32 = pid.type

    def leaf(k):
      return lambda: [tl._ir_constant(sizes[k], i32), tl._ir_constant(k, i32), *rows[k],
                      *(out_rows[k] if n_outs else ())]

    types = [i32, i32, *(p.type for p in (*rows[0], *(out_rows[0] if n_outs else ())))]
    start, size, owner, *pointers = _owner_values(ctx, pid, starts,
                                                  [leaf(k) for k in range(len(rows))], types)
    if n_outs:
      _found_outs(ctx).append((owner, out_rows, pointers[n_ops:]))
    local = tl._sub(pid, start)
    first = tl._mul(local, tl._ir_constant(block, i32))  # the block's first element
    left = tl._sub(size, first)
    lane = tl._make_range(0, block)
    idx = tl._add(tl._bcast_to(first, (block,)), lane)
    mask = arith_dialect.cmpi(arith_dialect.CmpIPredicate.slt, lane,
                              tl._bcast_to(left, (block,)))
    values = []
    for p, o, aval, w in zip(pointers[:n_ops], others, ctx.avals_in[1:1 + n_ops], widths):
      if w == block:
        addresses = tl._add(_aligned(tl._bcast_to(p, (block,))), idx)
        other = tl._bcast_to(tl._ensure_ir_value(o, aval), (block,))
        values.append(tl._load(addresses, mask=mask, other=other, eviction_policy=_evict()))
      else:  # one value per block: the element ``local``
        addresses = tl._add(tl._bcast_to(p, (1,)), tl._bcast_to(local, (1,)))
        values.append(tl._load(addresses, eviction_policy=_evict()))
    return [local, left, owner, *values]

  def _columns(rows, out_rows, pointers):
    """The owner's pointers to the refs of ``rows`` (per leaf, the store's refs) where each
    is, in every leaf, the same one of a load's ``out_rows``; else None."""
    if len(rows) != len(out_rows):
      return None
    columns = []
    for j, ref in enumerate(rows[0]):
      c = next((c for c, r in enumerate(out_rows[0]) if r is ref), None)
      if c is None or any(row[j] is not out[c] for row, out in zip(rows, out_rows)):
        return None
      columns.append(c)
    return [pointers[c] for c in columns]

  @tl.register_lowering(store_p)
  def _store_lowering(ctx, pid, idx, mask, *rest, starts, n_ops, by_owner):
    values, rows = _rows(rest, n_ops)
    shape = ctx.avals_in[1].shape
    mask = tl._bcast_to(tl._ensure_ir_value(mask, ctx.avals_in[2]), shape)
    found = [cols for owner, out_rows, found_pointers in _found_outs(ctx) if owner is pid
             and (cols := _columns(rows, out_rows, found_pointers)) is not None] if by_owner else []
    if found:  # the load's search found these refs' pointers already
      pointers = found[0]
    else:
      _, *pointers = _owner_values(ctx, pid, starts,
                                   [(lambda k=k: list(rows[k])) for k in range(len(rows))],
                                   [p.type for p in rows[0]])
    for p, v in zip(pointers, values):
      tl._store(tl._add(_aligned(tl._bcast_to(p, shape)), idx), v, mask=mask,
                eviction_policy=_evict())
    return []

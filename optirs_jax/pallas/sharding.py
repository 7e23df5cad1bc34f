"""Kernels on sharded leaves: every device updates its own shard, nothing is gathered.

A ``pallas_call`` is opaque to XLA's partitioner: left alone, its sharded inputs would be
gathered onto every device and its outputs come back replicated. :func:`run_local` wraps
the kernel executor so that it runs on each device's shard instead:

* inside a user's ``shard_map`` (a manual mesh) the kernel already sees local shards; its
  outputs are declared varying over the same mesh axes as its inputs;
* on an Explicit mesh (the leaves' types carry their shardings) it runs under
  ``jax.shard_map`` with each leaf's own ``PartitionSpec``;
* otherwise (an Auto mesh, or no mesh) under ``custom_partitioning``: XLA chooses the
  shardings, and the kernel is lowered on the local shapes it picked, each output keeping
  its input's sharding; on one device this is the plain call.

Elementwise rules need no communication. Per-leaf sums of squares (LAMB's norms) are
summed over the mesh axes that shard the leaf: a ``psum`` of one scalar per leaf.

Block-wise state (:class:`Blocked`: 8-bit moments) adds operands of another last axis, one
scale per block of a row: they are partitioned as the leaf is, so each device quantizes
its own blocks. Where a shard's part of the last axis is not a whole number of blocks, that
axis is kept whole on each device instead (a block never straddles a shard).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from optirs_jax.pallas.op import take_rows, with_leaf_values


def _manual_type(x):
  return getattr(jax.typeof(x), "manual_axis_type", None)


def varying_axes(x) -> frozenset:
  """The mesh axes ``x`` varies over inside a ``shard_map`` (empty elsewhere)."""
  mat = _manual_type(x)
  return frozenset(mat.varying) if mat is not None else frozenset()


def in_manual_context() -> bool:
  """Whether the trace is inside a ``shard_map`` (some mesh axis is manual)."""
  mesh = jax.sharding.get_abstract_mesh()
  return any(t == AxisType.Manual for t in getattr(mesh, "axis_types", ()))


def out_struct(like: jax.Array, shape, dtype) -> jax.ShapeDtypeStruct:
  """The shape of a kernel output: inside ``shard_map``, varying like ``like``."""
  mat = _manual_type(like)
  if mat is not None and in_manual_context():
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
  return jax.ShapeDtypeStruct(shape, dtype)


def vary_alike(operands: Sequence[jax.Array]) -> list[jax.Array]:
  """Inside ``shard_map``: every operand varying over the union of their varying axes (a
  kernel takes operands of one kind); elsewhere the operands unchanged."""
  union = frozenset().union(*(varying_axes(x) for x in operands))
  if not union:
    return list(operands)
  out = []
  for x in operands:
    missing = tuple(sorted(union - varying_axes(x)))
    out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
  return out


def _axes(spec) -> tuple[str, ...]:
  names = []
  for entry in spec:
    if entry is None:
      continue
    names += list(entry) if isinstance(entry, tuple) else [entry]
  return tuple(names)


def _explicit(x):
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or not any(t == AxisType.Explicit for t in mesh.axis_types):
    return None
  return sharding


LocalFn = Callable[[jax.Array, list], tuple[list, list]]


@dataclasses.dataclass(frozen=True)
class Blocked:
  """Leaves cut into blocks of ``block_size`` along their last axis, with per-block scales:
  the operands (``scale_inputs``) and outputs (``scale_outputs``) at these positions have
  ``[..., blocks]`` where the others have ``[..., last]``."""

  block_size: int
  scale_inputs: tuple[int, ...]
  scale_outputs: tuple[int, ...]

  def spec(self, spec, shape, mesh) -> P:
    """``spec`` of a leaf of ``shape``, its last axis unpartitioned unless each shard holds
    whole blocks."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    last = entries[-1]
    if last is not None:
      names = last if isinstance(last, tuple) else (last,)
      if shape[-1] % (math.prod(mesh.shape[n] for n in names) * self.block_size):
        entries[-1] = None
    return P(*entries)


def run_local(local: LocalFn, hvec: jax.Array, leaves: Sequence[tuple], out_dtypes,
              n_sums: int, norm_axes: tuple[str, ...] = (), leaf_values=None, *,
              blocked: Blocked | None = None):
  """Runs ``local(hvec, leaves) -> (outs per leaf, sums of squares per leaf)`` on each
  device's shard of ``leaves``, as the leaves are placed.

  Args:
    local: the kernel executor on (local) leaves; ``sums`` per leaf is a tuple of
      ``n_sums`` float32 scalars.
    hvec: the hyper-parameter vector (replicated); ``local`` gets it followed by its
      leaves' ``leaf_values`` (:func:`~optirs_jax.pallas.op.with_leaf_values`).
    leaves: per leaf, equal-shape arrays.
    out_dtypes: per leaf, the outputs' dtypes.
    n_sums: sums of squares per leaf.
    norm_axes: inside a ``shard_map``, the mesh axes over which the leaves are sharded
      (their sums are added over them); elsewhere the axes are read from the shardings.
    leaf_values: ``[leaves, scalars per leaf]`` (an op's per-leaf hyper-parameters), or
      None.
    blocked: block-wise leaves and their scales (:class:`Blocked`); ``None``: every
      array of a leaf has one shape.

  Returns:
    ``(outs, sums)`` for the whole leaves.
  """
  if in_manual_context():
    return _manual(local, hvec, leaves, n_sums, norm_axes, leaf_values)
  if leaf_values is not None:
    hvec = with_leaf_values(hvec, leaf_values)
  explicit = [_explicit(leaf[0]) for leaf in leaves]
  if any(s is not None for s in explicit):
    return _shard_mapped(local, hvec, leaves, explicit, out_dtypes, n_sums, blocked)
  if jax.device_count() == 1:
    return local(hvec, list(leaves))
  return _partitioned(local, hvec, leaves, out_dtypes, n_sums, blocked)


def _manual(local, hvec, leaves, n_sums, norm_axes, leaf_values):
  """Inside a ``shard_map``: one kernel call per set of varying axes (a kernel's outputs
  vary as its inputs do, so leaves that vary differently do not share a launch, and each
  call's vector holds only its own leaves' values), sums of squares added over the
  ``norm_axes`` each leaf varies over."""
  kinds = [frozenset().union(*(varying_axes(x) for x in leaf)) for leaf in leaves]
  outs: list = [None] * len(leaves)
  sums: list = [None] * len(leaves)
  for kind in dict.fromkeys(kinds):
    idx = [i for i, k in enumerate(kinds) if k == kind]
    h = hvec if leaf_values is None else with_leaf_values(hvec, take_rows(leaf_values, idx))
    o, s = local(h, [leaves[i] for i in idx])
    over = tuple(a for a in norm_axes if a in kind)
    for j, i in enumerate(idx):
      outs[i] = o[j]
      sums[i] = tuple(jax.lax.psum(x, over) for x in s[j]) if n_sums and over else s[j]
  return outs, sums


def _summed(sums, specs):
  """Each leaf's local sums of squares added over the mesh axes that shard the leaf."""
  return [tuple(jax.lax.psum(s, _axes(spec)) if _axes(spec) else s for s in leaf_sums)
          for leaf_sums, spec in zip(sums, specs)]


def _flatten(outs, sums):
  return [y for leaf in outs for y in leaf] + [s for leaf in sums for s in leaf]


def _unflatten(flat, n_outs: Sequence[int], n_sums: int):
  outs, k = [], 0
  for n in n_outs:
    outs.append(tuple(flat[k:k + n]))
    k += n
  sums = [tuple(flat[k + i * n_sums:k + (i + 1) * n_sums]) for i in range(len(n_outs))]
  return outs, sums


def _shard_mapped(local, hvec, leaves, shardings, out_dtypes, n_sums, blocked=None):
  mesh = next(s.mesh for s in shardings if s is not None)
  specs = [s.spec if s is not None else P() for s in shardings]
  if blocked is not None:
    specs = [blocked.spec(spec, leaf[0].shape, mesh) for spec, leaf in zip(specs, leaves)]
  n_outs = [len(d) for d in out_dtypes]

  def body(hvec, *flat_leaves):
    it = iter(flat_leaves)
    local_leaves = [tuple(next(it) for _ in leaf) for leaf in leaves]
    outs, sums = local(hvec, local_leaves)
    return tuple(_flatten(outs, _summed(sums, specs)))

  in_specs = (P(),) + tuple(spec for leaf, spec in zip(leaves, specs) for _ in leaf)
  out_specs = tuple(spec for n, spec in zip(n_outs, specs) for _ in range(n)) + (P(),) * (
      n_sums * len(leaves))
  # check_vma=False: the body computes each leaf's outputs from its own shards only.
  flat = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(hvec, *[x for leaf in leaves for x in leaf])
  return _unflatten(list(flat), n_outs, n_sums)


def _partitioned(local, hvec, leaves, out_dtypes, n_sums, blocked=None):
  n_outs = [len(d) for d in out_dtypes]
  arity = [len(leaf) for leaf in leaves]

  def split(flat_leaves):
    it = iter(flat_leaves)
    return [tuple(next(it) for _ in range(n)) for n in arity]

  def whole(hvec, *flat_leaves):
    return tuple(_flatten(*local(hvec, split(flat_leaves))))

  op = custom_partitioning(whole)

  def shardings(mesh, arg_shapes):
    leaf_shardings = [arg_shapes[1 + sum(arity[:i])].sharding for i in range(len(leaves))]
    if blocked is not None:
      leaf_shardings = [NamedSharding(mesh, blocked.spec(s.spec, leaf[0].shape, mesh))
                        for s, leaf in zip(leaf_shardings, leaves)]
    replicated = NamedSharding(mesh, P())
    args = (replicated,) + tuple(s for s, n in zip(leaf_shardings, arity) for _ in range(n))
    results = tuple(s for s, n in zip(leaf_shardings, n_outs) for _ in range(n)) + (
        replicated,) * (n_sums * len(leaves))
    return leaf_shardings, args, results

  def partition(mesh, arg_shapes, result_shape):
    leaf_shardings, args, results = shardings(mesh, arg_shapes)
    specs = [s.spec for s in leaf_shardings]

    def lower(hvec, *flat_leaves):
      outs, sums = local(hvec, split(flat_leaves))
      return tuple(_flatten(outs, _summed(sums, specs)))

    return mesh, lower, results, args

  def infer(mesh, arg_shapes, result_shape):
    return shardings(mesh, arg_shapes)[2]

  def factors(i, ndim, scale=False):  # a scale's last axis is a factor of its own
    names = [f"l{i}d{d}" for d in range(ndim)]
    if scale:
      names[-1] = f"l{i}s"
    return " ".join(names)

  scale_in = blocked.scale_inputs if blocked is not None else ()
  scale_out = blocked.scale_outputs if blocked is not None else ()
  operands = ["h"] + [factors(i, leaf[0].ndim, k in scale_in) for i, leaf in enumerate(leaves)
                      for k in range(len(leaf))]
  results = [factors(i, leaf[0].ndim, k in scale_out)
             for i, (leaf, n) in enumerate(zip(leaves, n_outs)) for k in range(n)] + [""] * (
      n_sums * len(leaves))
  op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                   sharding_rule=", ".join(operands) + " -> " + ", ".join(results))
  flat = op(hvec, *[x for leaf in leaves for x in leaf])
  return _unflatten(list(flat), n_outs, n_sums)


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
Triton kernel, TPU the Mosaic kernel. Only the platforms the step can run on are traced
(:func:`lowering_targets`): on a CPU-only process the step is the reference alone, unless
it is traced for an abstract GPU or TPU device (exporting for it). Of those, the kernel
platform's branch is traced with the step and the others only when it is lowered for
them (:mod:`~optirs_jax.pallas.lazy_branches`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optirs_jax.pallas import lazy_branches, mosaic_gpu, sharding
from optirs_jax.pallas.grouped import grouped_call, segment_totals
from optirs_jax.pallas.kernel import whole_leaf
from optirs_jax.pallas.op import (
  ElementwiseOp,
  Hyper,
  call_rule,
  hyper_vector,
  leaf_rows,
  output_dtypes,
  take_rows,
  with_leaf_values,
)
from optirs_jax.pallas.options import DEFAULT_OPTIONS, ExecutorOptions
from optirs_jax.pallas.packed import run_packed
from optirs_jax.planning.layout import (
  MAX_GROUPED_LEAF_ELEMENTS,
  MAX_POINTERS_PER_CALL,
  plan_grouped_calls,
  runs_in_place,
)

Leaf = tuple  # one leaf's arrays, in the rule's argument order

_FLOATS = frozenset({jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)})
KERNEL_DTYPES = {
    "cuda": _FLOATS,
    "mosaic_gpu": _FLOATS,
    "tpu": _FLOATS - {jnp.dtype(jnp.float16)},
    "interpret": _FLOATS,
}
# Pallas, for every platform it runs on: a dtype outside this set is an error on backend="pallas".
PALLAS_DTYPES = KERNEL_DTYPES["cuda"]


def norm_dtype(x: jax.Array):
  """The dtype a per-leaf norm is carried in: float64 for 64-bit leaves, else float32."""
  return jnp.float64 if jnp.finfo(x.dtype).bits > 32 else jnp.float32


def _sum_sq(x: jax.Array, reduce=jnp.sum) -> jax.Array:
  return reduce(jnp.real(x * jnp.conj(x)) if jnp.iscomplexobj(x) else x * x)


def _psum_varying(x: jax.Array, value: jax.Array, axes: Sequence[str]) -> jax.Array:
  """``value`` summed over those of ``axes`` that ``x`` varies over (inside shard_map)."""
  over = tuple(a for a in axes if a in sharding.varying_axes(x))
  return jax.lax.psum(value, over) if over else value


def _leaf_hyper(op: ElementwiseOp, h: Mapping, values, i: int) -> Hyper:
  """``h`` with leaf ``i``'s values of the op's per-leaf scalars (row ``i`` of ``values``)."""
  if not op.leaf_hyper:
    return Hyper(h)
  return Hyper(h, **{name: values[i][k] for k, name in enumerate(op.leaf_hyper)})


def _as_array(values) -> jax.Array | None:
  """Per-leaf values as one ``[leaves, scalars per leaf]`` array (the kernels read them from
  the launch's hyper-parameter vector). The reference takes the rows as they come: stacked,
  every leaf's norms join one XLA computation (XLA:CPU compiled GPT-2's LAMB 2-3x slower)."""
  if values is None or isinstance(values, jax.Array):
    return values
  return jnp.stack([jnp.stack(row) for row in values])


def _is_constant(value) -> bool:
  """Whether a hyper-parameter is a Python or NumPy scalar (a constant of the program)."""
  return isinstance(value, (bool, int, float, complex, np.generic))


def _rule_on_leaf(op: ElementwiseOp, constants: tuple, arrays: Mapping, leaf: Leaf):
  """The rule on one leaf, with ``h`` given as its constant scalars (Python or NumPy
  numbers, as ``(name, value)`` pairs) and its arrays."""
  h = Hyper(dict(constants), **arrays)
  index = jnp.arange(leaf[0].size, dtype=jnp.uint32).reshape(leaf[0].shape)
  return tuple(call_rule(op, h, leaf, index if op.indexed else None))


# The rule on one leaf as a jitted call: leaves of the same shapes and dtypes share one
# trace, and each further leaf costs a traced step one call, which XLA inlines, instead of
# the rule's operations (2000 leaves traced 2000 rules). The constants are static, so XLA
# still sees optax's exact expressions.
_jitted_rule_on_leaf = jax.jit(_rule_on_leaf, static_argnums=(0, 1))


def reference(op: ElementwiseOp, h: Mapping, leaves: Sequence[Leaf],
              norm_axes: Sequence[str] = (), leaf_values=None):
  """The jnp reference: the rule on each leaf, norms by ``jnp.linalg.norm`` (or, over
  ``norm_axes`` inside a ``shard_map``, by a ``psum`` of local sums of squares)."""
  hs = [_leaf_hyper(op, h, leaf_values, i) for i in range(len(leaves))]
  constants = tuple(sorted((k, v) for k, v in h.items() if _is_constant(v)))
  arrays = {k: v for k, v in h.items() if not _is_constant(v)}
  # Traced (inside a jit), one jitted call per leaf; run eagerly, op by op, as optax's
  # rule runs (one compiled call may round an intermediate differently, e.g. by an FMA).
  # A leaf's own scalars are arguments whatever their type: they differ from leaf to leaf.
  traced = any(isinstance(x, jax.core.Tracer) for leaf in leaves for x in leaf)
  rule = _jitted_rule_on_leaf if traced else _rule_on_leaf
  full = [rule(op, constants, arrays | {n: hi[n] for n in op.leaf_hyper}, leaf)
          for hi, leaf in zip(hs, leaves)]
  outs = [out[:len(out) - op.norm_only] for out in full]  # (not the norm-only outputs)
  if not op.has_norms:
    return outs, None
  norms = []
  for hi, leaf, out in zip(hs, leaves, full):
    xs = [leaf[i] for i in op.norm_inputs] + [out[i] for i in op.norm_outputs]
    if op.source is not None:
      xs = [op.source(hi, x) for x in xs]
    if op.means and norm_axes:  # the whole leaf's sum over its whole size
      values = [_psum_varying(leaf[0], _sum_sq(x), norm_axes)
                / _psum_varying(leaf[0], jnp.float32(x.size), norm_axes) for x in xs]
    elif op.means:  # one jnp.mean, as optax computes it (XLA may fuse the division in)
      values = [_sum_sq(x, jnp.mean) for x in xs]
    elif norm_axes:
      values = [jnp.sqrt(_psum_varying(leaf[0], _sum_sq(x), norm_axes)) for x in xs]
    else:
      values = [jnp.linalg.norm(x) for x in xs]
    norms.append(tuple(v.astype(norm_dtype(leaf[0])) for v in values))
  return outs, norms


def _route(op: ElementwiseOp, leaf: Leaf, platform: str, options: ExecutorOptions) -> str:
  """``"group"`` or ``"packed"`` (the packed or in-place layout) for a kernel leaf."""
  tiling = options.tiling(platform)
  groups = options.groups(platform)
  if runs_in_place(leaf[0].size, solo_min_elements=options.solo_min_blocks * tiling.block_elems,
                   solo_multiple=tiling.lanes):
    fits = leaf[0].size <= MAX_GROUPED_LEAF_ELEMENTS
    return "group" if groups and options.large_leaf_policy == "group" and fits else "packed"
  return "group" if groups else "packed"


def _on_reference(op: ElementwiseOp, leaf: Leaf, platform: str,
                  options: ExecutorOptions) -> bool:
  """Whether a leaf runs on the reference inside a kernel branch: dtypes the kernel does
  not take, inputs of mixed dtypes (unless the op computes them in float32), empty leaves,
  the policies' choices, and (for an indexed op) a leaf that would be packed with others
  and lose its element index. (On the optax-contract path every leaf of an elementwise
  rule is the reference's before any kernel branch: see :func:`execute`.)"""
  if not all(x.dtype in KERNEL_DTYPES[platform] for x in leaf) or leaf[0].size == 0:
    return True
  if not op.mixed_on_kernels and len({x.dtype for x in leaf}) > 1:
    return True
  tiling = options.tiling(platform)
  large = runs_in_place(leaf[0].size,
                        solo_min_elements=options.solo_min_blocks * tiling.block_elems,
                        solo_multiple=tiling.lanes)
  if op.leaf_hyper and _route(op, leaf, platform, options) != "group":
    return True  # per-leaf scalars: only the grouped kernel reads them
  if large:
    return False  # in place, or in the grouped launches
  if options.small_leaf_policy == "reference":  # a leaf the default plan would pack
    return True
  if op.indexed and not options.groups(platform):
    solo = options.small_leaf_policy == "solo" and runs_in_place(
        leaf[0].size, solo_min_elements=tiling.block_elems, solo_multiple=tiling.lanes)
    return not solo
  return False


def _local_kernels(op: ElementwiseOp, platform: str, options: ExecutorOptions, hvec, leaves,
                   out_dtypes):
  """The kernels on (local) leaves: per leaf the outputs and the float32 sums of squares
  of the op's norm sources. (Interpret mode cannot run on varying operands inside a
  ``shard_map`` that checks them: there the kernel's math runs in jnp, leaf by leaf.)"""
  if platform == "interpret" and any(sharding.varying_axes(x) for leaf in leaves for x in leaf):
    results = [whole_leaf(op, hvec, leaf, dts, j)
               for j, (leaf, dts) in enumerate(zip(leaves, out_dtypes))]
    return [r[0] for r in results], [r[1] for r in results]
  routes = [_route(op, leaf, platform, options) for leaf in leaves]
  outs: list = [None] * len(leaves)
  sums: list = [()] * len(leaves)

  def set_sums(members, partials, owner):
    # Each leaf owns a contiguous run of blocks: static slices, no index array.
    starts = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=len(members)))])
    for j, i in enumerate(members):
      sums[i] = tuple(jnp.sum(part[starts[j]:starts[j + 1]]) for part in partials)

  n_leaf_hyper = len(op.leaf_hyper)
  rows = leaf_rows(hvec, len(leaves), n_leaf_hyper) if n_leaf_hyper else None
  if g_idx := [i for i, r in enumerate(routes) if r == "group"]:
    tiling = options.grouped_tiling_for([*leaves[g_idx[0]], *out_dtypes[g_idx[0]]])
    n_ops = len(leaves[g_idx[0]]) + len(out_dtypes[g_idx[0]])
    calls = plan_grouped_calls([leaves[i][0].size for i in g_idx],
                               block_elems=tiling.block_elems, operands_per_leaf=n_ops,
                               max_pointers=_launch_buffers(options, platform))
    call_partials = []
    for call in calls:
      members = [g_idx[k] for k in call.leaves]
      aliases = [op.in_place(tuple(x.dtype for x in leaves[i]), out_dtypes[i]) for i in members]
      h_call = hvec
      if rows is not None:  # the members' per-leaf values, after the shared ones
        h_call = with_leaf_values(hvec, take_rows(rows, members))
      results, partials = grouped_call(op, h_call, [leaves[i] for i in members],
                                       [out_dtypes[i] for i in members], call,
                                       platform=platform, tiling=tiling, aliases=aliases)
      for i, res in zip(members, results):
        shape = leaves[i][0].shape
        outs[i] = tuple(y if y.shape == shape else y.reshape(shape) for y in res)
      call_partials.append(partials)
    # Every grouped leaf's totals in one more launch, in the calls' order.
    totals = segment_totals(call_partials, calls, platform=platform)
    for j, i in enumerate(g_idx[k] for call in calls for k in call.leaves):
      sums[i] = tuple(t[j] for t in totals)

  if p_idx := [i for i, r in enumerate(routes) if r == "packed"]:
    tiling = options.tiling(platform)
    solo_min = 1 if options.small_leaf_policy == "solo" else options.solo_min_blocks
    p_outs, parts = run_packed(op, hvec, [leaves[i] for i in p_idx],
                               [out_dtypes[i] for i in p_idx], platform=platform, tiling=tiling,
                               solo_min_elements=solo_min * tiling.block_elems)
    for j, i in enumerate(p_idx):
      outs[i] = p_outs[j]
    for members, partials, owner in parts:
      set_sums([p_idx[k] for k in members], partials, owner)
  return outs, sums


def kernel_platform(op: ElementwiseOp, platform: str, options: ExecutorOptions) -> str:
  """The kernels that run ``op`` on ``platform``: ``"mosaic_gpu"`` on CUDA when the options
  ask for it and it takes the op (no norms, indices or per-leaf scalars), else
  ``platform`` itself (``"cuda"``: Triton)."""
  if platform == "cuda" and options.gpu_kernels == "mosaic_gpu" and mosaic_gpu.supports(op):
    return "mosaic_gpu"
  return platform


def _kernels(op: ElementwiseOp, h: Mapping, leaves: Sequence[Leaf], platform: str,
             options: ExecutorOptions, norm_axes: Sequence[str] = (), leaf_values=None):
  platform = kernel_platform(op, platform, options)
  leaf_values = _as_array(leaf_values)
  on_ref = [_on_reference(op, leaf, platform, options) for leaf in leaves]
  outs: list = [None] * len(leaves)
  norms: list = [None] * len(leaves)
  if ref_idx := [i for i, r in enumerate(on_ref) if r]:
    r_outs, r_norms = reference(op, h, [leaves[i] for i in ref_idx], norm_axes,
                                take_rows(leaf_values, ref_idx) if op.leaf_hyper else None)
    for j, i in enumerate(ref_idx):
      outs[i] = r_outs[j]
      norms[i] = r_norms[j] if r_norms is not None else None
  if k_idx := [i for i, r in enumerate(on_ref) if not r]:
    k_leaves = [leaves[i] for i in k_idx]
    out_dtypes = output_dtypes(op, h, k_leaves)
    stored = [d[:len(d) - op.norm_only] for d in out_dtypes]
    n_sums = len(op.norm_inputs) + len(op.norm_outputs)
    local = lambda hvec, local_leaves: _local_kernels(op, platform, options, hvec,
                                                      local_leaves, stored)
    # With per-leaf scalars, local leaf j's values follow the shared ones in its vector,
    # at NHP + j * len(op.leaf_hyper).
    k_outs, k_sums = sharding.run_local(local, hyper_vector(h, op.hyper), k_leaves, stored,
                                        n_sums, tuple(norm_axes),
                                        take_rows(leaf_values, k_idx) if op.leaf_hyper else None)
    for j, i in enumerate(k_idx):
      outs[i] = k_outs[j]
      if n_sums:
        # Each norm is rounded to its array's dtype, as jnp.linalg.norm of it would be.
        dtypes = ([leaves[i][k].dtype for k in op.norm_inputs]
                  + [out_dtypes[j][k] for k in op.norm_outputs])
        root = jnp.sqrt
        if op.means:  # the sums over the whole leaf's size (all its shards)
          size = _psum_varying(leaves[i][0], jnp.float32(leaves[i][0].size), norm_axes)
          root = lambda s, n=size: s / n.astype(s.dtype)
        norms[i] = tuple(root(s).astype(dt).astype(norm_dtype(leaves[i][0]))
                         for s, dt in zip(k_sums[j], dtypes))
  return outs, (norms if op.has_norms else None)


def _launch_buffers(options: ExecutorOptions, platform: str) -> int:
  """The buffers a grouped launch may hold: the option's, kept to the 4 KB parameter space
  where this process has a CUDA GPU older than Volta."""
  if platform == "cuda" and _oldest_cuda_capability() < 7.0:
    return min(options.grouped_max_buffers, MAX_POINTERS_PER_CALL)
  return options.grouped_max_buffers


@functools.cache
def _oldest_cuda_capability() -> float:
  """The lowest compute capability of this process's CUDA GPUs (infinity where it has none:
  a compile-only target is taken to be current)."""
  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return float("inf")
  return min((float(getattr(d, "compute_capability", "inf")) for d in devices),
             default=float("inf"))


@functools.cache
def _in_process(platform: str) -> bool:
  try:
    return bool(jax.devices(platform))
  except RuntimeError:  # no such backend in this process
    return False


def _platform_of(mesh) -> str | None:
  device = getattr(mesh, "abstract_device", None)
  platform = getattr(device, "platform", None)
  if platform == "gpu":  # a compile-only GPU topology names no vendor; its kind does
    kind = getattr(device, "device_kind", None) or ""
    return "cuda" if kind.startswith("NVIDIA") else None
  return platform


def lowering_targets(leaves: Sequence[Leaf] = ()) -> frozenset[str]:
  """The kernel platforms a step traced now can run on: those this process has devices
  of, the platform of an abstract mesh being traced for (``jax.export`` under
  ``jax.sharding.use_abstract_mesh``), and the platform of the mesh the traced leaves are
  sharded on (``jit(...).trace`` of ``NamedSharding``-ed shapes on compile-only devices,
  e.g. a TPU topology from a CPU host). Branches for other platforms are not traced.

  A ``SingleDeviceSharding`` carries no mesh into the trace: to compile for a device this
  process cannot run on, shard the inputs with a ``NamedSharding`` (a one-device mesh will
  do) or trace under ``jax.sharding.use_abstract_mesh``. A compile-only GPU topology
  (``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=...)``)
  calls its platform ``"gpu"``: an NVIDIA device kind makes it ``"cuda"``. (Pallas's
  Triton lowering then also needs the abstract mesh of that device as the context.)"""
  targets = {p for p in ("cuda", "tpu") if _in_process(p)}
  meshes = [jax.sharding.get_abstract_mesh()]
  for leaf in leaves[:1]:  # the leaves of one step share a mesh
    for x in leaf:
      meshes.append(getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None))
  for mesh in meshes:
    platform = _platform_of(mesh)
    if platform in ("cuda", "tpu"):
      targets.add(platform)
  return frozenset(targets)


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
            options: ExecutorOptions = DEFAULT_OPTIONS, fused_apply: bool = False,
            norm_axes: Sequence[str] = (), leaf_values=None):
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
    norm_axes: inside a ``shard_map``, the mesh axes the leaves are sharded over: a leaf's
      norms are summed over those it varies over (outside, shardings say it).
    leaf_values: for an op with ``leaf_hyper``, a ``[leaves, len(op.leaf_hyper)]`` array
      or a sequence of such rows (of scalars): row ``i`` holds leaf ``i``'s values (in its
      dtype on the reference, float32 in a kernel).

  Returns:
    ``(outs, norms)``: per leaf the rule's outputs, and per leaf a tuple of norms (or None).
  """
  leaves = [tuple(leaf) for leaf in leaves]
  norm_axes = tuple(norm_axes)
  want = (len(leaves), len(op.leaf_hyper))
  if isinstance(leaf_values, jax.Array) or leaf_values is None:
    got = None if leaf_values is None else tuple(jnp.shape(leaf_values))
  else:  # rows: their count, then their length where they agree
    lengths = sorted({len(row) for row in leaf_values}) or [len(op.leaf_hyper)]
    got = (len(leaf_values), *lengths) if len(lengths) == 1 else (
        f"{len(leaf_values)} rows of lengths {lengths}")
  if op.leaf_hyper and got != want:
    raise ValueError(f"op {op.name} reads per-leaf scalars {op.leaf_hyper}: leaf_values must "
                     f"have shape {want} (leaves, scalars per leaf); got {got}")
  ref = lambda h, leaves, leaf_values: reference(op, h, leaves, norm_axes, leaf_values)
  kernel = lambda platform: lambda h, leaves, leaf_values: _kernels(
    op, h, leaves, platform, options, norm_axes, leaf_values)
  if backend == "jnp" or not leaves:
    return ref(h, leaves, leaf_values)
  targets = lowering_targets(leaves)
  if backend == "auto":
    if options.updates_on_reference and not fused_apply and not op.has_norms:
      return ref(h, leaves, leaf_values)  # XLA fuses it with its neighbours
    branches = {p: kernel(p) for p in ("cuda", "tpu") if p in targets}
    if not branches:  # nothing but the reference can run: no branch to trace
      return ref(h, leaves, leaf_values)
    return _by_platform((h, leaves, leaf_values), norm_axes, branches | {"cpu": ref}, ref)
  if backend == "pallas":
    branches = {p: kernel(p) for p in ("cuda", "tpu") if p in targets}
    if not branches:
      return kernel("interpret")(h, leaves, leaf_values)
    return _by_platform((h, leaves, leaf_values), norm_axes, branches, kernel("interpret"))
  raise ValueError(f"{backend=} is not one of ('auto', 'jnp', 'pallas')")


def _by_platform(args, norm_axes, branches, default):
  """``platform_dependent`` of ``branches`` (and ``default``), each taking ``(h, leaves,
  leaf_values)`` of ``args``. The first branch (a kernel platform) is traced now, the
  others only when the step is lowered for their platform
  (:mod:`~optirs_jax.pallas.lazy_branches`): a GPU step does not trace the CPU's
  reference. Inside a ``shard_map`` (``norm_axes``) every branch is traced now, where the
  mesh axes the norms sum over are bound."""
  h, leaves, leaf_values = args
  flat, tree = jax.tree.flatten((dict(h), leaves, leaf_values))
  dynamic = [isinstance(x, (jax.Array, jax.core.Tracer)) for x in flat]

  def with_args(fn):  # ``fn`` of the arrays among ``args``, the rest fixed
    def run(arrays):
      it = iter(arrays)
      h, leaves, leaf_values = jax.tree.unflatten(
        tree, [next(it) if d else x for x, d in zip(flat, dynamic)])
      return fn(h, leaves, leaf_values)
    return run

  arrays = [x for x, d in zip(flat, dynamic) if d]
  run = {p: with_args(fn) for p, fn in branches.items()}
  if norm_axes:
    return jax.lax.platform_dependent(arrays, default=with_args(default), **run)
  return lazy_branches.platform_dependent(arrays, default=with_args(default), **run)

"""What an executor runs: an elementwise rule over a list of leaves, described as a value.

An :class:`ElementwiseOp` is everything the executors need to know about an optimizer's
update: the rule (a jnp function on arrays of one shape), the names of the scalars it reads
(the layout of the kernel's hyper-parameter vector), what padded lanes hold, which outputs
may take an input's buffer, and which per-leaf norms to return. It is hashable: it is part
of every kernel cache key, together with the :class:`~optirs_jax.pallas.options.ExecutorOptions`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NHP = 32  # hyper-parameter vector length: a power of two, 128 bytes of f32.
LANES = 128


class Hyper(dict):
  """Scalar hyper-parameters of one step, readable as attributes (``h.b1``)."""

  def __getattr__(self, name: str) -> Any:
    try:
      return self[name]
    except KeyError:
      raise AttributeError(name) from None


@dataclasses.dataclass(frozen=True)
class ElementwiseOp:
  """An elementwise rule and how the executors wire its operands.

  Attributes:
    rule: ``rule(h, *inputs, compute_dtype=None[, index=...]) -> tuple of outputs`` in their
      final dtypes, elementwise, jnp only; hashable (a module-level function or a frozen
      dataclass), since it keys the kernel caches. Kernels pass
      ``compute_dtype=jnp.float32``: narrower inputs are computed in float32 and rounded once.
    hyper: the names of the scalars of ``h`` the rule reads, in the order of the kernel's
      ``f32[NHP]`` vector.
    pads: per input, the value padded or masked-out lanes hold; chosen so that such lanes
      compute finite outputs and contribute nothing to a norm.
    aliases: ``(input, output)`` positions that may share a buffer (updated in place when
      their dtypes agree): the state and, on the fused apply, the params.
    norm_inputs, norm_outputs: positions whose per-leaf L2 norms the executor returns.
    name: the kernel's name in the compiled program.
    indexed: the rule takes ``index=``: each element's index in its leaf (``uint32``, the
      shape of the block), for counter-based random numbers.
    mixed_on_kernels: a leaf whose inputs have several dtypes may run in a kernel (the rule
      computes it in float32 by design); otherwise it runs on the reference, whose
      op-by-op promotion (weak Python-float scalars included) a kernel cannot repeat.
    leaf_hyper: names of scalars that differ from leaf to leaf (LAMB's per-leaf norms in
      its second pass): the executor takes one value per leaf and name, and the rule
      reads them from ``h`` like the others. Kernels read them from the launch's
      hyper-parameter vector, after the ``NHP`` shared ones; only the grouped kernel
      takes them (other layouts run such an op on the reference).
    source: ``source(h, x)``, applied to each norm source before its sum of squares (a
      module-level function; ``None``: the source itself). ``x * 0`` makes the "norm" a
      finiteness check: 0 where every element is finite, NaN elsewhere.
    means: the executor returns the mean of each norm source's squares (as
      ``jnp.mean(|x|^2)``: the sum over the whole leaf, divided by its size), not its norm.
    norm_only: the rule's last ``norm_only`` outputs are norm sources only (named in
      ``norm_outputs``): the executors neither store nor return them, so a pass that only
      measures (a reduction's first pass, whose second reruns the rule) reads its inputs
      and writes nothing but the block sums. Kernels square them as computed (in float32).
    unguarded: for a rule that keeps every input where ``h.finite`` is 0 (a skipped step),
      the same rule without that guard. A kernel whose outputs all take their inputs'
      buffers may run it under ``h.finite > 0`` instead: on a skipped step it neither
      reads nor writes, and on the others it reads nothing the guard alone needed (the old
      low-precision params of a master-weights step) and selects nothing.
  """

  rule: Callable
  hyper: tuple[str, ...]
  pads: tuple[float, ...]
  aliases: tuple[tuple[int, int], ...] = ()
  norm_inputs: tuple[int, ...] = ()
  norm_outputs: tuple[int, ...] = ()
  name: str = "optirs_kernel"
  indexed: bool = False
  mixed_on_kernels: bool = False
  leaf_hyper: tuple[str, ...] = ()
  source: Callable | None = None
  unguarded: Callable | None = None
  means: bool = False
  norm_only: int = 0

  @property
  def has_norms(self) -> bool:
    return bool(self.norm_inputs or self.norm_outputs)

  def skips_in_place(self, aliases: Sequence[Mapping[int, int]], n_out: int) -> bool:
    """Whether a kernel with these in-place ``{input: output}`` pairs per leaf runs
    :attr:`unguarded` under ``h.finite > 0``: every output takes an input's buffer (an
    untouched buffer keeps the input's value), and there are no norms to write."""
    return (self.unguarded is not None and not self.has_norms
            and all(set(a.values()) == set(range(n_out)) for a in aliases))

  def in_place(self, in_dtypes: Sequence, out_dtypes: Sequence) -> dict[int, int]:
    """``{input: output}`` of the aliases whose two dtypes agree."""
    return {i: o for i, o in self.aliases
            if i < len(in_dtypes) and o < len(out_dtypes) and in_dtypes[i] == out_dtypes[o]}


def output_dtypes(op: ElementwiseOp, h: Mapping, leaves: Sequence[Sequence[jax.Array]]):
  """The rule's output dtypes per leaf, as the reference computes them (one abstract
  evaluation per distinct tuple of input dtypes: the rule is elementwise)."""
  cache: dict[tuple, tuple] = {}
  out = []
  for leaf in leaves:
    key = tuple(jnp.dtype(x.dtype) for x in leaf)
    if key not in cache:
      scalars = [jax.ShapeDtypeStruct((), dt) for dt in key]
      hl = Hyper(h, **{name: jnp.float32(0) for name in op.leaf_hyper})
      results = jax.eval_shape(lambda *a, hl=hl: tuple(call_rule(op, hl, a, jnp.uint32(0))),
                               *scalars)
      cache[key] = tuple(a.dtype for a in results)
    out.append(cache[key])
  return out


def call_rule(op: ElementwiseOp, h, inputs: Sequence[jax.Array], index=None,
              compute_dtype=None):
  """The op's rule on ``inputs`` (with ``index`` when the op is indexed)."""
  if op.indexed:
    return op.rule(h, *inputs, index=index, compute_dtype=compute_dtype)
  return op.rule(h, *inputs, compute_dtype=compute_dtype)


def hyper_vector(h: Mapping, names: Sequence[str]) -> jax.Array:
  """Packs the named scalars into one ``f32[NHP]`` vector (zeros after the last)."""
  if len(names) > NHP:
    raise ValueError(f"{len(names)=} hyper-parameters do not fit the {NHP=} vector")
  values = [jnp.asarray(h[n], jnp.float32).reshape(()) for n in names]
  values += [jnp.zeros((), jnp.float32)] * (NHP - len(values))
  return jnp.stack(values)


def read_hyper(h_ref, names: Sequence[str], leaf_names: Sequence[str] = (),
               leaf: int = 0) -> Hyper:
  """The scalars of a kernel's hyper-parameter vector (a ref or an array), by name: the
  shared ones first, then (``leaf_names``) those of the ``leaf``-th leaf of the launch,
  which sit at ``NHP + leaf * len(leaf_names)``."""
  h = Hyper({name: h_ref[i] for i, name in enumerate(names)})
  base = NHP + leaf * len(leaf_names)
  h.update({name: h_ref[base + j] for j, name in enumerate(leaf_names)})
  return h


def take_rows(values: jax.Array, rows: Sequence[int]) -> jax.Array:
  """``values[rows]`` for static ``rows``: a slice when they are a contiguous run."""
  rows = list(rows)
  if rows == list(range(rows[0], rows[0] + len(rows))):
    return values[rows[0]:rows[0] + len(rows)]
  return jnp.take(values, np.asarray(rows), axis=0)


def with_leaf_values(hvec: jax.Array, values: jax.Array) -> jax.Array:
  """A launch's hyper-parameter vector: the shared ``f32[NHP]`` of ``hvec`` followed by
  ``values`` (``[leaves, per-leaf scalars]``) row by row, zero-padded to a power of two
  (a Triton block's length). A few array ops, whatever the number of leaves."""
  flat = values.astype(jnp.float32).reshape(-1)
  size = NHP + flat.size
  padded = 1 << (size - 1).bit_length()
  return jnp.concatenate([hvec[:NHP], flat, jnp.zeros((padded - size,), jnp.float32)])


def leaf_rows(hvec: jax.Array, leaves: int, per_leaf: int) -> jax.Array:
  """The ``[leaves, per_leaf]`` values :func:`with_leaf_values` appended to ``hvec``."""
  return hvec[NHP:NHP + leaves * per_leaf].reshape(leaves, per_leaf)


def block_math(op: ElementwiseOp, h: Hyper, blocks: Sequence[jax.Array], out_dtypes: Sequence,
               index=None):
  """What a kernel computes on one block: the outputs, and the blocks whose sums of squares
  the op's norms need (inputs as read, outputs as stored; ``out_dtypes`` names the stored
  outputs only: an :attr:`ElementwiseOp.norm_only` output is squared as computed).

  Computes in float32 and rounds once on store (half-precision leaves included); ``index``
  is the block's element indices in their leaf (for an indexed op).
  """
  ins = [x.astype(jnp.float32) for x in blocks]
  results = call_rule(op, h, blocks, index, compute_dtype=jnp.float32)
  outs = [x.astype(dt) for x, dt in zip(results, out_dtypes)]
  sources = [ins[i] for i in op.norm_inputs] + [
      (outs[i] if i < len(outs) else results[i]).astype(jnp.float32) for i in op.norm_outputs]
  if op.source is not None:
    sources = [op.source(h, x) for x in sources]
  return outs, sources


def partial_sum_of_squares(x: jax.Array) -> jax.Array:
  """A ``(1, LANES)`` row whose lanes add up to ``sum(x**2)``: lane-wise sums of a 2-D
  block, or a 1-D block's total in lane 0."""
  if x.ndim == 2:
    return jnp.sum(x * x, axis=0, keepdims=True)
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1)
  return jnp.where(lane == 0, jnp.sum(x * x), 0.0)

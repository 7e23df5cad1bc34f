"""Launch-plan variants of the grouped kernel, named by one string, for the benchmarks that
time or compile them side by side (``benchmarks/grouped_tiling.py``, ``xla_sass.py``).

A spec is ``MAX[/SPLIT[/BLOCKS]][:greedy][:branch][:select][:stream]``: the buffers a launch
holds at most (``ExecutorOptions.grouped_max_buffers``), and those and the blocks after
which it closes (``plan_grouped_calls``'s ``split_pointers``, default ``MAX``, and
``split_blocks``, default the planner's: ``SPLIT_ELEMENTS`` elements in blocks); ``:greedy``
cuts without following repeated runs of leaves (``repeat=False``), ``:branch`` puts one
branch per leaf around its loads and stores instead of the leaf table
(``grouped.POINTER_SELECT = False``), ``:select`` leaves the leaf table's search unmarked,
so the compilers flatten it into selects over every leaf's pointers
(``leaf_table.MARKED_BRANCHES = False``), ``:stream`` gives the leaf table's loads and
stores the evict-first cache hint (``leaf_table.STREAMING_HINTS = True``).

>>> v = PlanVariant.parse("1512/112:select")
>>> (v.max_pointers, v.split_pointers, v.split_blocks, v.repeat, v.pointer_select, v.marked,
...  v.streaming)
(1512, 112, None, True, True, False, False)
>>> PlanVariant.parse("384:fast")
Traceback (most recent call last):
...
ValueError: unknown plan flags ['fast'] in '384:fast'; valid: greedy, branch, select, stream
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax

from optirs_jax.pallas import dispatch, grouped, leaf_table
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.planning.layout import plan_grouped_calls

FLAGS = ("greedy", "branch", "select", "stream")


@dataclasses.dataclass(frozen=True)
class PlanVariant:
  max_pointers: int
  split_pointers: int
  split_blocks: int | None = None
  repeat: bool = True
  pointer_select: bool = True
  marked: bool = True
  streaming: bool = False

  @classmethod
  def parse(cls, spec: str) -> PlanVariant:
    bounds, *flags = spec.split(":")
    unknown = sorted(set(flags) - set(FLAGS))
    if unknown:
      raise ValueError(f"unknown plan flags {unknown} in {spec!r}; valid: {', '.join(FLAGS)}")
    try:
      pointers, split, blocks = (bounds.split("/") + [None, None])[:3]
      return cls(int(pointers), int(split or pointers), int(blocks) if blocks else None,
                 repeat="greedy" not in flags, pointer_select="branch" not in flags,
                 marked="select" not in flags, streaming="stream" in flags)
    except ValueError:
      raise ValueError(f"plan {spec!r} is not MAX[/SPLIT[/BLOCKS]] of ints, with flags "
                       f"among {', '.join(FLAGS)}") from None

  def options(self, base: ExecutorOptions | None = None) -> ExecutorOptions:
    """``base`` (default options) with this variant's launch bound."""
    return dataclasses.replace(base or ExecutorOptions(), grouped_max_buffers=self.max_pointers)

  def plan(self, sizes, *, block_elems: int, operands_per_leaf: int):
    """The launches this variant plans for leaves of ``sizes``."""
    return plan_grouped_calls(sizes, block_elems=block_elems,
                              operands_per_leaf=operands_per_leaf, max_pointers=self.max_pointers,
                              split_pointers=self.split_pointers, split_blocks=self.split_blocks,
                              repeat=self.repeat)


@contextlib.contextmanager
def plan_variant(spec: str):
  """Yields the :class:`PlanVariant` of ``spec`` with the planner and the kernel's switches
  set to it (steps must take ``variant.options()``), and jax's caches cleared so each
  variant traces its launches anew; puts the module's defaults back after."""
  variant = PlanVariant.parse(spec)
  dispatch.plan_grouped_calls = functools.partial(
    plan_grouped_calls, split_pointers=variant.split_pointers,
    split_blocks=variant.split_blocks, repeat=variant.repeat)
  grouped.POINTER_SELECT = variant.pointer_select
  leaf_table.MARKED_BRANCHES = variant.marked
  leaf_table.STREAMING_HINTS = variant.streaming
  grouped._launch.cache_clear()
  jax.clear_caches()
  try:
    yield variant
  finally:
    dispatch.plan_grouped_calls = plan_grouped_calls
    grouped.POINTER_SELECT = True
    leaf_table.MARKED_BRANCHES = True
    leaf_table.STREAMING_HINTS = False
    grouped._launch.cache_clear()

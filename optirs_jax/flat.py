"""An opt-in flat parameter layout: a pytree's leaves kept in one buffer per dtype.

A model with thousands of small leaves makes a step handle thousands of arrays: optax
launches thousands of kernels, packing the leaves into one buffer per step costs about as
much, and the host's work per call of such a step bounds it whatever the optimizer
(``benchmarks/NOTES.md`` has the measurements). Keeping the parameters flat between
steps removes all three: the model reads its weights as views of the buffer
(:meth:`FlatLayout.unravel` inside the loss), ``jax.grad`` of such a loss *is* a flat
buffer, and the optimizer sees one leaf per dtype, which the kernel updates in place.

Each leaf starts on a multiple of ``align`` elements (zero padding between leaves, planned
by :func:`optirs_jax.planning.plan_layout`); the padding has zero gradient and stays zero
under every optimizer here. For the elementwise optimizers (Adam, AdamW without a mask,
SGD, RMSprop, Adagrad) a step on the flat buffers gives exactly the numbers of the same
step on the tree. LAMB's trust ratio is per leaf: on a flat buffer it would be one ratio
for the whole buffer, a different optimizer -- keep LAMB on the tree. Masks (``mask=``)
see the buffers, not the leaves.

``benchmarks/NOTES.md`` compares the optimizer on the 2000 x 16K-leaf tree's parameters
as one buffer (the bench's ``leaves-flat`` tree) with the same tree leaf by leaf. What
reading the weights as views costs the model's own forward and backward passes is not
measured there.

>>> import jax, jax.numpy as jnp, optirs_jax
>>> params = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4), "h": jnp.ones(2, jnp.bfloat16)}
>>> layout = optirs_jax.flat.FlatLayout.of(params)
>>> flat = layout.ravel(params)
>>> {k: v.shape for k, v in flat.items()}
{'bfloat16': (128,), 'float32': (256,)}
>>> loss = lambda flat: jnp.sum(layout.unravel(flat)["w"] ** 2)
>>> opt = optirs_jax.adam(1e-2)
>>> state = opt.init(flat)
>>> flat, state = optirs_jax.apply(opt, jax.grad(loss)(flat), state, flat)
>>> layout.unravel(flat)["w"][0, 0]
Array(0.99000007, dtype=float32)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from optirs_jax.planning.layout import plan_layout

__all__ = ["FlatLayout"]


class _FrozenMap(dict):
  """A read-only dict that hashes (so a layout can be a static argument of ``jax.jit``)."""

  def __hash__(self):
    return hash(tuple(sorted(self.items())))

  def _readonly(self, *args, **kwargs):
    raise TypeError("a FlatLayout's mappings are read-only")

  __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly


@dataclasses.dataclass(frozen=True)
class FlatLayout:
  """Where each leaf of a pytree lives in its dtype's flat buffer.

  Attributes:
    treedef: the tree's structure.
    shapes, dtypes: each leaf's shape and dtype, in ``jax.tree.leaves`` order.
    slots: for each leaf, ``(buffer name, offset, size)``.
    sizes: each buffer's length (a multiple of ``align``).
    buffer_dtypes: each buffer's dtype.

  Layouts are hashable values (equal layouts hash equally), so a step can take one as a
  static argument.
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[jnp.dtype, ...]
  slots: tuple[tuple[str, int, int], ...]
  sizes: dict[str, int]
  buffer_dtypes: dict[str, jnp.dtype]

  @classmethod
  def of(cls, tree, *, align: int = 128,
         max_buffer_elements: int = 1 << 30) -> FlatLayout:
    """Plans the buffers for ``tree`` (arrays or ``jax.ShapeDtypeStruct`` leaves).

    Args:
      tree: the parameters.
      align: every leaf starts at a multiple of this many elements (the kernels' lane
        count by default; 1 packs the leaves back to back).
      max_buffer_elements: a dtype whose leaves hold more is split over several buffers,
        named ``"float32"``, ``"float32_1"``, ...
    """
    if align <= 0:
      raise ValueError(f"{align=} must be a positive number of elements")
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
      raise ValueError("FlatLayout.of needs a tree with at least one array leaf")
    for i, x in enumerate(leaves):
      if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"leaf {i} of the tree is {type(x).__name__}, not an array; "
                        "FlatLayout takes arrays or jax.ShapeDtypeStruct leaves")
    shapes = tuple(tuple(int(d) for d in x.shape) for x in leaves)
    dtypes = tuple(jnp.dtype(x.dtype) for x in leaves)
    sizes = [int(x.size) for x in leaves]
    plan = plan_layout(sizes, [str(dt) for dt in dtypes], block_elems=align,
                       solo_min_elements=max_buffer_elements + 1, solo_multiple=1,
                       max_group_elements=max(max_buffer_elements, align))
    slots: list[tuple[str, int, int] | None] = [None] * len(leaves)
    buffers: dict[str, int] = {}
    buffer_dtypes: dict[str, jnp.dtype] = {}
    seen: dict[str, int] = {}
    for group in plan.groups:
      k = seen.get(group.key, 0)
      seen[group.key] = k + 1
      name = group.key if k == 0 else f"{group.key}_{k}"
      buffers[name] = group.total
      for place in group.placements:
        slots[place.leaf] = (name, place.offset, place.size)
        buffer_dtypes[name] = dtypes[place.leaf]
    for i in range(len(leaves)):  # zero-size leaves take no space
      if slots[i] is None:
        slots[i] = (str(dtypes[i]), 0, 0)
        buffers.setdefault(str(dtypes[i]), 0)
        buffer_dtypes.setdefault(str(dtypes[i]), dtypes[i])
    return cls(treedef, shapes, dtypes, tuple(slots), _FrozenMap(sorted(buffers.items())),
               _FrozenMap(buffer_dtypes))

  def ravel(self, tree) -> dict[str, jax.Array]:
    """The tree's leaves copied into their buffers (zeros between leaves)."""
    leaves, treedef = jax.tree.flatten(tree)
    if treedef != self.treedef:
      raise ValueError(f"the tree's structure {treedef} is not the layout's {self.treedef}")
    parts: dict[str, list] = {name: [] for name in self.sizes}
    ends = dict.fromkeys(self.sizes, 0)
    for i, (x, (name, offset, size)) in enumerate(zip(leaves, self.slots)):
      if tuple(x.shape) != self.shapes[i] or jnp.dtype(x.dtype) != self.dtypes[i]:
        raise ValueError(f"leaf {i} is {jnp.dtype(x.dtype)}{list(x.shape)}; the layout has "
                         f"{self.dtypes[i]}{list(self.shapes[i])}")
      if not size:
        continue
      if offset > ends[name]:
        parts[name].append(jnp.zeros((offset - ends[name],), self.dtypes[i]))
      parts[name].append(jnp.ravel(x))
      ends[name] = offset + size
    out = {}
    for name, total in self.sizes.items():
      dtype = self.buffer_dtypes[name]
      if total > ends[name]:
        parts[name].append(jnp.zeros((total - ends[name],), dtype))
      out[name] = jnp.concatenate(parts[name]) if parts[name] else jnp.zeros((0,), dtype)
    return out

  def unravel(self, buffers: dict[str, jax.Array]):
    """The tree, each leaf a view (slice and reshape) of its buffer; differentiable."""
    if not isinstance(buffers, dict) or set(buffers) != set(self.sizes):
      got = sorted(buffers) if isinstance(buffers, dict) else type(buffers).__name__
      raise ValueError(f"expected a dict of buffers named {sorted(self.sizes)}; got {got}")
    for name, total in self.sizes.items():
      x = buffers[name]
      if tuple(x.shape) != (total,) or jnp.dtype(x.dtype) != self.buffer_dtypes[name]:
        raise ValueError(f"buffer {name!r} is {jnp.dtype(x.dtype)}{list(x.shape)}; the "
                         f"layout has {self.buffer_dtypes[name]}[{total}]")
    leaves = [jax.lax.slice(buffers[name], (offset,), (offset + size,)).reshape(shape)
              for (name, offset, size), shape in zip(self.slots, self.shapes)]
    return jax.tree.unflatten(self.treedef, leaves)

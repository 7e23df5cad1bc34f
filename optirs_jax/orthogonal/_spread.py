"""Spreading Newton–Schulz stacks over a mesh by whole matrices: which mesh, which axes,
and the constraint that places each device's matrices."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P


def mesh_of(leaves):
  """The context mesh, or else the mesh of the first leaf sharded on Explicit axes (its
  Auto axes dropped: without a context mesh no constraint can name them)."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    return mesh, mesh.axis_names
  for x in leaves:
    m = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if m is not None and not m.empty and AxisType.Explicit in m.axis_types:
      return m, tuple(a for a, t in zip(m.axis_names, m.axis_types) if t == AxisType.Explicit)
  return mesh, ()


def spread_axes(mesh, usable, ns_axes) -> tuple[str, ...]:
  """The mesh axes (of more than one device) to spread stacks over."""
  if ns_axes is None or not usable:
    return ()
  kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  if ns_axes == "auto":
    axes = [a for a in usable if kinds[a] != AxisType.Manual]
  else:
    axes = [ns_axes] if isinstance(ns_axes, str) else list(ns_axes)
    unknown = [a for a in axes if a not in usable]
    if unknown:
      raise ValueError(f"ns_axes={ns_axes!r} names {unknown}, not axes of the mesh "
                       f"{dict(mesh.shape)} it can spread over; valid: 'auto', None or names "
                       f"among {tuple(usable)}")
    if any(kinds[a] == AxisType.Manual for a in axes):
      raise ValueError(f"ns_axes={ns_axes!r}: inside shard_map the leaves are the device's "
                       "shards; spread over axes that are not manual")
  return tuple(a for a in axes if mesh.shape[a] > 1)


def spread(stack, mesh, axes):
  """``stack`` padded with zero matrices to a multiple of the devices of ``axes`` and
  constrained to be sharded over them by matrix."""
  n = math.prod(mesh.shape[a] for a in axes)
  if stack.shape[0] % n:
    pad = n - stack.shape[0] % n
    stack = jnp.concatenate([stack, jnp.zeros((pad, *stack.shape[1:]), stack.dtype)])
  return jax.lax.with_sharding_constraint(stack, P(axes if len(axes) > 1 else axes[0]))

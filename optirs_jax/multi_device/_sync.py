"""Gradient synchronization across devices: JAX collectives inside ``shard_map``/``pmap``."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from optirs_jax.pallas.sharding import varying_axes

OPS = ("mean", "sum")


def axis_names(fn: str, axis_name) -> tuple[str, ...]:
  """``axis_name`` as a tuple, each checked to be an axis of the surrounding ``shard_map``
  or ``pmap`` (a ValueError naming it and the axes there are, where JAX has a NameError)."""
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name or ())
  if not names or not all(isinstance(n, str) for n in names):
    raise ValueError(f"{fn}: axis_name={axis_name!r} must be a mesh axis name or a tuple "
                     "of them")
  for name in names:
    try:
      jax.lax.axis_size(name)
    except NameError:
      mesh_axes = tuple(jax.sharding.get_abstract_mesh().axis_names)
      raise ValueError(f"{fn}: axis_name {name!r} is not an axis of the surrounding "
                       f"shard_map or pmap (its axes: {mesh_axes}); call it inside "
                       "jax.shard_map(..., mesh=...) over that axis") from None
  return names


def check_per_device(fn: str, grads, names: tuple[str, ...]) -> None:
  """A ValueError naming the leaf when a gradient is already the same on every device along
  ``names`` (inside a ``shard_map`` that checks varying axes): JAX summed it over the
  devices when it differentiated at the replicated params, and averaging it again would
  give N times the gradient. (Where the ``shard_map`` does not check them, nothing tells.)"""
  probe = jax.lax.pcast(jnp.zeros((), jnp.float32), names, to="varying")
  if not set(names) <= varying_axes(probe):
    return  # check_vma=False (or pmap): the types carry no varying axes
  paths = jax.tree_util.tree_flatten_with_path(grads)[0]
  for path, g in paths:
    missing = [n for n in names if n not in varying_axes(g)]
    if missing:
      raise ValueError(
          f"{fn}: gradient leaf {jax.tree_util.keystr(path) or '<root>'} is already the same "
          f"on every device along {tuple(missing)}: JAX summed it over the devices when it "
          "differentiated at the replicated params, so reducing it again would give "
          f"{' x '.join(str(jax.lax.axis_size(n)) for n in missing)} times the gradient. "
          "Differentiate at a per-device copy, jax.tree.map(lambda p: jax.lax.pcast(p, "
          f"{tuple(names)!r}, to='varying'), params), or drop the synchronization")


def sync_gradients(grads, axis_name: str | Sequence[str], *, op: str = "mean"):
  r"""All-reduces gradients over a mesh axis: inside ``shard_map`` or ``pmap``.

  .. math:: g \leftarrow \frac{1}{n}\sum_{d=1}^{n} g_d \quad (\text{``op="sum"``: } \sum_d g_d)

  One ``psum`` per leaf (XLA combines them; NCCL on GPUs, ICI on TPUs). Gradients of
  replicated params are varying over the axis inside a checked ``shard_map``; the result
  is replicated (invariant) again. A gradient that is already invariant there (taken at
  the replicated params themselves, which makes JAX sum it over the devices) is a
  ValueError naming the leaf: reducing it again would multiply it by the device count.

  Args:
    grads: a tree of gradients (this device's).
    axis_name: the mesh axis (or axes) to reduce over.
    op: ``"mean"`` or ``"sum"``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import PartitionSpec as P
    >>> from optirs_jax.multi_device import sync_gradients
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",),
    ...                      axis_types=(jax.sharding.AxisType.Auto,))
    >>> f = jax.shard_map(lambda g: sync_gradients(g, "data"), mesh=mesh,
    ...                   in_specs=P("data"), out_specs=P())
    >>> float(f(jnp.arange(jax.device_count(), dtype=jnp.float32))[0]) == (
    ...     (jax.device_count() - 1) / 2)
    True
  """
  if op not in OPS:
    raise ValueError(f"sync_gradients: op={op!r} is not one of {OPS}")
  names = axis_names("sync_gradients", axis_name)
  check_per_device("sync_gradients", grads, names)
  reduce = jax.lax.pmean if op == "mean" else jax.lax.psum
  return jax.tree.map(lambda g: reduce(g, names), grads)


def sync_gradients_transform(axis_name: str | Sequence[str], *, op: str = "mean"
                             ) -> optax.GradientTransformationExtraArgs:
  """:func:`sync_gradients` as an optax transformation, to put first in a chain.

  >>> import optax, optirs_jax
  >>> from optirs_jax.multi_device import sync_gradients_transform
  >>> tx = optax.chain(sync_gradients_transform("data"), optirs_jax.adamw(1e-3))
  """
  if op not in OPS:
    raise ValueError(f"sync_gradients_transform: op={op!r} is not one of {OPS}")

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return sync_gradients(updates, axis_name, op=op), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)

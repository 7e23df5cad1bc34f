"""What the optimizers' elementwise rules share, in plain jnp; each rule lives beside its spec
(``optirs_jax/transforms/<name>.py``) and is written once.

Every rule maps one leaf's arrays to new arrays and is called by both executors: the
reference maps it over the pytree with the hyper-parameters optax itself would use (Python
floats stay Python floats, so XLA sees optax's exact expressions), and the Pallas kernels
call the same function on each block with the hyper-parameters read from one traced ``f32``
vector.

A rule's signature is ``rule(h, g, *, p, <state fields>, cast_lr, <static options>) ->
(u, *new state fields)``: ``h`` holds the scalars its spec names (``h.b1``), ``p`` is the
leaf's params or ``None`` where they are not read, and ``cast_lr`` says whether the
learning rate came from a schedule (optax then casts it to the update's dtype). The order
of operations follows optax 0.2.8 exactly (``scale_by_adam``, ``add_decayed_weights``,
``scale_by_learning_rate``, ``trace``, ``scale_by_rms``, ``scale_by_stddev``,
``scale_by_rss``, ``scale_by_lion``), which is what makes float32 results bit-identical on
the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def abs_sq(x: jax.Array) -> jax.Array:
  """``|x|^2`` for real or complex ``x`` (optax's ``numerics.abs_sq``)."""
  return (x.conj() * x).real


def sq(g: jax.Array) -> jax.Array:
  """``g**2`` for real ``g``, ``|g|^2`` for complex (optax's
  ``tree.update_moment_per_elem_norm`` with order 2)."""
  return g**2 if jnp.isrealobj(g) else abs_sq(g)


def ema(decay, one_minus_decay, x, t):
  """``(1 - decay) * x + decay * t`` (optax's ``tree.update_moment``), with ``1 - decay``
  given as computed outside."""
  return one_minus_decay * x + decay * t


def debias(t, bias_correction):
  """``t / bias_correction`` in the moment's own precision (optax's
  ``tree.bias_correction``)."""
  return t / bias_correction.astype(t.dtype)


def scale_lr(h, u: jax.Array, cast_lr: bool) -> jax.Array:
  """``-lr * u``: optax.scale (constant) or optax.scale_by_schedule (cast to u's dtype)."""
  neg_lr = jnp.asarray(h.neg_lr, dtype=u.dtype) if cast_lr else h.neg_lr
  return neg_lr * u


def cast(x: jax.Array, dtype) -> jax.Array:
  """``x`` in ``dtype`` (``None``: as it is)."""
  return x if dtype is None else x.astype(dtype)


def where_scalar(cond, a: jax.Array, b: jax.Array) -> jax.Array:
  """``where(cond, a, b)`` for a scalar ``cond``, broadcast as ``a`` is: its shape (Mosaic
  GPU selects only between arrays of one shape) and its sharding (on an Explicit mesh a
  replicated condition would not match a sharded ``a``)."""
  return jnp.where(jnp.full_like(a, cond, dtype=bool), a, b)

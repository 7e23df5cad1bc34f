"""The global norm of a gradient tree (``optax.clip_by_global_norm``'s), as one read-only pass.

On the CPU (the jnp reference) it is ``optax.tree.norm`` itself, so a fused
``clip_by_global_norm`` gives optax's numbers bit for bit. On a GPU the optimizers' grouped
kernel reads every leaf once, in a few launches, each block summing its squares; one more
launch adds them up per leaf (as for LAMB's norms), and the leaves' sums make the norm. The
sums run in another order than XLA's, so the norm may differ from optax's in its last bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from optirs_jax.dtypes import widened
from optirs_jax.mixed_precision._finite import FINITE_OPTIONS
from optirs_jax.pallas.dispatch import execute, lowering_targets
from optirs_jax.pallas.op import ElementwiseOp, Hyper
from optirs_jax.pallas.options import ExecutorOptions


def _no_outputs(h, g, *, compute_dtype=None):
  del h, g, compute_dtype
  return ()


def _unscaled(h, x):
  """What the norm is of: the gradient in float32 or wider, times the loss scale's inverse
  (as :meth:`~optirs_jax.mixed_precision.DynamicLossScale.unscale` computes it)."""
  y = x.astype(widened(x.dtype))
  return y * jnp.asarray(h.inv_scale, jnp.float32).astype(y.dtype)


NORM = ElementwiseOp(_no_outputs, ("inv_scale",), (0.0,), norm_inputs=(0,), name="global_norm",
                     source=_unscaled)


def global_norm(leaves: Sequence[jax.Array], inv_scale=None, *, backend: str = "auto",
                executor_options: ExecutorOptions = FINITE_OPTIONS) -> jax.Array:
  """``optax.tree.norm`` of ``leaves`` (times ``inv_scale``, in float32 or wider, where it
  is given: the unscaled gradients of a loss-scaled step).

  >>> import jax.numpy as jnp
  >>> float(global_norm([jnp.full(4, 3.0), jnp.full(9, 4.0 / 3)]))
  7.211102485656738
  """
  leaves = list(leaves)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  h = Hyper(inv_scale=1.0 if inv_scale is None else jnp.asarray(inv_scale, jnp.float32))
  if backend == "jnp" or not lowering_targets([(x,) for x in leaves[:1]]):
    if inv_scale is None:
      return optax.tree.norm(leaves)
    return optax.tree.norm([_unscaled(h, x) for x in leaves])
  leaves = [x for x in leaves if x.size]  # an empty leaf adds nothing
  if not leaves:
    return jnp.zeros((), jnp.float32)
  _, norms = execute(NORM, h, [(x,) for x in leaves], backend=backend, fused_apply=True,
                     options=executor_options)
  return jnp.sqrt(sum(jnp.square(n[0].astype(jnp.float32)) for n in norms))

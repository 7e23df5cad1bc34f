"""The finiteness check of a loss-scaled fused step, as one read-only pass over the gradients.

:func:`~optirs_jax.mixed_precision.all_finite` reduces each leaf on its own: on a GPU that is
one small XLA reduction per gradient (about 210 launches for GPT-2's 148 leaves, a third of
the whole mixed-precision step). :func:`unscaled_all_finite` is the same answer through the
optimizers' executors: on the GPU the gradients are read once by the grouped kernel (a few
launches for the whole tree), each block summing ``(g * inv_scale * 0)^2`` -- 0 when every
element is finite, NaN otherwise -- and one launch adds those sums up per leaf; on the CPU
it is the jnp reference, one fusion per leaf; sharded leaves are checked shard by shard.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from optirs_jax.dtypes import widened
from optirs_jax.pallas.dispatch import execute
from optirs_jax.pallas.op import ElementwiseOp
from optirs_jax.pallas.options import ExecutorOptions, Tiling


def _no_outputs(h, g, *, compute_dtype=None):
  del h, g, compute_dtype
  return ()


def _zero_if_finite(h, x):
  """0 where the unscaled gradient (in float32 or wider, as the unscaling computes it) is
  finite, NaN where it is not: its sum of squares is 0 or NaN."""
  y = x.astype(widened(x.dtype))
  return y * jnp.asarray(h.inv_scale, y.dtype) * 0


FINITE = ElementwiseOp(_no_outputs, ("inv_scale",), (0.0,), norm_inputs=(0,),
                       name="all_finite", source=_zero_if_finite)

# The check only reads: blocks of 8K elements (16 KB of bfloat16) per grouped program. On an
# H200 over GPT-2's bfloat16 gradients (benchmarks/finite_tiling.py, 4 warps): 0.111 ms with
# the optimizers' 1K-element blocks, 0.078 with 2K, 0.068 with 4K, 0.066 with 8K (88.5% of
# the copy bandwidth).
FINITE_OPTIONS = ExecutorOptions(grouped_tiling=Tiling(block_rows=64, num_warps=4, flat=True))


def unscaled_all_finite(leaves: Sequence[jax.Array], inv_scale=None, *,
                        backend: str = "auto",
                        executor_options: ExecutorOptions = FINITE_OPTIONS) -> jax.Array:
  """Whether every element of ``leaves * inv_scale`` is finite (the product in float32 or
  wider: what :meth:`DynamicLossScale.unscale` gives), as a boolean scalar; True for no
  inexact leaves. ``inv_scale=None`` checks the leaves themselves; ``executor_options``
  sets the kernels' geometry (by default ``FINITE_OPTIONS``).

  >>> import jax.numpy as jnp
  >>> bool(unscaled_all_finite([jnp.ones(3), jnp.array([1.0, jnp.inf])]))
  False
  >>> bool(unscaled_all_finite([jnp.full(3, 6e4, jnp.float16)], jnp.float32(2.0)))
  True
  """
  xs = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact) and x.size]
  if not xs:
    return jnp.array(True)
  h = {"inv_scale": 1.0 if inv_scale is None else jnp.asarray(inv_scale, jnp.float32)}
  _, norms = execute(FINITE, h, [(x,) for x in xs], backend=backend, fused_apply=True,
                     options=executor_options)
  return jnp.all(jnp.stack([jnp.isfinite(n[0]) for n in norms]))

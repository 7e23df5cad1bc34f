"""The executors: the jnp reference and the Pallas kernels (grouped, packed, in place)."""

from optirs_jax.pallas import dialect_lookup
from optirs_jax.pallas.dispatch import KERNEL_DTYPES, execute
from optirs_jax.pallas.op import NHP, ElementwiseOp, Hyper
from optirs_jax.pallas.options import ExecutorOptions, Tiling

dialect_lookup.register()

__all__ = ["KERNEL_DTYPES", "NHP", "ElementwiseOp", "ExecutorOptions", "Hyper", "Tiling",
           "execute"]

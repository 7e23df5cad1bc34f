"""Executors: the Pallas kernel launcher and the per-platform dispatch."""

from optirs_jax.pallas.executor import KERNEL_DTYPES, execute
from optirs_jax.pallas.kernel import NHP, TILINGS, Tiling, elementwise_call

__all__ = ["KERNEL_DTYPES", "NHP", "TILINGS", "Tiling", "elementwise_call", "execute"]

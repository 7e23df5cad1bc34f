"""Orthogonalized updates: Muon, and the batched Newton–Schulz iteration it runs.

- :func:`muon`: :func:`optax.contrib.muon`'s numbers (matrices by Muon, the rest by
  :func:`optirs_jax.adamw`), the matrices of one shape orthogonalized as one batched chain,
  optionally in bfloat16 (``ns_dtype``).
- :func:`scale_by_muon`: Muon's direction alone, as optax's ``scale_by_muon``.
- :func:`orthogonalize`, :func:`orthogonalize_stack`, :func:`coefficients`: the iteration;
  :func:`flops`: its matrix products' operations; :func:`gram_splits`: how its Gram products
  are split to fill a GPU.
"""

from optirs_jax.orthogonal._muon import MuonState, muon, scale_by_muon
from optirs_jax.orthogonal._newton_schulz import (
  PRECONDITIONINGS,
  PRESETS,
  MuonDimensionNumbers,
  coefficients,
  flops,
  orthogonalize,
  orthogonalize_stack,
)
from optirs_jax.orthogonal._tiling import gram_splits

__all__ = [
    "PRECONDITIONINGS", "PRESETS", "MuonDimensionNumbers", "MuonState", "coefficients", "flops",
    "gram_splits", "muon", "orthogonalize", "orthogonalize_stack", "scale_by_muon",
]

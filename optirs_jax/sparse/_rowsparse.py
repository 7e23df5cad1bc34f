"""Row-sparse gradients: which rows of a table a step touched, and their values."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse as jsparse


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSparse:
  """A gradient that is zero outside some rows of its leaf.

  ``indices`` (integer ``[n]``) names the rows, ``values`` (``[n, *row_shape]``) holds them;
  an index may repeat (its values are summed). ``num_rows`` is the leaf's first dimension.
  ``n`` is static: a fixed number of looked-up rows per step compiles once.

  Example:
    >>> import jax.numpy as jnp
    >>> from optirs_jax.sparse import RowSparse
    >>> g = RowSparse(jnp.array([2, 0, 2]), jnp.ones((3, 4)), num_rows=5)
    >>> g.to_dense()[:, 0]
    Array([1., 0., 2., 0., 0.], dtype=float32)
  """

  indices: jax.Array
  values: jax.Array
  num_rows: int = dataclasses.field(metadata=dict(static=True))

  @property
  def shape(self) -> tuple[int, ...]:
    return (self.num_rows, *self.values.shape[1:])

  @property
  def dtype(self):
    return self.values.dtype

  def to_dense(self) -> jax.Array:
    """The dense gradient (duplicates summed; out-of-range rows dropped)."""
    idx = out_of_range_to_sentinel(self.indices, self.num_rows)
    return jnp.zeros(self.shape, self.dtype).at[idx].add(self.values, mode="drop")


def out_of_range_to_sentinel(indices, num_rows):
  # Negative indices would wrap around in jnp's indexing: send them past the end instead,
  # where scatters with mode="drop" ignore them.
  return jnp.where((indices < 0) | (indices >= num_rows), num_rows, indices)


def coalesce(g: RowSparse) -> tuple[jax.Array, jax.Array]:
  """``(rows, values)`` with each row once (duplicates summed), sorted, padded to ``n``
  entries by the out-of-range row ``num_rows`` (which gathers zeros and scatters nowhere)."""
  n = g.indices.shape[0]
  idx = out_of_range_to_sentinel(g.indices.astype(jnp.int32), g.num_rows)
  # One sort of (row, position) pairs, where jnp.unique(return_inverse=True) sorted twice.
  keys, perm = jax.lax.sort((idx, jnp.arange(n, dtype=jnp.int32)), num_keys=1,
                            is_stable=True)
  first = jnp.concatenate([jnp.ones((1,), bool), keys[1:] != keys[:-1]])
  segment = jnp.cumsum(first.astype(jnp.int32)) - 1  # each sorted entry's unique row
  rows = jnp.full((n,), g.num_rows, jnp.int32).at[segment].set(keys)
  values = jax.ops.segment_sum(g.values[perm], segment, num_segments=n,
                               indices_are_sorted=True)
  return rows, values


SPARSE_KINDS = (RowSparse, jsparse.BCOO, jsparse.BCSR)


def is_sparse(x) -> bool:
  return isinstance(x, SPARSE_KINDS)


def _concrete(x) -> np.ndarray | None:
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def as_row_sparse(fn: str, path: str, g, param) -> tuple[RowSparse, bool]:
  """``(g as RowSparse, whether its rows are known unique and in range)``, checked against
  ``param``: a clear error naming the leaf for a float index array, a row shape that is not
  the param's, or (when the indices are concrete) an index out of range."""
  shape = tuple(param.shape)
  if not shape:
    raise ValueError(f"{fn}: leaf {path} is a scalar; row-sparse optimizers need leaves with "
                     "rows (at least one dimension)")
  padded = False
  if isinstance(g, jsparse.BCOO):
    if g.n_batch != 0 or g.n_sparse != 1:
      raise ValueError(f"{fn}: leaf {path} is a BCOO with n_batch={g.n_batch}, "
                       f"n_sparse={g.n_sparse}; give it row indices (n_batch=0, n_sparse=1, "
                       f"n_dense={len(shape) - 1}), e.g. BCOO.fromdense(x, n_dense="
                       f"{len(shape) - 1}) or bcoo_update_layout")
    # BCOO pads with the index num_rows (and zero data): allowed, and dropped.
    g, unique, padded = RowSparse(g.indices[:, 0], g.data, g.shape[0]), g.unique_indices, True
  elif isinstance(g, jsparse.BCSR):
    g, unique = _from_bcsr(fn, path, g), True
  elif isinstance(g, RowSparse):
    unique = False
  else:
    if not hasattr(g, "shape") or tuple(g.shape) != shape:
      raise ValueError(f"{fn}: leaf {path}: the dense gradient has shape "
                       f"{getattr(g, 'shape', None)} but the param has shape {shape}")
    return RowSparse(jnp.arange(shape[0], dtype=jnp.int32), g, shape[0]), True
  if not jnp.issubdtype(g.indices.dtype, jnp.integer):
    raise TypeError(f"{fn}: leaf {path}: the row indices have dtype {g.indices.dtype}; they "
                    "must be integers")
  if g.indices.ndim != 1 or g.values.shape[:1] != g.indices.shape:
    raise ValueError(f"{fn}: leaf {path}: indices of shape {g.indices.shape} and values of "
                     f"shape {g.values.shape} do not pair up (want [n] and [n, *row_shape])")
  if (g.num_rows, *g.values.shape[1:]) != shape:
    raise ValueError(f"{fn}: leaf {path}: the gradient's rows have shape "
                     f"{tuple(g.values.shape[1:])} of {g.num_rows} rows, but the param has "
                     f"shape {shape}")
  if not jnp.issubdtype(g.values.dtype, jnp.floating):
    raise TypeError(f"{fn}: leaf {path}: the gradient's values have dtype {g.values.dtype}; "
                    "they must be floating")
  idx = _concrete(g.indices)
  top = g.num_rows + (1 if padded else 0)
  if idx is not None and idx.size and (idx.min() < 0 or idx.max() >= top):
    bad = idx[(idx < 0) | (idx >= top)][0]
    raise ValueError(f"{fn}: leaf {path}: row index {int(bad)} is out of range; valid rows "
                     f"are 0..{g.num_rows - 1}")
  return g, unique


def _from_bcsr(fn: str, path: str, g: jsparse.BCSR) -> RowSparse:
  if g.n_batch != 0 or g.n_dense != 0 or len(g.shape) != 2:
    raise ValueError(f"{fn}: leaf {path}: only 2-D BCSR gradients (no batch or dense "
                     f"dimensions) are accepted; got shape {g.shape}")
  num_rows, cols = g.shape
  nse = g.data.shape[0]
  if nse % cols:
    raise ValueError(f"{fn}: leaf {path}: the BCSR holds {nse} entries, not a whole number "
                     f"of rows of {cols}; partially filled rows are not row-sparse")
  counts = _concrete(jnp.diff(g.indptr))
  if counts is not None and np.any((counts != 0) & (counts != cols)):
    row = int(np.nonzero((counts != 0) & (counts != cols))[0][0])
    raise ValueError(f"{fn}: leaf {path}: BCSR row {row} holds {int(counts[row])} of {cols} "
                     "entries; partially filled rows are not row-sparse")
  entry = jnp.arange(nse)
  row_of = jnp.searchsorted(g.indptr, entry, side="right") - 1
  n = nse // cols
  rows = row_of[::cols].astype(jnp.int32)
  values = jnp.zeros((n, cols), g.data.dtype).at[entry // cols, g.indices].set(g.data)
  return RowSparse(rows, values, num_rows)

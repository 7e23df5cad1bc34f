"""Row-sparse optimizers for embeddings: pay for the rows a step touched.

- :class:`RowSparse`: a gradient that holds some rows of its leaf (indices and values).
- :func:`sparse_adam` (lazy Adam, ``torch.optim.SparseAdam``'s semantics, with optional
  dormancy catch-up) and :func:`sparse_sgd` (lazy SGD with momentum): optax
  transformations; :func:`optirs_jax.apply` writes only the touched rows.
- :func:`value_and_row_grad`: the gradient of an embedding lookup as a :class:`RowSparse`,
  without the table-sized dense gradient.
"""

from optirs_jax.sparse._grad import value_and_row_grad
from optirs_jax.sparse._optimizers import SparseAdamState, SparseSgdState, sparse_adam, sparse_sgd
from optirs_jax.sparse._rowsparse import RowSparse

__all__ = ["RowSparse", "SparseAdamState", "SparseSgdState", "sparse_adam", "sparse_sgd",
           "value_and_row_grad"]

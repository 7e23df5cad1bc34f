"""Row-sparse gradients of an embedding lookup, without the dense gradient."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optirs_jax.sparse._rowsparse import RowSparse, out_of_range_to_sentinel


def value_and_row_grad(loss_fn: Callable, table_argnum: int = 0, ids_argnum: int = 1, *,
                       argnums: Sequence[int] = (), has_aux: bool = False) -> Callable:
  r"""Like ``jax.value_and_grad``, for a loss that reads rows ``ids`` of a table: the
  table's gradient comes back as a :class:`RowSparse` of those rows, and no array of the
  table's size is formed.

  The returned function takes the same arguments as ``loss_fn`` (the table at
  ``table_argnum``, the integer ids at ``ids_argnum``), looks the rows up once
  (``table[ids]``, shape ``ids.shape + row_shape``) and calls ``loss_fn`` with those rows *in
  place of the table*: write ``loss_fn`` on the looked-up rows. It returns ``(value,
  row_grad)``, or ``(value, (row_grad, *grads))`` with the dense gradients of the arguments
  in ``argnums`` (a model's other params); ``value`` is ``(loss, aux)`` with ``has_aux``.
  Repeated ids give repeated rows in the :class:`RowSparse` (the optimizers sum them). An id
  outside ``0..num_rows - 1`` is a ValueError where the ids are concrete; under ``jit``
  its row reads as zeros and its gradient is dropped by the optimizers (one rule for the
  forward pass and the update).

  .. math:: \frac{\partial L}{\partial T_{r}} = \sum_{i:\ \mathrm{ids}_i = r}
     \frac{\partial L}{\partial \mathrm{rows}_i}

  Example:
    >>> import jax.numpy as jnp
    >>> from optirs_jax.sparse import value_and_row_grad
    >>> table = jnp.ones((10_000, 4))
    >>> loss = lambda rows, ids, w: jnp.sum(rows @ w)   # rows: [batch, 4]
    >>> value, (g_table, g_w) = value_and_row_grad(loss, 0, 1, argnums=(2,))(
    ...     table, jnp.array([5, 9, 5]), jnp.ones(4))
    >>> g_table.indices, g_table.values.shape, g_table.num_rows, float(value)
    (Array([5, 9, 5], dtype=int32), (3, 4), 10000, 12.0)
  """
  for name, v in (("table_argnum", table_argnum), ("ids_argnum", ids_argnum)):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
      raise ValueError(f"value_and_row_grad: {name}={v!r} must be a non-negative int")
  if table_argnum == ids_argnum:
    raise ValueError("value_and_row_grad: table_argnum and ids_argnum must differ")
  argnums = tuple(argnums)
  if table_argnum in argnums or ids_argnum in argnums:
    raise ValueError(f"value_and_row_grad: argnums={argnums} may not name the table or the ids")

  def wrapped(*args):
    if max((table_argnum, ids_argnum, *argnums)) >= len(args):
      raise ValueError(f"value_and_row_grad: got {len(args)} arguments; table_argnum="
                       f"{table_argnum}, ids_argnum={ids_argnum}, argnums={argnums}")
    table, ids = args[table_argnum], jnp.asarray(args[ids_argnum])
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"value_and_row_grad: the ids have dtype {ids.dtype}; they must be "
                      "integers")
    _check_ids(ids, table.shape[0])
    # Out-of-range ids (traced ones, under jit) read rows of zeros, and the optimizers drop
    # their gradients: the forward pass and the update follow one rule. (jnp.take would read
    # the last row for -1 while the update dropped it.)
    rows = jnp.take(table, out_of_range_to_sentinel(ids, table.shape[0]), axis=0,
                    mode="fill", fill_value=0)

    def on_rows(rows, *others):
      a = list(args)
      a[table_argnum] = rows
      for i, o in zip(argnums, others):
        a[i] = o
      return loss_fn(*a)

    value, grads = jax.value_and_grad(on_rows, argnums=tuple(range(1 + len(argnums))),
                                      has_aux=has_aux)(rows, *(args[i] for i in argnums))
    row_grad = RowSparse(ids.reshape(-1).astype(jnp.int32),
                         grads[0].reshape((-1, *table.shape[1:])), table.shape[0])
    return value, ((row_grad, *grads[1:]) if argnums else row_grad)

  return wrapped


def _check_ids(ids, num_rows: int) -> None:
  """A ValueError naming the first out-of-range id, where the ids are concrete."""
  try:
    values = np.asarray(ids)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return  # traced: rows of zeros in, gradients dropped (see value_and_row_grad)
  bad = np.flatnonzero((values < 0) | (values >= num_rows))
  if bad.size:
    raise ValueError(f"value_and_row_grad: id {int(values.reshape(-1)[bad[0]])} (at flat "
                     f"position {int(bad[0])}, one of {bad.size} out of range) is not a row "
                     f"of the table: valid ids are 0..{num_rows - 1}")

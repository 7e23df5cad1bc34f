r"""The Gram form of the Newton–Schulz iteration, for 16-bit stacks of long matrices.

Each quintic step multiplies the iterate on the left by a polynomial of its Gram matrix,
:math:`X_{k+1} = p_k(A_k) X_k` with :math:`p_k(A) = c_0 I + c_1 A + c_2 A^2`, so
:math:`X_k = Q_k X_0` and the whole chain can run on the :math:`m \times m` side:

.. math::
  A_0 = X_0 X_0^\top,\qquad P_k = p_k(A_k),\qquad Q_{k+1} = P_k Q_k,\qquad
  A_{k+1} = P_k A_k P_k,\qquad X_n = Q_n X_0

(:math:`P_k` and :math:`A_k` commute: both are polynomials of :math:`A_0`). A matrix
:math:`m \times n` costs three :math:`m \times m \times n` products in all (below) instead
of two a step, plus four :math:`m^3` products a step: for GPT-2's 768 x 50257 embedding,
0.22 TFLOP of bfloat16 products instead of 0.6.

The small side needs float32's precision: the :math:`Q_k` grow like :math:`c_0^k` on the
small singular values and carry every rounding there into the result (with its products
on TF32 inputs, a GPU's default float32 precision, the chain errs by 0.8-1.5 relative on
decaying spectra; ``benchmarks/gram_ns_accuracy.py``). So :math:`A_0` keeps its float32
sums (exact products of the bfloat16 stack, whose Gram matrix it then is), each
:math:`m \times m` product is three bfloat16 products, :math:`a_h b_h + a_h b_l + a_l b_h`
with :math:`a = a_h + a_l` split into two bfloat16 parts (bf16x3, about 16 bits of
mantissa: one product of thrice the depth on a GPU's tensor cores), and the last product
takes :math:`Q_n` in two parts, :math:`Q_h X_0 + Q_l X_0` (:math:`Q_n` rounded to
bfloat16 alone errs by :math:`2^{-9} c_0^n` where the matrix has small or no singular
values: 0.13 relative on a 64 x 2048 matrix of rank 30). Against optax's chain in
float64 the form errs less than bfloat16's chains step by step
(``benchmarks/gram_ns_accuracy.py``: 64 x 2048 and 256 x 16384): 0.003 against 0.02-0.03
(the factor as a square) and 0.03-0.05 (expanded) on Gaussian matrices, 0.058-0.080
against 0.065-0.090 on spectra decaying as :math:`k^{-1.5}`, 0.004-0.005 against
0.04-0.07 on matrices of rank 30.

Used for 16-bit chains (``ns_dtype=jnp.bfloat16``) of matrices whose long side is at least
:data:`RATIO` times the short one, with the Frobenius or spectral preconditioning; the
other chains keep the step-by-step fast form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from optirs_jax.orthogonal import _ns_steps as ns

#: The long side over the short one from which a 16-bit chain takes the Gram form: three
#: products of the long side in all against two a step, for 17 bf16x3 products of the
#: short side (51 bfloat16 ones of :math:`2m^3`): five steps even in operations from about
#: 7, and small products fill a GPU less than large ones.
RATIO = 16


def applies(x: jax.Array, c: jax.Array, ns_steps, preconditioning: str) -> bool:
  """Whether the fast form of the stack ``x`` takes the Gram form: 16-bit, real, long
  matrices (:data:`RATIO`), Frobenius or spectral preconditioning (``None``: a stack
  divided by its norm already), at least one step."""
  short, long = sorted(x.shape[-2:])
  steps = ns.static_count(c, ns_steps)
  return (x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating)
          and long >= RATIO * short and preconditioning in ("frobenius", "spectral", None)
          and steps != 0)


def bf16x3(a: jax.Array, b: jax.Array) -> jax.Array:
  """``a @ b`` for float32 stacks ``[batch, m, k]`` and ``[batch, k, n]`` to about 16
  mantissa bits: each split in two bfloat16 parts, ``a = a_h + a_l``, and
  ``a_h b_h + a_h b_l + a_l b_h`` summed in float32 by one bfloat16 product of depth
  ``3k``.

  >>> import jax.numpy as jnp
  >>> a = jnp.full((1, 2, 2), 1 / 3)  # a @ a: 2/9 everywhere
  >>> one = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)  # one bfloat16 product
  >>> x3, x1 = bf16x3(a, a)[0, 0, 0], (one(a) @ one(a))[0, 0, 0]
  >>> print(f"{float(abs(x3 - 2 / 9)):.1e} {float(abs(x1 - 2 / 9)):.1e}")
  2.5e-06 8.7e-04
  """
  def parts(v):
    hi = v.astype(jnp.bfloat16)
    return hi, (v - hi.astype(v.dtype)).astype(jnp.bfloat16)

  (ah, al), (bh, bl) = parts(a), parts(b)
  lhs = jnp.concatenate([ah, ah, al], axis=-1)
  rhs = jnp.concatenate([bh, bl, bh], axis=-2)
  return jax.lax.dot_general(lhs, rhs, (((2,), (1,)), ((0,), (0,))),
                             preferred_element_type=jnp.float32)


def _step(row, a, q, *, last: bool):
  """``(A_{k+1}, Q_{k+1})`` from ``(A_k, Q_k)`` (``q`` None: the identity)."""
  eye = jnp.eye(a.shape[-1], dtype=a.dtype)[None]
  p = row[0] * eye + row[1] * a + row[2] * bf16x3(a, a)
  q = p if q is None else bf16x3(p, q)
  return (None if last else bf16x3(bf16x3(p, a), p)), q


def chain(x, c, ns_steps, side, eps, *, normalize: bool, out_tall: bool = False):
  """The Gram form's chain on the stack ``x`` (16-bit, padded and oriented as ``side``
  says) with coefficients ``c`` (``(3,)`` for ``ns_steps`` steps, or one row a step);
  ``normalize``: divide by the Frobenius norm (``+ eps``) first, read off ``A_0``'s
  trace; ``out_tall``: the result written as the (wide) stack's transpose. Returns the
  orthogonalized stack in ``x``'s dtype."""
  c = c.astype(jnp.float32)
  a = side.gram(x, out=jnp.float32)  # exact products of the 16-bit stack, float32 sums
  s = ns.inverse_norm(a, eps) if normalize else jnp.ones((x.shape[0], 1, 1), jnp.float32)
  a = a * (s * s)
  n = ns.static_count(c, ns_steps)
  row = lambda i: c[i] if c.ndim == 2 else c
  if n is None:  # traced (inject_hyperparams): every step in the loop, Q from the identity
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    body = lambda i, aq: _step(c, *aq, last=False)
    _, q = jax.lax.fori_loop(0, ns_steps, body, (a, eye))
  else:
    q = None
    for i in range(n):
      a, q = _step(row(i), a, q, last=i == n - 1)
  q = q * s  # Q_n X: Q_n in two 16-bit parts (its rounding would take c0^n with it)
  hi = q.astype(x.dtype)
  lo = (q - hi.astype(q.dtype)).astype(x.dtype)
  last = side._replace(out_tall=out_tall)
  return last.apply(hi, x) + last.apply(lo, x)

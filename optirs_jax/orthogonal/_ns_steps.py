r"""The steps of the Newton–Schulz iteration on a stack of matrices, by its orientation.

:class:`Side` says how a stack is multiplied (wide as optax does, tall read as the
transpose of a wide one in place); the steps are optax's quintic step and its first-step
variants (AOL, Schatten-4, and the Frobenius normalization folded into the first step).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_FIRST_STEP_EPS = 1e-8  # the floor of the AOL and Schatten-4 rescalings (optax's)


def real_as(v, x):
  """A real scale ``v`` for ``x``: as it is, or cast to ``x``'s complex dtype (what numpy's
  promotion does; written out so that strict promotion takes it too)."""
  return v.astype(x.dtype) if jnp.iscomplexobj(x) else v


class Side(NamedTuple):
  """How a stack of matrices is multiplied, by its orientation. A wide stack (rows <=
  columns) takes optax's iteration, ``A = X X^H`` and ``X' = c0 X + B X``; a tall one is
  read as the transpose of a wide one, ``Y = X^T``, without moving it: ``A^T = Y^H Y`` and
  ``Y' = c0 Y + Y B^T`` (``B^T`` is ``B`` of ``A^T``: transposing commutes with the
  polynomial), so the products take their operands in place of a transpose each way.
  ``splits`` (tall stacks only): the Gram product as that many products over consecutive
  row blocks, summed in float32 (:func:`gram_splits`). ``out_tall`` (a wide stack, folded
  steps): the product returns the new iterate transposed, ``(B X)^T = X^T B^T``, written
  tall by the product itself (the last step of a tall stack given as its transpose)."""

  tall: bool
  splits: int = 1
  out_tall: bool = False

  def gram(self, x, conj: bool = True, out=None):
    """``X X^H`` (``Y^H Y`` for a tall stack; ``conj=False``: the plain transposes), in
    ``out`` (default: ``x``'s dtype; float32 takes a 16-bit stack's products' sums)."""
    if not self.tall and out is None:  # optax's expression: the exact program is its own
      xt = jnp.swapaxes(x, -1, -2)
      return x @ (xt.conj() if conj else xt)
    if not self.tall:
      return jax.lax.dot_general(x, x.conj() if conj else x, (((2,), (2,)), ((0,), (0,))),
                                 preferred_element_type=out)
    if self.splits == 1:
      return batched_dot(x.conj() if conj else x, x, 1, out)
    b, n, m = x.shape  # row blocks as a batch (a reshape of the row-major stack, no copy)
    parts = x.reshape(b * self.splits, n // self.splits, m)
    acc = jnp.float32 if x.dtype.itemsize < 4 else x.dtype  # bfloat16 sums in float32
    a = batched_dot(parts.conj() if conj else parts, parts, 1, acc)
    return a.reshape(b, self.splits, m, m).sum(1).astype(out or x.dtype)

  def apply(self, b, x):
    if self.tall:
      return batched_dot(x, b, 2)
    if self.out_tall:  # X^T B^T: X's rows contracted with B's columns
      return jax.lax.dot_general(x, b, (((1,), (2,)), ((0,), (0,))))
    return b @ x

  def scale(self, x, s):
    """``x`` with each of its Gram matrix's rows' vectors (rows of a wide stack, columns
    of a tall one) scaled by ``s`` (``[..., k]``)."""
    return x * (s[..., None, :] if self.tall else s[..., :, None])


def batched_dot(a, b, axis: int, out=None):
  """``a`` and ``b`` (``[batch, ., .]``) contracted over ``a``'s ``axis`` and ``b``'s rows
  (an operand's transpose taken in place by the product), in ``out`` (default: theirs)."""
  return jax.lax.dot_general(a, b, (((axis,), (1,)), ((0,), (0,))),
                             preferred_element_type=out or jnp.result_type(a, b))


def update(x, a, c, side, fold: bool, scale=None):
  """The step's new iterate from ``x`` and its (rescaled) Gram matrix ``a``:
  ``c0 X + (c1 A + c2 A A) X`` in optax's order (``c2 * A`` formed before its product with
  ``A``), or with ``fold`` the one product ``(c0 I + c1 A + c2 A A) X``, its factor
  materialized first (a product fed by an elementwise prologue falls off cuBLAS) and
  times ``scale`` (``[batch, 1, 1]``) where given."""
  b = c[1] * a + c[2] * a @ a
  if not fold:
    return c[0] * x + side.apply(b, x)
  b = b + c[0] * jnp.eye(a.shape[-1], dtype=a.dtype)[None]
  if scale is not None:
    b = b * scale
  return side.apply(jax.lax.optimization_barrier(b), x)


def step(x, c, side, fold):
  """One quintic step on a stack: ``c0 X + (c1 A + c2 A A) X`` with ``A = X X^H``."""
  return update(x, side.gram(x), c, side, fold)


def aol_step(x, c, side, fold):
  """The first step with AOL rescaling (Boissin et al., 2025): each row scaled by the
  inverse square root of its Gram row's absolute sum."""
  a = side.gram(x)
  s = jax.lax.rsqrt(jnp.clip(jnp.abs(a).sum(axis=-2 if side.tall else -1),
                             min=_FIRST_STEP_EPS))
  s = real_as(s, x)
  return update(side.scale(x, s), a * s[..., :, None] * s[..., None, :], c, side, fold)


def inverse_norm(a, eps):
  """``1 / (|X|_F + eps)`` (``[batch, 1, 1]``, at least float32) from ``a = X X^H``: the
  norm squared is the trace of the Gram matrix."""
  d = jnp.real(jnp.diagonal(a, axis1=-2, axis2=-1))
  wide = d.dtype if jnp.finfo(d.dtype).bits >= 32 else jnp.float32  # (strict promotion)
  return (1 / (jnp.sqrt(d.astype(wide).sum(-1)) + eps))[:, None, None]


def frobenius_step(x, c, side, fold, eps):
  """The first step of the unnormalized ``x``, divided by its Frobenius norm inside the
  step: the norm squared is the trace of the Gram matrix, so ``X / s`` (``s = |X|_F +
  eps``) costs no pass over the stack: ``A / s^2``, and ``1 / s`` in the factor."""
  a = side.gram(x)
  s = inverse_norm(a, eps)
  real = jnp.real(a).dtype
  return update(x, a * real_as((s * s).astype(real), a), c, side, fold,
                 real_as(s.astype(real), a))


def schatten_step(x, c, side, fold):
  """The first step rescaled by the Schatten-4 norm (Grishina et al., 2025)."""
  a = side.gram(x, conj=False)  # optax's: no conjugate
  norm = jnp.linalg.norm(a, ord="fro", axis=(-2, -1), keepdims=True)
  s = real_as(jax.lax.rsqrt(jnp.clip(norm, min=_FIRST_STEP_EPS)), x)
  return update(x * s, a * s**2, c, side, fold)


def square_terms(c):
  r"""The quintic step's factor as a square: :math:`c_0 I + c_1 A + c_2 A^2 = \sigma|c_2|
  (A + aI)^2 + bI` with :math:`a = c_1/(2c_2)`, :math:`b = c_0 - c_1^2/(4c_2)`,
  :math:`\sigma = \mathrm{sign}(c_2)`. Iterating :math:`Y = qX`, :math:`q = |c_2|^{1/4}`,
  a step is :math:`G = YY^T + d_1 I`, :math:`Y' = \sigma (G^2 + d_2 I) Y` with
  :math:`d_1 = a\sqrt{|c_2|}`, :math:`d_2 = \sigma b`. Returns ``(q, sigma, d1, d2)``."""
  c0, c1, c2 = (c[i].astype(jnp.float32) for i in range(3))
  sigma, root = jnp.sign(c2), jnp.sqrt(jnp.abs(c2))
  return jnp.sqrt(root), sigma, c1 / (2 * c2) * root, sigma * (c0 - c1 * c1 / (4 * c2))


def static_count(c, ns_steps) -> int | None:
  """The steps a chain of coefficients ``c`` runs: its rows (``(n, 3)``), or ``ns_steps``
  as an int (``(3,)``); None where that count is traced (``inject_hyperparams``)."""
  if c.ndim == 2:
    return c.shape[0]
  try:
    return int(ns_steps)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
    return None


def add_diagonal(a, v):
  """``a + v I`` on every matrix of ``a``, as an update of the diagonal alone (in place
  where XLA reuses the operand's buffer)."""
  i = jnp.arange(a.shape[-1])
  return a.at[..., i, i].add(jnp.asarray(v).astype(a.dtype))


def square_step(y, c, side, *, g=None, pre=None, post=None):
  """One step of the square form (:func:`square_terms`) on a stored ``Y`` (the sign
  ``sigma`` of each step left out, the caller's to carry): ``G = Y Y^T + d1 I``,
  ``Y' = (G^2 + d2 I) Y``. ``pre`` (``[batch, 1, 1]``): ``G = pre * Y Y^T + d1 I``, one
  elementwise pass (the first step's scaling); ``post``: the factor times ``post``, one
  elementwise pass (the first and last steps); otherwise each ``+ d I`` updates the
  diagonal alone. ``g``: ``Y Y^T``, where the caller has it."""
  _, _, d1, d2 = square_terms(c)
  g = side.gram(y) if g is None else g
  eye = lambda d, a: d.astype(a.dtype) * jnp.eye(a.shape[-1], dtype=a.dtype)[None]
  if pre is None:
    g = add_diagonal(g, d1)
  else:  # materialized: an elementwise prologue would take the product off cuBLAS
    g = jax.lax.optimization_barrier(g * pre.astype(g.dtype) + eye(d1, g))
  f = g @ g
  if post is None:
    f = add_diagonal(f, d2)
  else:
    f = jax.lax.optimization_barrier((f + eye(d2, f)) * post.astype(f.dtype))
  return side.apply(f, y)

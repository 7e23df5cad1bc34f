r"""Newton–Schulz orthogonalization of many matrices at once, batched by shape.

Muon replaces a weight's momentum :math:`M` by an approximation of its orthogonal polar
factor :math:`U V^\top` (:math:`M = U \Sigma V^\top`), computed by a few steps of the
quintic iteration

.. math::
  X_0 = M / (\lVert M\rVert_F + \epsilon),\qquad
  A_k = X_k X_k^\top,\qquad
  X_{k+1} = c_0 X_k + (c_1 A_k + c_2 A_k A_k) X_k

on the wide orientation of each matrix (rows <= columns: the Gram matrix :math:`A` is the
smaller one). optax runs one such chain per leaf; here every matrix of one shape and dtype
(a transformer's layers) is stacked and the chain runs once on the stack, as batched
matrix products: GPT-2 small's 48 weight matrices and two embeddings are six chains.
A leaf alone in its chain, at the momentum's precision, with a long side of at most 4096,
takes optax's program op for op (its numbers bit for bit). A stack of several, a longer
matrix (a vocabulary's embedding) or any chain with a narrower ``ns_dtype`` takes the fast
form, equal to rounding: a tall stack is not transposed (its products take it transposed
in place; Muon's kernel writes a float32 one wide, since a TF32 Gram product contracting
the strided axis runs at half the speed), each step is one product,
:math:`X_{k+1} = (c_0 I + c_1 A_k + c_2 A_k^2) X_k`, a long side above 4096 is padded once
for the products, and a Gram product with too few output tiles for the GPU's cores is
split along its long contraction (:func:`gram_splits`). In 16-bit chains, a matrix at
least 16 times as long as wide takes the Gram form (``_gram_form.py``): the iteration on
its Gram matrix, one product with it at the end.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from optirs_jax.orthogonal import _gram_form as gram_form
from optirs_jax.orthogonal import _ns_steps as ns
from optirs_jax.orthogonal import _tiling as tiling
from optirs_jax.orthogonal._spread import mesh_of, spread, spread_axes

#: Newton–Schulz coefficients by name (optax's presets): Keller Jordan's quintic, and
#: Dion's five-step schedule (one row per step).
PRESETS = {
    "standard": (3.4445, -4.7750, 2.0315),
    "dion": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
             (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
}
PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")


class MuonDimensionNumbers(NamedTuple):
  """Which axes of a weight are the matrix's rows (``reduction_axis``) and columns
  (``output_axis``); every other axis is a batch of independent matrices. optax's
  :class:`optax.contrib.MuonDimensionNumbers` is accepted wherever this one is."""

  reduction_axis: Sequence[int] | int = 0
  output_axis: Sequence[int] | int = 1


def is_dimension_numbers(x) -> bool:
  """Whether ``x`` is a :class:`MuonDimensionNumbers` (ours or optax's)."""
  return isinstance(x, tuple) and hasattr(x, "_fields") and x._fields == (
      "reduction_axis", "output_axis")


def _axes(x_ndim: int, dims) -> tuple[tuple[int, ...], tuple[int, ...]]:
  red = (dims.reduction_axis,) if isinstance(dims.reduction_axis, int) else dims.reduction_axis
  out = (dims.output_axis,) if isinstance(dims.output_axis, int) else dims.output_axis
  return tuple(a % x_ndim for a in red), tuple(a % x_ndim for a in out)


def fans(shape: Sequence[int], dims) -> tuple[int, int]:
  """``(fan_in, fan_out)``: the products of the reduction and of the output axes."""
  red, out = _axes(len(shape), dims)
  return math.prod(shape[a] for a in red), math.prod(shape[a] for a in out)


class MatrixView(NamedTuple):
  """How one leaf is read as a stack of matrices ``[batch, rows, cols]``."""

  transpose: tuple[int, ...]
  shape: tuple[int, int, int]
  unflat: tuple[int, ...]

  @classmethod
  def of(cls, shape: Sequence[int], dims) -> MatrixView:
    ndim = len(shape)
    if ndim < 2:
      raise ValueError(f"Muon's parameters must have rank >= 2, got shape {tuple(shape)}")
    red, out = _axes(ndim, dims)
    if set(red) & set(out):
      raise ValueError(f"reduction axes {red} and output axes {out} must be disjoint (shape "
                       f"{tuple(shape)}, {dims})")
    batch = tuple(sorted(set(range(ndim)) - set(red) - set(out)))
    size = lambda axes: math.prod(shape[a] for a in axes)
    return cls(batch + red + out, (size(batch), size(red), size(out)),
               tuple(shape[a] for a in batch + red + out))

  def to_matrices(self, x: jax.Array) -> jax.Array:
    return x.transpose(self.transpose).reshape(self.shape)

  def from_matrices(self, x: jax.Array) -> jax.Array:
    inverse = tuple(sorted(range(len(self.transpose)), key=lambda i: self.transpose[i]))
    return x.reshape(self.unflat).transpose(inverse)


def coefficients(ns_coeffs, ns_steps: int) -> jax.Array:
  """The coefficient array a Muon state holds: ``(3,)``, or ``(steps, 3)`` (a schedule,
  at most ``ns_steps`` rows)."""
  c = jnp.asarray(PRESETS[ns_coeffs] if isinstance(ns_coeffs, str) else ns_coeffs)
  if c.ndim > 2 or c.ndim == 0 or c.shape[-1] != 3:
    raise ValueError(f"ns_coeffs must have shape (3,) or (n, 3), got {c.shape}")
  if c.ndim == 2:
    if c.shape[0] > ns_steps:
      raise ValueError(f"ns_coeffs has {c.shape[0]} rows, more than ns_steps={ns_steps}: "
                       "not enough steps to use them")
    c = c[-ns_steps:]
  return c


def orthogonalize_stack(x: jax.Array, coeffs: jax.Array, ns_steps: int, *,
                        preconditioning: str = "frobenius", eps=1e-8, ns_dtype=None,
                        exact: bool = False, transposed: bool = False,
                        square: bool = False) -> jax.Array:
  """Newton–Schulz on every matrix of ``x`` (``[batch, rows, cols]``), one chain.

  A tall stack (rows > columns) is iterated as the transpose of a wide one, as optax
  does. With ``exact``, by optax's program op for op (the stack transposed there and
  back, ``c0 X + B X``): on one matrix its numbers bit for bit. Otherwise the fast form,
  the same numbers to rounding: the products take a tall stack transposed in place, each
  step is one product ``(c0 I + c1 A + c2 A^2) X``, a long side above 4096 is padded
  with zeros to a multiple of 128 once (its products would pad it in every step), and a
  Gram product of few output tiles is split along its long side (:func:`gram_splits`; a wide
  stack so split is transposed once, there and back). A 16-bit chain of matrices at least
  16 times as long as wide (a vocabulary's embedding), Frobenius or spectral, runs on the
  small side (``orthogonal/_gram_form.py``: three products of the long side in
  all, the small side's to about float32's precision).

  Args:
    x: the stacked matrices.
    coeffs: ``(3,)`` coefficients for ``ns_steps`` steps, or ``(n, 3)``: one row per step.
    ns_steps: steps of a ``(3,)`` schedule.
    preconditioning: ``"frobenius"`` or ``"spectral"`` (divide by that norm first; the
      fast form divides by the Frobenius norm inside its first step),
      ``"aol"`` or ``"schatten"`` (rescale in the first step).
    eps: added to the Frobenius or spectral norm.
    ns_dtype: the products' dtype (``None``: ``x``'s); the result comes back in ``x``'s.
    exact: optax's program (above).
    transposed: ``x`` holds tall matrices' transposes, ``[batch, cols, rows]`` (as Muon's
      kernel writes a float32 tall stack): iterated wide, so that every Gram product
      contracts the contiguous axis (a TF32 product contracting the strided one runs at
      about half the speed), the last product writing the matrices tall. The fast form
      only.
    square: the coefficients' ``c2`` is known to be nonzero: a 16-bit chain of one row of
      coefficients with the Frobenius normalization takes the step's factor as a square
      (:func:`~optirs_jax.orthogonal._ns_steps.square_terms`): two updates of its
      diagonal instead of the factor's elementwise passes, and in bfloat16 the more
      accurate form.

  Returns:
    The orthogonalized stack, shaped and typed as ``x`` (``transposed``: ``x``'s
    transposes, ``[batch, rows, cols]``).
  """
  if preconditioning not in PRECONDITIONINGS:
    raise ValueError(f"preconditioning={preconditioning!r} is not one of {PRECONDITIONINGS}")
  if transposed and (exact or x.shape[-2] >= x.shape[-1]):
    raise ValueError(f"transposed takes a wide stack in the fast form, not {x.shape} with "
                     f"exact={exact}")
  dtype = x.dtype
  # A spectral norm in float32 (no 16-bit SVD); and in float16 (6e-8 to 65504) the fast
  # form's Gram product of an unscaled stack under- or overflows where |X|_F is far from 1,
  # and the cast takes a small one's bits: both divided before the cast. (AOL and
  # Schatten-4 clip their scale as optax does: those stacks go unscaled.)
  half = jnp.dtype(x.dtype if ns_dtype is None else ns_dtype) == jnp.float16
  if preconditioning == "spectral" or (half and not exact and preconditioning == "frobenius"):
    w = x.astype(jnp.float32) if x.dtype.itemsize < 4 else x
    norm = jnp.linalg.norm(w, ord=2 if preconditioning == "spectral" else "fro",
                           axis=(-2, -1), keepdims=True) + eps
    x, preconditioning = (w / ns.real_as(norm, w)).astype(x.dtype), None
  if ns_dtype is not None:
    x = x.astype(ns_dtype)
  tall = x.shape[-2] > x.shape[-1]
  long, short = max(x.shape[-2:]), min(x.shape[-2:])
  padded = long if exact else tiling.padded(long)
  parts = 1 if exact or transposed else tiling.gram_splits(x.shape[0], short, padded,
                                                           itemsize=x.dtype.itemsize)
  swap = (exact and tall) or (parts > 1 and not tall)
  if swap:  # optax's program takes a wide stack; a split Gram product a tall one
    x, tall = jnp.swapaxes(x, -1, -2), not tall
  side = ns.Side(tall, parts)
  axis = -2 if side.tall else -1
  if padded != long:  # zeros: A and the rest unchanged
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, padded - long)
    x = jnp.pad(x, pad)
  if exact:
    x = _exact_chain(x, coeffs.astype(x.dtype), ns_steps, side, preconditioning, eps)
  else:
    if gram_form.applies(x, coeffs, ns_steps, preconditioning):
      x = gram_form.chain(x, coeffs, ns_steps, side, eps, out_tall=transposed,
                          normalize=preconditioning == "frobenius")
    elif (square and coeffs.ndim == 1 and preconditioning == "frobenius"
          and x.dtype.itemsize == 2 and ns.static_count(coeffs, ns_steps) != 0):
      x = _square_chain(x, coeffs.astype(x.dtype), ns_steps, side, eps, transposed)
    else:
      x = _fast_chain(x, coeffs.astype(x.dtype), ns_steps, side, preconditioning, eps,
                      transposed)
    axis = -2 if transposed else axis
  if padded != long:
    x = jax.lax.slice_in_dim(x, 0, long, axis=x.ndim + axis)
  return (jnp.swapaxes(x, -1, -2) if swap else x).astype(dtype)


def _exact_chain(x, c, ns_steps, side, preconditioning, eps):
  """optax's steps op for op: the Frobenius norm divided out first, then its loop (an
  unrolled fori_loop, or a scan over the rows), the first step's rescaling behind a
  ``cond``, so that XLA compiles the same iteration and the numbers are optax's bit for
  bit."""
  if preconditioning == "frobenius":
    x = x / ns.real_as(jnp.linalg.norm(x, ord="fro", axis=(-2, -1), keepdims=True) + eps, x)
  first = {"aol": ns.aol_step, "schatten": ns.schatten_step}.get(preconditioning)

  def one(i, x, row):
    if first is None:
      return ns.step(x, row, side, False)
    return jax.lax.cond(i == 0, lambda x: first(x, row, side, False),
                        lambda x: ns.step(x, row, side, False), x)

  if c.ndim == 1:
    return jax.lax.fori_loop(0, ns_steps, lambda i, x: one(i, x, c), x, unroll=True)

  def body(carry, row):
    i, x = carry
    return (i + 1, one(i, x, row)), None

  return jax.lax.scan(body, (jnp.asarray(0, jnp.int32), x), c)[0][1]


def _fast_chain(x, c, ns_steps, side, preconditioning, eps, out_tall=False):
  """The fast form's steps: the first one taken apart (its rescaling: AOL, Schatten-4, or
  the Frobenius norm's division folded into it), the others as an unrolled loop (or a
  scan over a schedule's rows); with ``out_tall`` the last apart, its product writing the
  iterate's transpose (a step count traced under ``inject_hyperparams``: transposed
  after the loop)."""
  first = {"aol": ns.aol_step, "schatten": ns.schatten_step,
           "frobenius": functools.partial(ns.frobenius_step, eps=eps)}.get(preconditioning,
                                                                         ns.step)
  n = ns.static_count(c, ns_steps)
  peel = out_tall and n is not None and n > 0
  middle = lambda x, end: (  # steps 1 to end - 1
      jax.lax.fori_loop(1, end, lambda i, x: ns.step(x, c, side, True), x, unroll=True)
      if c.ndim == 1 else
      jax.lax.scan(lambda x, row: (ns.step(x, row, side, True), None), x, c[1:end])[0])
  if not peel:
    x = middle(first(x, c if c.ndim == 1 else c[0], side, True), ns_steps if c.ndim == 1 else n)
    return jnp.swapaxes(x, -1, -2) if out_tall else x
  last = side._replace(out_tall=True)
  x = first(x, c if c.ndim == 1 else c[0], last if n == 1 else side, True)
  if n > 2:
    x = middle(x, n - 1)
  return ns.step(x, c if c.ndim == 1 else c[-1], last, True) if n > 1 else x


def _square_chain(x, c, ns_steps, side, eps, out_tall=False):
  """The fast form's steps in the square form (:func:`~._ns_steps.square_terms`; one row
  of coefficients, the Frobenius normalization folded into the first step): ``Y = q X / s``
  is iterated, its sign carried as a scalar, and ``1 / q`` folded into the last step's
  factor (with a traced step count, into a multiply after the loop)."""
  q, sigma, _, _ = ns.square_terms(c)
  n = ns.static_count(c, ns_steps)
  a = side.gram(x)
  s = ns.inverse_norm(a, eps)  # 1 / (|X|_F + eps)
  last = side._replace(out_tall=True) if out_tall else side
  end = (sigma**n / q) if n is not None else None  # the last step's 1 / q, and the signs
  if n == 1:
    return ns.square_step(x, c, last, g=a, pre=q * q * s * s, post=q * s * end)
  z = ns.square_step(x, c, side, g=a, pre=q * q * s * s, post=q * s)
  if n is None:  # traced: the loop's steps, then the scale and the transpose
    z = jax.lax.fori_loop(1, ns_steps, lambda i, z: ns.square_step(z, c, side), z)
    z = z * (sigma**ns_steps / q).astype(z.dtype)
    return jnp.swapaxes(z, -1, -2) if out_tall else z
  if n > 2:
    z = jax.lax.fori_loop(1, n - 1, lambda i, z: ns.square_step(z, c, side), z, unroll=True)
  return ns.square_step(z, c, last, post=end) if n > 1 else z


def orthogonalize(leaves: Sequence[jax.Array], dims: Sequence, coeffs: jax.Array,
                  ns_steps: int, *, preconditioning: str = "frobenius", eps=1e-8,
                  ns_dtype=None, ns_axes="auto", stacks=None,
                  square: bool = False) -> list[jax.Array]:
  """Every leaf orthogonalized; leaves whose matrices share a shape and a dtype run as
  one batched chain (:func:`orthogonalize_stack` of their concatenated
  matrices).

  On a mesh of several devices (the context mesh of ``jax.set_mesh``, or the mesh of
  leaves sharded on Explicit axes), each stack is first spread over the mesh axes
  ``ns_axes`` (``"auto"``: every axis not manual; ``None``: do not spread) by its matrices,
  zero matrices padding it to a multiple of the devices: every device orthogonalizes whole
  matrices, so the iteration holds no collective; one reshard takes the stack there and the
  results back to their leaves' shardings.

  ``stacks``: ``(indices, dtype, layout) -> flat stack or None``, asked for the stack of
  the leaves at ``indices`` (in ``dtype``, the chain's) where a group takes the fast form
  unspread and its leaves are their matrices without a transpose: Muon's kernel writes it
  with the momentum (:func:`~optirs_jax.orthogonal._momentum_stack.momentum_stack`).
  ``layout``: None (the matrices one after another), or a ``Layout(rows, cols, width,
  transposed)`` for a tall group: each matrix zero past its rows to ``width``, transposed
  for a float32 group (the stack then iterated wide: :func:`orthogonalize_stack`'s
  ``transposed``), as it is for a 16-bit one whose long side the fast form pads. None, or
  no ``stacks``: the leaves concatenated.
  ``square``: the coefficients' ``c2`` is nonzero (:func:`orthogonalize_stack`'s).

  >>> import jax.numpy as jnp
  >>> from optirs_jax.orthogonal import MuonDimensionNumbers, coefficients, orthogonalize
  >>> w = [jnp.eye(2, 3), 2 * jnp.eye(2, 3)]
  >>> o = orthogonalize(w, [MuonDimensionNumbers()] * 2, coefficients("standard", 5), 5)
  >>> [round(float(x), 2) for x in o[1].diagonal()]  # the quintic's fixed point, not 1
  [1.11, 1.11]
  >>> bool((o[0] == o[1]).all())  # the direction alone counts
  True
  """
  views = [MatrixView.of(x.shape, d) for x, d in zip(leaves, dims, strict=True)]
  groups: dict = {}
  for i, (x, v) in enumerate(zip(leaves, views)):
    groups.setdefault((v.shape[1:], jnp.dtype(x.dtype)), []).append(i)
  mesh, usable = mesh_of(leaves)
  axes = spread_axes(mesh, usable, ns_axes)
  kw = dict(preconditioning=preconditioning, eps=eps, ns_dtype=ns_dtype, mesh=mesh,
            axes=axes, square=square)
  explicit = [a for a in axes if dict(zip(mesh.axis_names, mesh.axis_types))[a] ==
              AxisType.Explicit]
  out: list = [None] * len(leaves)
  for (shape, dtype), idx in groups.items():
    mats = [views[i].to_matrices(leaves[i]) for i in idx]
    stack, layout = None, tiling.layout(shape, ns_dtype or dtype)
    if (stacks is not None and not axes and not _exact(len(idx), shape, dtype, ns_dtype)
        and all(views[i].transpose == tuple(sorted(views[i].transpose)) for i in idx)):
      stack = stacks(idx, jnp.dtype(ns_dtype or dtype), layout)
    transposed = stack is not None and layout is not None and layout.transposed
    if stack is not None:
      rows, cols = shape
      width = layout.width if layout else rows
      stack = stack.reshape((-1, cols, width) if transposed else (-1, width, cols))
    run = functools.partial(_orthogonalize_group, coeffs=coeffs, ns_steps=ns_steps,
                            stack=stack, transposed=transposed, **kw)
    if explicit:  # GSPMD places the stack (Explicit axes would refuse its concatenation)
      run = jax.sharding.auto_axes(run, axes=tuple(explicit),
                                   out_sharding=[jax.typeof(m).sharding for m in mats])
    for i, part in zip(idx, run(mats)):
      out[i] = views[i].from_matrices(part)
  return out


def _exact(n: int, shape, dtype, ns_dtype) -> bool:
  """Whether a group of ``n`` leaves of matrices ``shape`` takes optax's program: one leaf
  at the momentum's precision, its numbers bit for bit, unless its long side asks for the
  fast form's padding and split Gram product."""
  return (n == 1 and (ns_dtype is None or jnp.dtype(ns_dtype) == jnp.dtype(dtype))
          and max(shape) <= tiling.PAD_ABOVE)


def _orthogonalize_group(mats, coeffs, ns_steps, *, mesh, axes, stack=None,
                         transposed=False, **kw):
  """Matrices of one shape as one chain: concatenated (unless ``stack`` is their stack
  already, ``transposed``: their transposes, padded), spread over ``axes`` (whole matrices
  per device), orthogonalized, and split again."""
  if stack is None:
    stack = mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=0)
  batch = stack.shape[0]
  if axes:
    stack = spread(stack, mesh, axes)
  exact = _exact(len(mats), mats[0].shape[1:], mats[0].dtype, kw.get("ns_dtype"))
  done = orthogonalize_stack(stack, coeffs, ns_steps, exact=exact, transposed=transposed,
                             **kw)[:batch, :mats[0].shape[1]]
  done = done.astype(mats[0].dtype)  # a stack given in the chain's dtype comes back so
  bounds = np.cumsum([0] + [m.shape[0] for m in mats])
  return [done[a:b] for a, b in itertools.pairwise(bounds)]


def flops(shape: Sequence[int], ns_steps: int, dims=None) -> int:
  """Floating-point operations of the matrix products of ``ns_steps`` Newton–Schulz steps
  on a leaf of ``shape`` (``dims``: its :class:`MuonDimensionNumbers`, default a 2-D
  matrix): per matrix (``m <= n`` after the transpose) and step,
  :math:`2m^2n` (the Gram matrix), :math:`2m^3` (its square) and :math:`2m^2n` (the
  product with X). The elementwise work is not counted.

  >>> flops((768, 3072), 5) / 1e9
  40.76863488
  """
  b, r, c = MatrixView.of(shape, dims or MuonDimensionNumbers()).shape
  m, n = min(r, c), max(r, c)
  return b * ns_steps * (4 * m * m * n + 2 * m**3)

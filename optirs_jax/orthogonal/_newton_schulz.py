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
matrix products: GPT-2 small's 48 weight matrices and two embeddings are five chains
(the MLP's two projections, one the other's transpose, share one).
Each matrix of a stack takes exactly the operations optax's chain takes on it alone.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

#: Newton–Schulz coefficients by name (optax's presets): Keller Jordan's quintic, and
#: Dion's five-step schedule (one row per step).
PRESETS = {
    "standard": (3.4445, -4.7750, 2.0315),
    "dion": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
             (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)),
}
PRECONDITIONINGS = ("frobenius", "spectral", "aol", "schatten")
_FIRST_STEP_EPS = 1e-8  # the floor of the AOL and Schatten-4 rescalings (optax's)


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


def _real_as(v, x):
  """A real scale ``v`` for ``x``: as it is, or cast to ``x``'s complex dtype (what numpy's
  promotion does; written out so that strict promotion takes it too)."""
  return v.astype(x.dtype) if jnp.iscomplexobj(x) else v


def _gram(x):
  return x @ jnp.swapaxes(x, -1, -2).conj()


def _step(x, c):
  """One quintic step on a stack: ``c0 X + (c1 A + c2 A A) X`` with ``A = X X^H``, in
  optax's order of operations (``c2 * A`` is formed before its product with ``A``)."""
  a = _gram(x)
  b = c[1] * a + c[2] * a @ a
  return c[0] * x + b @ x


def _aol_step(x, c):
  """The first step with AOL rescaling (Boissin et al., 2025): each row scaled by the
  inverse square root of its Gram row's absolute sum."""
  a = _gram(x)
  s = jnp.expand_dims(jax.lax.rsqrt(jnp.clip(jnp.abs(a).sum(axis=-1), min=_FIRST_STEP_EPS)),
                      -1)
  s = _real_as(s, x)
  x, a = x * s, a * s * jnp.swapaxes(s, -1, -2)
  b = c[1] * a + c[2] * a @ a
  return c[0] * x + b @ x


def _schatten_step(x, c):
  """The first step rescaled by the Schatten-4 norm (Grishina et al., 2025)."""
  a = x @ jnp.swapaxes(x, -1, -2)
  norm = jnp.linalg.norm(a, ord="fro", axis=(-2, -1), keepdims=True)
  s = _real_as(jax.lax.rsqrt(jnp.clip(norm, min=_FIRST_STEP_EPS)), x)
  x, a = x * s, a * s**2
  b = c[1] * a + c[2] * a @ a
  return c[0] * x + b @ x


def orthogonalize_stack(x: jax.Array, coeffs: jax.Array, ns_steps: int, *,
                        preconditioning: str = "frobenius", eps=1e-8, ns_dtype=None
                        ) -> jax.Array:
  """Newton–Schulz on every matrix of ``x`` (``[batch, rows, cols]``), one chain.

  Args:
    x: the stacked matrices.
    coeffs: ``(3,)`` coefficients for ``ns_steps`` steps, or ``(n, 3)``: one row per step.
    ns_steps: steps of a ``(3,)`` schedule.
    preconditioning: ``"frobenius"`` or ``"spectral"`` (divide by that norm first),
      ``"aol"`` or ``"schatten"`` (rescale in the first step).
    eps: added to the Frobenius or spectral norm.
    ns_dtype: the products' dtype (``None``: ``x``'s); the result comes back in ``x``'s.

  Returns:
    The orthogonalized stack, shaped and typed as ``x``.
  """
  if preconditioning not in PRECONDITIONINGS:
    raise ValueError(f"preconditioning={preconditioning!r} is not one of {PRECONDITIONINGS}")
  dtype = x.dtype
  if ns_dtype is not None:
    x = x.astype(ns_dtype)
  wide = x.shape[-2] <= x.shape[-1]
  if not wide:
    x = jnp.swapaxes(x, -1, -2)
  if preconditioning == "frobenius":
    x = x / _real_as(jnp.linalg.norm(x, ord="fro", axis=(-2, -1), keepdims=True) + eps, x)
  elif preconditioning == "spectral":
    x = x / _real_as(jnp.linalg.norm(x, ord=2, axis=(-2, -1), keepdims=True) + eps, x)
  c = coeffs.astype(x.dtype)
  first = {"aol": _aol_step, "schatten": _schatten_step}.get(preconditioning)

  def step(i, x, row):
    if first is None:
      return _step(x, row)
    return jax.lax.cond(i == 0, lambda x: first(x, row), lambda x: _step(x, row), x)

  # optax's loop structure (an unrolled fori_loop, or a scan over the rows), so that XLA
  # compiles the same iteration and the numbers are optax's bit for bit.
  if c.ndim == 1:
    x = jax.lax.fori_loop(0, ns_steps, lambda i, x: step(i, x, c), x, unroll=True)
  else:
    def body(carry, row):
      i, x = carry
      return (i + 1, step(i, x, row)), None

    (_, x), _ = jax.lax.scan(body, (jnp.asarray(0, jnp.int32), x), c)
  if not wide:
    x = jnp.swapaxes(x, -1, -2)
  return x.astype(dtype)


def orthogonalize(leaves: Sequence[jax.Array], dims: Sequence, coeffs: jax.Array,
                  ns_steps: int, *, preconditioning: str = "frobenius", eps=1e-8,
                  ns_dtype=None, ns_axes="auto") -> list[jax.Array]:
  """Every leaf orthogonalized; leaves whose matrices share a shape (up to a transpose)
  and a dtype run as one batched chain (:func:`orthogonalize_stack` of their concatenated
  matrices).

  On a mesh of several devices (the context mesh of ``jax.set_mesh``, or the mesh of
  leaves sharded on Explicit axes), each stack is first spread over the mesh axes
  ``ns_axes`` (``"auto"``: every axis not manual; ``None``: do not spread) by its matrices,
  zero matrices padding it to a multiple of the devices: every device orthogonalizes whole
  matrices, so the iteration holds no collective; one reshard takes the stack there and the
  results back to their leaves' shardings.

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
  # Tall matrices are orthogonalized transposed (as optax does each): one chain serves a
  # shape and its transpose (an MLP's two projections).
  tall = [v.shape[1] > v.shape[2] for v in views]
  groups: dict = {}
  for i, (x, v) in enumerate(zip(leaves, views)):
    wide = v.shape[2:0:-1] if tall[i] else v.shape[1:]
    groups.setdefault((wide, jnp.dtype(x.dtype)), []).append(i)
  mesh, usable = _mesh_of(leaves)
  spread = _spread_axes(mesh, usable, ns_axes)
  kw = dict(preconditioning=preconditioning, eps=eps, ns_dtype=ns_dtype, mesh=mesh,
            spread=spread)
  explicit = [a for a in spread if dict(zip(mesh.axis_names, mesh.axis_types))[a] ==
              AxisType.Explicit]
  out: list = [None] * len(leaves)
  for idx in groups.values():
    mats = [views[i].to_matrices(leaves[i]) for i in idx]
    mats = [jnp.swapaxes(m, -1, -2) if tall[i] else m for m, i in zip(mats, idx)]
    run = lambda mats: _orthogonalize_group(mats, coeffs, ns_steps, **kw)
    if explicit:  # GSPMD places the stack (Explicit axes would refuse its concatenation)
      run = jax.sharding.auto_axes(run, axes=tuple(explicit),
                                   out_sharding=[jax.typeof(m).sharding for m in mats])
    for i, part in zip(idx, run(mats)):
      out[i] = views[i].from_matrices(jnp.swapaxes(part, -1, -2) if tall[i] else part)
  return out


def _orthogonalize_group(mats, coeffs, ns_steps, *, mesh, spread, **kw):
  """Matrices of one shape as one chain: concatenated, spread over ``spread`` (whole
  matrices per device), orthogonalized, and split again."""
  stack = mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=0)
  batch = stack.shape[0]
  if spread:
    stack = _spread(stack, mesh, spread)
  done = orthogonalize_stack(stack, coeffs, ns_steps, **kw)[:batch]
  bounds = np.cumsum([0] + [m.shape[0] for m in mats])
  return [done[a:b] for a, b in itertools.pairwise(bounds)]


def _mesh_of(leaves):
  """The context mesh, or else the mesh of the first leaf sharded on Explicit axes (its
  Auto axes dropped: without a context mesh no constraint can name them)."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    return mesh, mesh.axis_names
  for x in leaves:
    m = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if m is not None and not m.empty and AxisType.Explicit in m.axis_types:
      return m, tuple(a for a, t in zip(m.axis_names, m.axis_types) if t == AxisType.Explicit)
  return mesh, ()


def _spread_axes(mesh, usable, ns_axes) -> tuple[str, ...]:
  """The mesh axes (of more than one device) to spread stacks over."""
  if ns_axes is None or not usable:
    return ()
  kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  if ns_axes == "auto":
    axes = [a for a in usable if kinds[a] != AxisType.Manual]
  else:
    axes = [ns_axes] if isinstance(ns_axes, str) else list(ns_axes)
    unknown = [a for a in axes if a not in usable]
    if unknown:
      raise ValueError(f"ns_axes={ns_axes!r} names {unknown}, not axes of the mesh "
                       f"{dict(mesh.shape)} it can spread over; valid: 'auto', None or names "
                       f"among {tuple(usable)}")
    if any(kinds[a] == AxisType.Manual for a in axes):
      raise ValueError(f"ns_axes={ns_axes!r}: inside shard_map the leaves are the device's "
                       "shards; spread over axes that are not manual")
  return tuple(a for a in axes if mesh.shape[a] > 1)


def _spread(stack, mesh, axes):
  """``stack`` padded with zero matrices to a multiple of the devices of ``axes`` and
  constrained to be sharded over them by matrix."""
  n = math.prod(mesh.shape[a] for a in axes)
  if stack.shape[0] % n:
    pad = n - stack.shape[0] % n
    stack = jnp.concatenate([stack, jnp.zeros((pad, *stack.shape[1:]), stack.dtype)])
  return jax.lax.with_sharding_constraint(stack, P(axes if len(axes) > 1 else axes[0]))


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

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
A leaf alone in its chain, at the momentum's precision, takes optax's program op for op
(its numbers bit for bit). A stack of several, or any chain with a narrower ``ns_dtype``,
takes the fast form, equal to rounding: a tall stack is not transposed (its products take
it transposed in place), each step is one product, :math:`X_{k+1} = (c_0 I + c_1 A_k +
c_2 A_k^2) X_k`, and a long side above 4096 is padded once for the products.
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


class _Side(NamedTuple):
  """How a stack of matrices is multiplied, by its orientation. A wide stack (rows <=
  columns) takes optax's iteration, ``A = X X^H`` and ``X' = c0 X + B X``; a tall one is
  read as the transpose of a wide one, ``Y = X^T``, without moving it: ``A^T = Y^H Y`` and
  ``Y' = c0 Y + Y B^T`` (``B^T`` is ``B`` of ``A^T``: transposing commutes with the
  polynomial), so the products take their operands in place of a transpose each way."""

  tall: bool

  def gram(self, x, conj: bool = True):
    """``X X^H`` (``Y^H Y`` for a tall stack; ``conj=False``: the plain transposes)."""
    if not self.tall:  # optax's expression, so that the exact program is its program
      xt = jnp.swapaxes(x, -1, -2)
      return x @ (xt.conj() if conj else xt)
    return _batched_dot(x.conj() if conj else x, x, 1)

  def apply(self, b, x):
    return _batched_dot(x, b, 2) if self.tall else b @ x

  def scale(self, x, s):
    """``x`` with each of its Gram matrix's rows' vectors (rows of a wide stack, columns
    of a tall one) scaled by ``s`` (``[..., k]``)."""
    return x * (s[..., None, :] if self.tall else s[..., :, None])


def _batched_dot(a, b, axis: int):
  """``a`` and ``b`` (``[batch, ., .]``) contracted over ``a``'s ``axis`` and ``b``'s rows
  (an operand's transpose taken in place by the product)."""
  return jax.lax.dot_general(a, b, (((axis,), (1,)), ((0,), (0,))),
                             preferred_element_type=jnp.result_type(a, b))


def _update(x, a, c, side, fold: bool):
  """The step's new iterate from ``x`` and its (rescaled) Gram matrix ``a``:
  ``c0 X + (c1 A + c2 A A) X`` in optax's order (``c2 * A`` formed before its product with
  ``A``), or with ``fold`` the one product ``(c0 I + c1 A + c2 A A) X``, its factor
  materialized first (a product fed by an elementwise prologue falls off cuBLAS)."""
  b = c[1] * a + c[2] * a @ a
  if not fold:
    return c[0] * x + side.apply(b, x)
  b = b + c[0] * jnp.eye(a.shape[-1], dtype=a.dtype)[None]
  return side.apply(jax.lax.optimization_barrier(b), x)


def _step(x, c, side, fold):
  """One quintic step on a stack: ``c0 X + (c1 A + c2 A A) X`` with ``A = X X^H``."""
  return _update(x, side.gram(x), c, side, fold)


def _aol_step(x, c, side, fold):
  """The first step with AOL rescaling (Boissin et al., 2025): each row scaled by the
  inverse square root of its Gram row's absolute sum."""
  a = side.gram(x)
  s = jax.lax.rsqrt(jnp.clip(jnp.abs(a).sum(axis=-2 if side.tall else -1),
                             min=_FIRST_STEP_EPS))
  s = _real_as(s, x)
  return _update(side.scale(x, s), a * s[..., :, None] * s[..., None, :], c, side, fold)


def _schatten_step(x, c, side, fold):
  """The first step rescaled by the Schatten-4 norm (Grishina et al., 2025)."""
  a = side.gram(x, conj=False)  # optax's: no conjugate
  norm = jnp.linalg.norm(a, ord="fro", axis=(-2, -1), keepdims=True)
  s = _real_as(jax.lax.rsqrt(jnp.clip(norm, min=_FIRST_STEP_EPS)), x)
  return _update(x * s, a * s**2, c, side, fold)


#: Stacks whose long side is above this are padded to a multiple of ``_PAD`` once, before
#: the iteration: a product contracting over an unaligned axis pads its operand itself,
#: a pass over the stack in every step (GPT-2's 50257-entry vocabulary).
_PAD_ABOVE, _PAD = 4096, 128


def orthogonalize_stack(x: jax.Array, coeffs: jax.Array, ns_steps: int, *,
                        preconditioning: str = "frobenius", eps=1e-8, ns_dtype=None,
                        exact: bool = False) -> jax.Array:
  """Newton–Schulz on every matrix of ``x`` (``[batch, rows, cols]``), one chain.

  A tall stack (rows > columns) is iterated as the transpose of a wide one, as optax
  does. With ``exact``, by optax's program op for op (the stack transposed there and
  back, ``c0 X + B X``): on one matrix its numbers bit for bit. Otherwise the fast form,
  the same numbers to rounding: the products take a tall stack transposed in place, each
  step is one product ``(c0 I + c1 A + c2 A^2) X``, and a long side above 4096 is padded
  with zeros to a multiple of 128 once (its products would pad it in every step).

  Args:
    x: the stacked matrices.
    coeffs: ``(3,)`` coefficients for ``ns_steps`` steps, or ``(n, 3)``: one row per step.
    ns_steps: steps of a ``(3,)`` schedule.
    preconditioning: ``"frobenius"`` or ``"spectral"`` (divide by that norm first),
      ``"aol"`` or ``"schatten"`` (rescale in the first step).
    eps: added to the Frobenius or spectral norm.
    ns_dtype: the products' dtype (``None``: ``x``'s); the result comes back in ``x``'s.
    exact: optax's program (above).

  Returns:
    The orthogonalized stack, shaped and typed as ``x``.
  """
  if preconditioning not in PRECONDITIONINGS:
    raise ValueError(f"preconditioning={preconditioning!r} is not one of {PRECONDITIONINGS}")
  dtype = x.dtype
  if ns_dtype is not None:
    x = x.astype(ns_dtype)
  side = _Side(x.shape[-2] > x.shape[-1])
  swap = exact and side.tall
  if swap:
    x, side = jnp.swapaxes(x, -1, -2), _Side(False)
  fold = not exact
  axis = -2 if side.tall else -1
  long = x.shape[axis]
  if not exact and long > _PAD_ABOVE and long % _PAD:  # zeros: A and the rest unchanged
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -long % _PAD)
    x = jnp.pad(x, pad)
  if preconditioning == "frobenius":
    x = x / _real_as(jnp.linalg.norm(x, ord="fro", axis=(-2, -1), keepdims=True) + eps, x)
  elif preconditioning == "spectral":
    x = x / _real_as(jnp.linalg.norm(x, ord=2, axis=(-2, -1), keepdims=True) + eps, x)
  c = coeffs.astype(x.dtype)
  first = {"aol": _aol_step, "schatten": _schatten_step}.get(preconditioning)

  def step(i, x, row):
    if first is None:
      return _step(x, row, side, fold)
    return jax.lax.cond(i == 0, lambda x: first(x, row, side, fold),
                        lambda x: _step(x, row, side, fold), x)

  # optax's loop structure (an unrolled fori_loop, or a scan over the rows), so that XLA
  # compiles the same iteration and the numbers are optax's bit for bit.
  if c.ndim == 1:
    x = jax.lax.fori_loop(0, ns_steps, lambda i, x: step(i, x, c), x, unroll=True)
  else:
    def body(carry, row):
      i, x = carry
      return (i + 1, step(i, x, row)), None

    (_, x), _ = jax.lax.scan(body, (jnp.asarray(0, jnp.int32), x), c)
  if x.shape[axis] != long:
    x = jax.lax.slice_in_dim(x, 0, long, axis=x.ndim + axis)
  if swap:
    x = jnp.swapaxes(x, -1, -2)
  return x.astype(dtype)


def orthogonalize(leaves: Sequence[jax.Array], dims: Sequence, coeffs: jax.Array,
                  ns_steps: int, *, preconditioning: str = "frobenius", eps=1e-8,
                  ns_dtype=None, ns_axes="auto") -> list[jax.Array]:
  """Every leaf orthogonalized; leaves whose matrices share a shape and a dtype run as
  one batched chain (:func:`orthogonalize_stack` of their concatenated
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
  groups: dict = {}
  for i, (x, v) in enumerate(zip(leaves, views)):
    groups.setdefault((v.shape[1:], jnp.dtype(x.dtype)), []).append(i)
  mesh, usable = _mesh_of(leaves)
  spread = _spread_axes(mesh, usable, ns_axes)
  kw = dict(preconditioning=preconditioning, eps=eps, ns_dtype=ns_dtype, mesh=mesh,
            spread=spread)
  explicit = [a for a in spread if dict(zip(mesh.axis_names, mesh.axis_types))[a] ==
              AxisType.Explicit]
  out: list = [None] * len(leaves)
  for idx in groups.values():
    mats = [views[i].to_matrices(leaves[i]) for i in idx]
    run = lambda mats: _orthogonalize_group(mats, coeffs, ns_steps, **kw)
    if explicit:  # GSPMD places the stack (Explicit axes would refuse its concatenation)
      run = jax.sharding.auto_axes(run, axes=tuple(explicit),
                                   out_sharding=[jax.typeof(m).sharding for m in mats])
    for i, part in zip(idx, run(mats)):
      out[i] = views[i].from_matrices(part)
  return out


def _orthogonalize_group(mats, coeffs, ns_steps, *, mesh, spread, **kw):
  """Matrices of one shape as one chain: concatenated, spread over ``spread`` (whole
  matrices per device), orthogonalized, and split again."""
  stack = mats[0] if len(mats) == 1 else jnp.concatenate(mats, axis=0)
  batch = stack.shape[0]
  if spread:
    stack = _spread(stack, mesh, spread)
  ns_dtype = kw.get("ns_dtype")
  # One leaf at the momentum's precision takes optax's program, its numbers bit for bit.
  exact = len(mats) == 1 and (ns_dtype is None or jnp.dtype(ns_dtype) == stack.dtype)
  done = orthogonalize_stack(stack, coeffs, ns_steps, exact=exact, **kw)[:batch]
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

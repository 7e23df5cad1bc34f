"""Muon: momentum orthogonalized by Newton–Schulz for matrices, AdamW for the rest."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optirs_jax.backends import validate_backend
from optirs_jax.orthogonal._momentum_stack import fusable, momentum_stack
from optirs_jax.orthogonal._newton_schulz import (
  PRECONDITIONINGS,
  PRESETS,
  MuonDimensionNumbers,
  coefficients,
  fans,
  is_dimension_numbers,
  orthogonalize,
)
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.transforms._checks import (
  canonical_dtype,
  check_flag,
  check_number,
  check_number_or_schedule,
  check_unit_interval,
  structural_int,
)


class MuonState(NamedTuple):
  """State of :func:`scale_by_muon` (optax's ``MuonState``, field for field)."""

  count: jax.Array  # shape=(), dtype=jnp.int32
  mu: optax.Updates  # the momentum, in ``mu_dtype`` (or the updates' dtype)
  ns_coeffs: jax.Array  # (3,) or (steps, 3)


def _check_choices(fn: str, preconditioning, ns_coeffs) -> None:
  if preconditioning not in PRECONDITIONINGS:
    raise ValueError(f"{fn}: preconditioning={preconditioning!r} is not one of "
                     f"{PRECONDITIONINGS}")
  if isinstance(ns_coeffs, str) and ns_coeffs not in PRESETS:
    raise ValueError(f"{fn}: ns_coeffs={ns_coeffs!r} is not a preset; valid: "
                     f"{tuple(PRESETS)}, or a tuple (c0, c1, c2), or a tuple of such tuples")


def _resolve(dims, updates):
  """The dimension numbers of ``updates`` (a tree of them, a callable of the updates, or
  None for the 2-D rule), one per leaf of ``updates``."""
  leaves, treedef = jax.tree.flatten(updates)
  if dims is None:
    return leaves, treedef, [MuonDimensionNumbers()] * len(leaves)
  tree = dims(updates) if callable(dims) else dims
  if is_dimension_numbers(tree):
    return leaves, treedef, [tree] * len(leaves)
  return leaves, treedef, treedef.flatten_up_to(tree)


def scale_by_muon(ns_coeffs: Any = PRESETS["standard"], ns_steps: int = 5,
                  beta: jax.typing.ArrayLike = 0.95, eps: jax.typing.ArrayLike = 1e-8,
                  mu_dtype: Any | None = None, *, nesterov: bool = True,
                  adaptive: bool = False, preconditioning: str = "frobenius",
                  weight_dimension_numbers: Any = None, ns_dtype: Any | None = None,
                  ns_axes: Any = "auto", backend: str = "auto"
                  ) -> optax.GradientTransformation:
  r"""Muon's direction: momentum, orthogonalized; the numbers of
  :func:`optax.contrib.scale_by_muon`, with the leaves of one matrix shape orthogonalized
  as one batched chain (:func:`~optirs_jax.orthogonal.orthogonalize`).

  .. math::
    m_t = \beta m_{t-1} + (1-\beta) g_t,\qquad
    \hat m_t = \beta\,\frac{m_t}{1-\beta^{t+1}} + (1-\beta)\,\frac{g_t}{1-\beta^t}
    \ (\text{Nesterov; else } m_t / (1-\beta^t)),\qquad
    u_t = \mathrm{NS}(\hat m_t)\ [\cdot\,\langle \hat m_t, \mathrm{NS}(\hat m_t)\rangle
    \text{ if adaptive}]

  Args:
    ns_coeffs, ns_steps, beta, eps, mu_dtype: as in :func:`muon`.
    nesterov, adaptive, preconditioning: as in :func:`muon`.
    weight_dimension_numbers: a tree of :class:`MuonDimensionNumbers`, a callable of the
      updates giving one, or ``None`` (every leaf a 2-D matrix).
    ns_dtype: the Newton–Schulz products' dtype (``None``: the momentum's, as optax).
    ns_axes: the mesh axes the stacked matrices are spread over, whole, before the
      iteration (:func:`~optirs_jax.orthogonal.orthogonalize`).
    backend: where a stack taking the fast form gets its momentum: ``"auto"`` (on a GPU,
      one kernel writes the float32 momenta and the stack in one pass:
      :mod:`~optirs_jax.orthogonal._momentum_stack`; elsewhere XLA), ``"pallas"`` (that
      kernel in interpret mode off a GPU) or ``"jnp"`` (XLA's fusions everywhere).

  Returns:
    An :class:`optax.GradientTransformation` with state :class:`MuonState`.
  """
  fn = "scale_by_muon"
  # An int; under inject_hyperparams' update a traced count, which the loop runs as optax's.
  concrete = structural_int(fn, "ns_steps", ns_steps, 1)
  steps = ns_steps if concrete is None else concrete
  _check_choices(fn, preconditioning, ns_coeffs)
  check_unit_interval(fn, "beta", beta)
  check_number(fn, "eps", eps)
  check_flag(fn, "nesterov", nesterov)
  check_flag(fn, "adaptive", adaptive)
  mu_dtype = canonical_dtype(fn, "mu_dtype", mu_dtype)
  ns_dtype = canonical_dtype(fn, "ns_dtype", ns_dtype)
  validate_backend(backend)
  # Checked now: a bad shape fails at construction. (With a traced count, inside
  # inject_hyperparams' update, only the update runs: it takes the state's coefficients.)
  coeffs = None if concrete is None else coefficients(ns_coeffs, concrete)
  square = _nonzero_c2(ns_coeffs)

  def init_fn(params):
    if coeffs is None:
      raise ValueError(f"{fn}: init needs a concrete ns_steps, got {ns_steps!r}")
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, dtype=mu_dtype), params)
    return MuonState(jnp.zeros([], jnp.int32), mu, coeffs)

  def update_fn(updates, state, params=None):
    del params
    gs, treedef, dims = _resolve(weight_dimension_numbers, updates)
    mus = treedef.flatten_up_to(state.mu)
    count = optax.safe_increment(state.count)
    new_mu = [(1 - beta) * g + beta * m for g, m in zip(gs, mus)]
    # 1 - beta^n in float32 (as optax's power promotes the count), then in t's dtype.
    debias = lambda n: 1 - beta**n.astype(jnp.float32)
    correct = lambda t, n: t / debias(n).astype(t.dtype)
    later = optax.safe_increment(count)
    if nesterov:
      mu_hat = [beta * correct(m, later) + (1 - beta) * correct(g, count)
                for m, g in zip(new_mu, gs)]
    else:
      mu_hat = [correct(m, count) for m in new_mu]
    fused = {}  # leaf -> its momentum, where the kernel wrote it with the stack
    f32 = jnp.float32  # the kernel's scalars (unused, and dropped, where no stack takes it)
    h = jnp.stack([jnp.asarray(1 - beta, f32), jnp.asarray(beta, f32),
                   debias(count).astype(f32), debias(later).astype(f32)])

    def stacks(idx, dtype, layout):  # the stack of the leaves at idx, their momenta, one pass
      g, m = [gs[i] for i in idx], [mus[i] for i in idx]
      if backend == "jnp" or not fusable(g, m):
        return None
      wide = None if layout is None else (layout.rows, layout.cols, layout.width)
      news, stack = momentum_stack(g, m, h, nesterov=nesterov, stack_dtype=dtype, wide=wide,
                                   transpose=wide is None or layout.transposed,
                                   backend=backend)
      fused.update(zip(idx, news))
      return stack

    out = orthogonalize(mu_hat, dims, state.ns_coeffs, steps, preconditioning=preconditioning,
                        eps=eps, ns_dtype=ns_dtype, ns_axes=ns_axes, stacks=stacks,
                        square=square)
    if adaptive:  # the dual norm of the momentum (Bernstein et al., 2024)
      out = [jnp.sum(m.conj() * o) * o for m, o in zip(mu_hat, out)]
    new_mu = [fused.get(i, m) for i, m in enumerate(new_mu)]
    new_mu = [m if mu_dtype is None else m.astype(mu_dtype) for m in new_mu]
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    return unflat(out), MuonState(count, unflat(new_mu), state.ns_coeffs)

  return optax.GradientTransformation(init_fn, update_fn)


def _nonzero_c2(ns_coeffs) -> bool:
  """Whether ``ns_coeffs`` is one known row of coefficients whose ``c2`` is not zero (the
  square form's condition, :func:`orthogonalize_stack`'s ``square``)."""
  try:
    c = np.asarray(PRESETS[ns_coeffs] if isinstance(ns_coeffs, str) else ns_coeffs, float)
  except (TypeError, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return False
  return c.shape == (3,) and bool(c[2] != 0)


def _scale_by_shape(weight_dimension_numbers, consistent_rms) -> optax.GradientTransformation:
  """Width scaling ``sqrt(max(1, fan_out / fan_in))`` (Jordan), or with ``consistent_rms``
  ``sqrt(max(fan_in, fan_out)) * consistent_rms`` (Liu et al., 2025)."""

  def scale(u, dims):
    fan_in, fan_out = fans(u.shape, dims)
    if consistent_rms is None:
      return jnp.sqrt(jnp.maximum(1, fan_out / fan_in)) * u
    return jnp.sqrt(jnp.maximum(fan_in, fan_out)) * consistent_rms * u

  def update_fn(updates, state, params=None):
    del params
    us, treedef, dims = _resolve(weight_dimension_numbers, updates)
    return jax.tree.unflatten(treedef, [scale(u, d) for u, d in zip(us, dims)]), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def _labels(dims_arg) -> Callable:
  """``params -> labels``: "muon" where a leaf has dimension numbers (by default: where it
  is a matrix), "adam" elsewhere."""
  if dims_arg is None:
    return lambda params: jax.tree.map(lambda x: "muon" if x.ndim == 2 else "adam", params)

  def labels(params):
    tree = dims_arg(params) if callable(dims_arg) else dims_arg
    leaves, treedef = jax.tree.flatten(params)
    if is_dimension_numbers(tree):
      return jax.tree.unflatten(treedef, ["muon"] * len(leaves))
    is_spec = lambda x: x is None or is_dimension_numbers(x)
    per = lambda d, sub: jax.tree.map(lambda _: "adam" if d is None else "muon", sub)
    return jax.tree.map(per, tree, params, is_leaf=is_spec)

  return labels


def _muon_dims(dims_arg) -> Callable:
  """``updates -> dimension numbers`` of the Muon partition (whose other leaves are
  :class:`optax.MaskedNode`)."""

  def dims(updates):
    tree = dims_arg(updates) if callable(dims_arg) else dims_arg
    if tree is None or is_dimension_numbers(tree):
      spec = tree or MuonDimensionNumbers()
      return jax.tree.map(lambda _: spec, updates)
    masked = lambda x: isinstance(x, optax.MaskedNode)
    is_spec = lambda x: x is None or is_dimension_numbers(x) or masked(x)
    fill = lambda d, sub: jax.tree.map(lambda x: x if masked(x) else d, sub, is_leaf=masked)
    return jax.tree.map(fill, tree, updates, is_leaf=is_spec)

  return dims


def muon(learning_rate: optax.ScalarOrSchedule, ns_coeffs: Any = PRESETS["standard"],
         ns_steps: int = 5, beta: jax.typing.ArrayLike = 0.95,
         eps: jax.typing.ArrayLike = 1e-8, weight_decay: jax.typing.ArrayLike = 0.0,
         weight_decay_mask: Any = None, mu_dtype: Any | None = None, *,
         nesterov: bool = True, adaptive: bool = False, preconditioning: str = "frobenius",
         adam_b1: jax.typing.ArrayLike = 0.9, adam_b2: jax.typing.ArrayLike = 0.999,
         adam_eps_root: jax.typing.ArrayLike = 0.0,
         adam_weight_decay: jax.typing.ArrayLike = 0.0,
         adam_learning_rate: optax.ScalarOrSchedule | None = None,
         muon_weight_dimension_numbers: Any = None,
         consistent_rms: jax.typing.ArrayLike | None = None, ns_dtype: Any | None = None,
         ns_axes: Any = "auto", backend: str = "auto",
         executor_options: ExecutorOptions | None = None
         ) -> optax.GradientTransformation:
  r"""Muon (Jordan et al., 2024): the numbers of :func:`optax.contrib.muon`, with the
  Newton–Schulz chains batched across the leaves of one matrix shape and AdamW as
  :func:`optirs_jax.adamw`.

  Matrices (2-D leaves, or those ``muon_weight_dimension_numbers`` names) take

  .. math::
    u = -\eta\,\big(s\,\mathrm{NS}(\hat m) + \lambda p\big),\qquad
    s = \sqrt{\max(1, \mathrm{fan_{out}} / \mathrm{fan_{in}})}
    \ \ (\text{or } \sqrt{\max(\mathrm{fan_{in}}, \mathrm{fan_{out}})}\cdot
    \texttt{consistent\_rms})

  with :math:`\hat m` and :math:`\mathrm{NS}` as in :func:`scale_by_muon`; every other
  leaf takes AdamW with ``adam_*`` (and ``eps``, ``mu_dtype``, ``nesterov``). The state is
  optax's: a ``partition`` of the two, so it reads and checkpoints as optax's does.

  Args:
    learning_rate: a number or a schedule.
    ns_coeffs: ``(c0, c1, c2)``, a tuple of such rows (one per step), or a preset name
      (``"standard"``, ``"dion"``).
    ns_steps: Newton–Schulz steps (an int; a tuple of rows runs one step per row). Under
      :func:`optax.inject_hyperparams` the traced count it passes runs as optax's does.
    beta: the momentum's decay.
    eps: added to the norm the momentum is divided by (and Adam's ``eps``).
    weight_decay: decoupled decay of the matrices, times the learning rate.
    weight_decay_mask: where it applies (a tree of bools, a prefix, or a callable).
    mu_dtype: the momentum's dtype (both partitions); ``None``: the updates'.
    nesterov: Nesterov momentum (both partitions).
    adaptive: scale each update by the dual norm :math:`\langle \hat m, \mathrm{NS}(\hat
      m)\rangle` (Bernstein et al., 2024).
    preconditioning: ``"frobenius"``, ``"spectral"``, ``"aol"`` or ``"schatten"``.
    adam_b1, adam_b2, adam_eps_root, adam_weight_decay: AdamW's, for the other leaves.
    adam_learning_rate: AdamW's learning rate (``None``: ``learning_rate``).
    muon_weight_dimension_numbers: a tree of :class:`MuonDimensionNumbers` (``None``
      entries go to AdamW), a callable of the params giving one, or ``None``: every 2-D
      leaf, as a matrix.
    consistent_rms: ``None`` for width scaling, or the target RMS of the update.
    ns_dtype: the Newton–Schulz products' dtype: ``None`` computes in the momentum's
      dtype, as optax (the same numbers); ``jnp.bfloat16`` is the usual fast choice
      (optax's numbers within 0.1 relative error per leaf; a matrix 16 times as long as
      wide, an embedding, runs on its Gram matrix with its small side at about float32's
      precision, within about 0.01: :func:`~optirs_jax.orthogonal.orthogonalize_stack`);
      ``jnp.float16`` within about 0.01, its stacks divided by their norm in float32
      first (float16's range), except under AOL and Schatten-4 preconditioning.
    ns_axes: on a mesh of several devices (``jax.set_mesh``'s, or the params' Explicit
      one), the axes the stacked matrices are spread over, whole, so that each device
      orthogonalizes whole matrices and the iteration holds no collective: ``"auto"``
      (every axis not manual), names, or ``None`` (leave the stacks as GSPMD places them).
    backend: the AdamW partition's (:func:`optirs_jax.adamw`) and where the matrices'
      momentum and stacks are written (:func:`scale_by_muon`).
    executor_options: the AdamW partition's.

  Returns:
    An :class:`optax.GradientTransformation`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optirs_jax
    >>> params = {"w": jnp.ones((4, 8)), "b": jnp.zeros(8)}
    >>> opt = optirs_jax.muon(0.02)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = opt.update(grads, opt.init(params), params)
    >>> round(float(jnp.linalg.norm(updates["w"])), 3) <= 0.02 * 2 * 1.5
    True

  References:
    Jordan et al., `Muon: An optimizer for hidden layers in neural networks
    <https://kellerjordan.github.io/posts/muon/>`_, 2024; Liu et al., `Muon is Scalable
    for LLM Training <https://arxiv.org/abs/2502.16982>`_, 2025.
  """
  from optirs_jax.transforms.adam import adamw  # the registry imports this package's face

  fn = "muon"
  check_number_or_schedule(fn, "learning_rate", learning_rate)
  check_number(fn, "weight_decay", weight_decay)
  if consistent_rms is not None:
    check_number(fn, "consistent_rms", consistent_rms)
  if adam_learning_rate is None:
    adam_learning_rate = learning_rate
  _check_choices(fn, preconditioning, ns_coeffs)
  labels = _labels(muon_weight_dimension_numbers)
  dims = _muon_dims(muon_weight_dimension_numbers)
  return optax.partition(
      transforms={
          "muon": optax.chain(
              scale_by_muon(ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov,
                            adaptive=adaptive, preconditioning=preconditioning,
                            weight_dimension_numbers=dims, ns_dtype=ns_dtype,
                            ns_axes=ns_axes, backend=backend),
              _scale_by_shape(dims, consistent_rms),
              optax.add_decayed_weights(weight_decay, weight_decay_mask),
              optax.scale_by_learning_rate(learning_rate)),
          "adam": adamw(adam_learning_rate, b1=adam_b1, b2=adam_b2, eps=eps,
                        eps_root=adam_eps_root, weight_decay=adam_weight_decay,
                        mu_dtype=mu_dtype, nesterov=nesterov, backend=backend,
                        executor_options=executor_options),
      },
      param_labels=labels)

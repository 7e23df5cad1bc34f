"""Gradient compression with error feedback: top-k (Deep Gradient Compression) and PowerSGD.

Both are optax transformations to put first in a chain, inside ``shard_map`` over the data
axis, in place of :func:`~optirs_jax.multi_device.sync_gradients`: each device compresses
its gradient plus what it has not yet sent, the devices exchange the compressed form with
JAX collectives, and every device gets the same (mean) update. What each device keeps
back (the residual, PowerSGD's error) varies per device; those leaves carry a leading axis
of length 1 on each device, so that the state can be initialized and carried inside the
``shard_map`` with ``P(axis)`` for them (:func:`state_partition_specs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optirs_jax.multi_device._sync import axis_names, check_per_device
from optirs_jax.pallas.sharding import varying_axes


def vary_like(x, like):
  """``x`` varying over every mesh axis ``like`` varies over (inside ``shard_map``); what is
  not an array (a MaskedNode) as it is."""
  if not isinstance(x, jax.Array):
    return x
  missing = tuple(sorted(varying_axes(like) - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x

STAGES = 4  # exponential warm-up stages of top-k's density (DGC: 75%, 93.75%, 98.4%, 99.6%)


class TopKState(NamedTuple):
  """State of :func:`top_k_compression`."""

  count: jax.Array  # int32 steps taken
  velocity: Any  # momentum-corrected velocity u (this device's), or None without momentum
  residual: Any  # accumulated, not yet sent values v (this device's)
  bytes_sent: jax.Array  # float32: payload this device sent in the last step
  dense_bytes: jax.Array  # float32: what a dense all-reduce of the gradients would send


class PowerSGDState(NamedTuple):
  """State of :func:`powersgd`."""

  count: jax.Array  # int32 steps taken
  q: Any  # per compressed leaf its (m, rank) factor, replicated; empty for the others
  error: Any  # per compressed leaf this device's error feedback; empty for the others
  bytes_sent: jax.Array  # float32: payload this device sent in the last step
  dense_bytes: jax.Array  # float32: what a dense all-reduce of the gradients would send


def _check_ratio(ratio) -> None:
  if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
    raise ValueError(f"top_k_compression: ratio={ratio!r} must be in (0, 1]")


def densities(ratio: float, warmup_steps: int) -> tuple[float, ...]:
  """The density of each warm-up stage: ``ratio**(1/4)``, ``ratio**(2/4)``, ... ``ratio``."""
  if warmup_steps == 0:
    return (ratio,)
  return tuple(ratio ** ((i + 1) / STAGES) for i in range(STAGES))


def top_k_compression(ratio: float, *, axis_name: str | Sequence[str], momentum: float = 0.9,
                      warmup_steps: int = 0) -> optax.GradientTransformationExtraArgs:
  r"""Deep Gradient Compression: send the largest ``ratio`` of entries, keep the rest.

  Per leaf and device, with momentum correction (:math:`m` = ``momentum``):

  .. math::
    u \leftarrow m u + g, \qquad v \leftarrow v + u, \qquad
    s = \mathrm{top}_k(|v|) \text{ entries of } v, \qquad v \leftarrow v - s, \qquad
    u \leftarrow u \odot [s = 0]

  and the update is the mean over the devices of :math:`s`, exchanged as
  :math:`k = \lceil \text{density} \cdot \text{size} \rceil` values and int32 indices each
  (an ``all_gather``). With ``momentum=0``, :math:`s + v_{new} = v_{old} + g` exactly. The
  density warms up exponentially: ``ratio**(1/4)``, ``ratio**(1/2)``, ``ratio**(3/4)``
  over ``warmup_steps`` in four stages, then ``ratio``. Use it with a momentum-free
  optimizer after it (the momentum lives here, as in the paper).

  Args:
    ratio: the fraction of entries sent after the warm-up, in (0, 1].
    axis_name: the data-parallel mesh axis (or axes) of the surrounding ``shard_map``.
    momentum: the momentum correction's decay (0 for plain error feedback).
    warmup_steps: the steps of the warm-up (0: none).

  References:
    Lin et al., `Deep Gradient Compression <https://arxiv.org/abs/1712.01887>`_, 2018.
  """
  _check_ratio(ratio)
  if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
    raise ValueError(f"top_k_compression: warmup_steps={warmup_steps!r} must be an int >= 0")
  if not 0 <= momentum < 1:
    raise ValueError(f"top_k_compression: momentum={momentum!r} must be in [0, 1)")
  stages = densities(ratio, warmup_steps)

  def init_fn(params):
    zeros = jax.tree.map(lambda x: jnp.zeros((1, *jnp.shape(x)), jnp.asarray(x).dtype), params)
    return TopKState(jnp.zeros([], jnp.int32), zeros if momentum else None, zeros,
                     jnp.zeros([], jnp.float32), jnp.zeros([], jnp.float32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    names = axis_names("top_k_compression", axis_name)
    check_per_device("top_k_compression", updates, names)
    leaves, treedef = jax.tree.flatten(updates)
    v_old = [x[0] for x in treedef.flatten_up_to(state.residual)]
    u = ([x[0] for x in treedef.flatten_up_to(state.velocity)] if momentum
         else [None] * len(leaves))
    u = [momentum * ui + g if momentum else g for ui, g in zip(u, leaves)]
    v = [vo + ui for vo, ui in zip(v_old, u)]
    dense = float(sum(g.size * g.dtype.itemsize for g in leaves))

    def stage(density):
      def run(v, u):
        out, new_v, new_u, sent = [], [], [], 0.0
        for vi, ui in zip(v, u):
          k = max(1, math.ceil(density * vi.size))
          flat = vi.reshape(-1)
          _, idx = jax.lax.top_k(jnp.abs(flat), k)
          values = flat[idx]
          # Gathered, the same on every device ("invarying": typed replicated).
          all_values = jax.lax.all_gather(values, names, to="invarying").reshape(-1)
          all_idx = jax.lax.all_gather(idx, names, to="invarying").reshape(-1)
          n = all_values.size // k
          total = jnp.zeros(flat.shape, flat.dtype).at[all_idx].add(all_values)  # replicated
          out.append((total / n).reshape(vi.shape))
          new_v.append(flat.at[idx].set(0).reshape(vi.shape))
          new_u.append(ui.reshape(-1).at[idx].set(0).reshape(ui.shape))
          sent += k * (values.dtype.itemsize + 4)
        return out, new_v, new_u, jnp.float32(sent)
      return run

    step = state.count
    index = (jnp.minimum(step * STAGES // warmup_steps, STAGES - 1) if warmup_steps
             else jnp.int32(0))
    out, new_v, new_u, sent = jax.lax.switch(index, [stage(d) for d in stages], v, u)
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    lead = lambda xs: unflat([x[None] for x in xs])
    return unflat(out), TopKState(optax.safe_increment(step), lead(new_u) if momentum else None,
                                  lead(new_v), sent, jnp.float32(dense))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _matrix_shape(shape) -> tuple[int, int] | None:
  if len(shape) < 2:
    return None
  return shape[0], math.prod(shape[1:])


def _compressible(shape, rank: int) -> bool:
  mat = _matrix_shape(shape)
  return mat is not None and (mat[0] + mat[1]) * rank < mat[0] * mat[1]


def powersgd(rank: int = 1, *, axis_name: str | Sequence[str], start_step: int = 0,
             error_feedback: bool = True, warm_start: bool = True, seed: int = 0
             ) -> optax.GradientTransformationExtraArgs:
  r"""PowerSGD: a rank-``rank`` approximation of each matrix gradient, all-reduce friendly.

  Each leaf of two or more dimensions is viewed as an :math:`n \times m` matrix
  :math:`M = G + E` (gradient plus error feedback) and, with the previous step's
  :math:`Q` (warm start):

  .. math::
    P = \mathrm{mean}_d(M Q), \quad P \leftarrow \mathrm{orth}(P), \quad
    Q = \mathrm{mean}_d(M^\top P), \quad \hat M = P Q^\top, \quad E \leftarrow M - \hat M

  Each device sends :math:`(n + m) r` numbers instead of :math:`n m`. Vectors, scalars and
  matrices too small to gain are all-reduced as they are; before ``start_step`` every leaf
  is. The update is :math:`\hat M` (the same on every device).

  Args:
    rank: the approximation's rank (>= 1).
    axis_name: the data-parallel mesh axis (or axes) of the surrounding ``shard_map``.
    start_step: steps of plain all-reduce before compressing.
    error_feedback: keep :math:`E` (the paper's default).
    warm_start: reuse :math:`Q` from the last step (else a fresh random one each step).
    seed: the seed of the initial (and, without warm start, every) random :math:`Q`.

  References:
    Vogels et al., `PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    Optimization <https://arxiv.org/abs/1905.13727>`_, 2019.
  """
  if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
    raise ValueError(f"powersgd: rank={rank!r} must be an int >= 1")
  if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
    raise ValueError(f"powersgd: start_step={start_step!r} must be an int >= 0")

  def random_q(shape, i, count):
    _, m = _matrix_shape(shape)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), i), count)
    return jax.random.normal(key, (m, rank), jnp.float32)

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    # Leaves sent whole hold optax.MaskedNode() (no arrays): zero-size placeholders crash
    # XLA's CPU compiler in jax 0.11.2 inside shard_map.
    q = [random_q(x.shape, i, 0) if _compressible(x.shape, rank) else optax.MaskedNode()
         for i, x in enumerate(leaves)]
    e = [jnp.zeros((1, *x.shape), x.dtype) if _compressible(x.shape, rank) and error_feedback
         else optax.MaskedNode() for x in leaves]
    return PowerSGDState(jnp.zeros([], jnp.int32), jax.tree.unflatten(treedef, q),
                         jax.tree.unflatten(treedef, e), jnp.zeros([], jnp.float32),
                         jnp.zeros([], jnp.float32))

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    names = axis_names("powersgd", axis_name)
    check_per_device("powersgd", updates, names)
    leaves, treedef = jax.tree.flatten(updates)
    qs, es = treedef.flatten_up_to(state.q), treedef.flatten_up_to(state.error)
    # Each error varies as its gradient does in both branches of the cond below (the
    # compressed one derives it from the gradient), whatever the state's own type says.
    es = [vary_like(e, g) for e, g in zip(es, leaves)]
    dense = float(sum(g.size * g.dtype.itemsize for g in leaves))
    pmean = lambda x: jax.lax.pmean(x, names)

    def plain(leaves, qs, es):
      return [pmean(g) for g in leaves], list(qs), list(es), jnp.float32(dense)

    def compressed(leaves, qs, es):
      out, new_q, new_e, sent = [], [], [], 0.0
      for i, (g, q, e) in enumerate(zip(leaves, qs, es)):
        if not _compressible(g.shape, rank):
          out.append(pmean(g)), new_q.append(q), new_e.append(e)
          sent += g.size * g.dtype.itemsize
          continue
        n, m = _matrix_shape(g.shape)
        mat = g.reshape(n, m).astype(jnp.float32)
        if error_feedback:
          mat = mat + e[0].reshape(n, m).astype(jnp.float32)
        q = q if warm_start else random_q(g.shape, i, state.count)
        p, _ = jnp.linalg.qr(pmean(mat @ q))
        q = pmean(mat.T @ p)
        approx = p @ q.T
        out.append(approx.reshape(g.shape).astype(g.dtype))
        new_q.append(q)
        new_e.append((mat - approx).reshape(e.shape).astype(e.dtype) if error_feedback else e)
        sent += 4 * (n + m) * rank  # P and Q, in float32
      return out, new_q, new_e, jnp.float32(sent)

    out, q, e, sent = jax.lax.cond(state.count >= start_step, compressed, plain,
                                   leaves, qs, es)
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    return unflat(out), PowerSGDState(optax.safe_increment(state.count), unflat(q), unflat(e),
                                      sent, jnp.float32(dense))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _compression_states(state) -> list:
  kinds = (TopKState, PowerSGDState)
  return [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kinds))
          if isinstance(s, kinds)]


def compression_stats(state) -> dict[str, jax.Array]:
  """Bytes one device sent in the last step, what a dense all-reduce of the same gradients
  would have sent, and their ratio; from the sizes of the buffers actually exchanged
  (``state``: a compressor's, or a chain's holding one or more)."""
  found = _compression_states(state)
  if not found:
    raise ValueError("compression_stats: the state holds no top_k_compression or powersgd "
                     "state")
  sent = sum(s.bytes_sent for s in found)
  dense = sum(s.dense_bytes for s in found)
  return {"bytes_sent": sent, "dense_bytes": dense,
          "compression_ratio": dense / jnp.maximum(sent, 1.0)}


def state_partition_specs(state, axis_name):
  """``PartitionSpec``s for a state inside ``shard_map``: a compressor's per-device leaves
  (residuals, velocities, errors: each with a leading axis of length 1 on its device)
  stacked along ``axis_name``, everything else replicated.

  Use them as the state's ``out_specs`` (and ``in_specs``) of the ``shard_map`` that
  initializes and updates it.
  """
  from jax.sharding import PartitionSpec as P

  def specs(node):
    if isinstance(node, TopKState):
      per_device = lambda t: jax.tree.map(lambda x: P(axis_name), t)
      return TopKState(P(), per_device(node.velocity), per_device(node.residual), P(), P())
    if isinstance(node, PowerSGDState):
      return PowerSGDState(P(), jax.tree.map(lambda x: P(), node.q),
                           jax.tree.map(lambda x: P(axis_name), node.error), P(), P())
    return jax.tree.map(lambda x: P(), node)

  kinds = (TopKState, PowerSGDState)
  return jax.tree.map(specs, state, is_leaf=lambda x: isinstance(x, kinds))

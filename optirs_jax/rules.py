"""The elementwise update rule of each optimizer, written once in plain jnp.

Every rule maps one leaf's arrays to new arrays and is called by both executors:
the reference maps it over the pytree with the hyper-parameters optax itself would
use (Python floats stay Python floats, so XLA sees optax's exact expressions), and
the Pallas kernels call the same function on each block with the hyper-parameters
read from one traced ``f32`` vector.

A rule's signature is ``rule(h, g, [p,] *state) -> (u, *new_state)`` where ``h`` is a
:class:`Hyper` holding the scalars named in the rule's ``HYPER`` tuple. The order of
operations follows optax 0.2.8 exactly (``scale_by_adam``, ``add_decayed_weights``,
``scale_by_learning_rate``, ``trace``, ``scale_by_rms``, ``scale_by_stddev``,
``scale_by_rss``), which is what makes float32 results bit-identical on the reference.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


class Hyper(dict):
  """Scalar hyper-parameters of one step, readable as attributes (``h.b1``)."""

  def __getattr__(self, name: str) -> Any:
    try:
      return self[name]
    except KeyError:
      raise AttributeError(name) from None


def abs_sq(x: jax.Array) -> jax.Array:
  """``|x|^2`` for real or complex ``x`` (optax's ``numerics.abs_sq``)."""
  return (x.conj() * x).real


def _sq(g: jax.Array) -> jax.Array:
  # optax.tree.update_moment_per_elem_norm with order=2.
  return g**2 if jnp.isrealobj(g) else abs_sq(g)


def _ema(decay, one_minus_decay, x, t):
  # optax.tree.update_moment: (1 - decay) * x + decay * t.
  return one_minus_decay * x + decay * t


def _debias(t, bias_correction):
  # optax.tree.bias_correction: divide in the moment's own precision.
  return t / bias_correction.astype(t.dtype)


def _scale_lr(h: Hyper, u: jax.Array, cast_lr: bool) -> jax.Array:
  # optax.scale (constant) or optax.scale_by_schedule (cast to the update dtype).
  neg_lr = jnp.asarray(h.neg_lr, dtype=u.dtype) if cast_lr else h.neg_lr
  return neg_lr * u


def _cast(x: jax.Array, dtype) -> jax.Array:
  return x if dtype is None else x.astype(dtype)


# ----------------------------------------------------------------------------- Adam / AdamW / LAMB

ADAM_HYPER = ("b1", "c1", "b2", "c2", "eps", "eps_root", "bc1", "bc1_next", "bc2", "wd", "neg_lr")


def adam_rule(h: Hyper, g, mu, nu, p=None, *, nesterov: bool, decay: bool, scale_lr: bool,
              cast_lr: bool, mu_dtype=None):
  r"""Adam moments and direction, optional decoupled decay, optional learning rate.

  .. math::
    m \leftarrow (1-\beta_1) g + \beta_1 m,\quad v \leftarrow (1-\beta_2)|g|^2 + \beta_2 v,\quad
    u = \frac{\hat m}{\sqrt{\hat v + \bar\epsilon} + \epsilon} + \lambda p

  Returns ``(u, mu, nu)``; ``u`` is multiplied by ``-lr`` when ``scale_lr``.
  """
  new_mu = _ema(h.b1, h.c1, g, mu)
  new_nu = _ema(h.b2, h.c2, _sq(g), nu)
  if nesterov:
    mu_hat = h.b1 * _debias(new_mu, h.bc1_next) + h.c1 * _debias(g, h.bc1)
  else:
    mu_hat = _debias(new_mu, h.bc1)
  nu_hat = _debias(new_nu, h.bc2)
  u = mu_hat / (jnp.sqrt(nu_hat + h.eps_root) + h.eps)
  if decay:
    u = u + h.wd * p
  if scale_lr:
    u = _scale_lr(h, u, cast_lr)
  return u, _cast(new_mu, mu_dtype), new_nu.astype(nu.dtype)


def lamb_trust_scale(u, p, p_norm, u_norm, h: Hyper, cast_lr: bool):
  """LAMB's second pass on one leaf: ``-lr * u * ||p|| / ||u||`` (1 where a norm is 0).

  The norms come from the executor (``jnp.linalg.norm`` on the reference, per-block
  partial sums reduced inside the kernel pass on Pallas); the arithmetic here is
  optax's ``scale_by_trust_ratio`` followed by ``scale_by_learning_rate``.
  """
  p_norm = p_norm.astype(p.dtype)
  u_norm = u_norm.astype(p.dtype)
  trust_ratio = 1.0 * p_norm / (u_norm + 0.0)
  zero_norm = jnp.logical_or(p_norm == 0.0, u_norm == 0.0)
  safe_ratio = jnp.where(zero_norm, jnp.array(1.0, dtype=p.dtype), trust_ratio)
  return _scale_lr(h, u * safe_ratio, cast_lr)


# ----------------------------------------------------------------------------- SGD

SGD_HYPER = ("momentum", "neg_lr")


def sgd_rule(h: Hyper, g, *trace, nesterov: bool, cast_lr: bool, accumulator_dtype=None):
  r"""SGD with optional (Nesterov) momentum: :math:`t \leftarrow g + \mu t`, :math:`u = -\eta t`.

  Without a momentum buffer (``trace == ()``) the rule is plain ``-lr * g``.
  """
  if not trace:
    return (_scale_lr(h, g, cast_lr),)
  (t,) = trace
  new_t = g + h.momentum * t
  u = g + h.momentum * new_t if nesterov else new_t
  return _scale_lr(h, u, cast_lr), _cast(new_t, accumulator_dtype)


# ----------------------------------------------------------------------------- RMSprop

RMSPROP_HYPER = ("decay", "c_decay", "eps", "bc", "momentum", "neg_lr")


def rmsprop_rule(h: Hyper, g, nu, *rest, centered: bool, eps_in_sqrt: bool,
                 bias_correction: bool, momentum: bool, nesterov: bool, cast_lr: bool):
  r"""RMSprop, plain or centered, with optional bias correction and momentum after the lr.

  .. math::
    v \leftarrow (1-\rho)|g|^2 + \rho v,\quad u = -\eta\, g / \sqrt{\hat v - |\hat m|^2 + \epsilon}

  ``rest`` is ``(mu,)`` when centered, then ``(trace,)`` when momentum is on.
  Returns ``(u, nu[, mu][, trace])``.
  """
  rest = list(rest)
  mu = rest.pop(0) if centered else None
  trace = rest.pop(0) if momentum else None
  new_nu = _ema(h.decay, h.c_decay, _sq(g), nu)
  new_mu = _ema(h.decay, h.c_decay, g, mu) if centered else None
  nu_hat = _debias(new_nu, h.bc) if bias_correction else new_nu
  mu_hat = (_debias(new_mu, h.bc) if bias_correction else new_mu) if centered else None
  var = nu_hat - abs_sq(mu_hat) if centered else nu_hat
  if eps_in_sqrt:
    scaling = jax.lax.rsqrt(var + h.eps)
  else:
    scaling = 1 / (jnp.sqrt(var) + h.eps)
  u = _scale_lr(h, scaling * g, cast_lr)
  out = [new_nu] + ([new_mu] if centered else [])
  if momentum:
    new_t = u + h.momentum * trace
    u = u + h.momentum * new_t if nesterov else new_t
    out.append(new_t)
  return (u, *out)


# ----------------------------------------------------------------------------- Adagrad

ADAGRAD_HYPER = ("eps", "neg_lr")


def adagrad_rule(h: Hyper, g, s, *, cast_lr: bool):
  r"""Adagrad: :math:`s \leftarrow s + |g|^2`, :math:`u = -\eta\, g / \sqrt{s + \epsilon}` (0 where s = 0)."""
  new_s = abs_sq(g) + s
  inv = jnp.where(new_s > 0, jax.lax.rsqrt(new_s + h.eps), 0.0)
  return _scale_lr(h, inv * g, cast_lr), new_s


# ----------------------------------------------------------------------------- fused apply

def applying(rule, p_index: int | None = None):
  """Turns ``rule(h, *args) -> (u, *state)`` into a rule returning ``(p + u, *state)``.

  The new params are written in the same pass as the state, in the params' dtype, exactly as
  ``optax.apply_updates`` would compute them. ``p`` is ``args[p_index]`` when the rule takes
  the params itself, else one more argument after the rule's own.
  """

  def apply_rule(h: Hyper, *args):
    if p_index is None:
      *args, p = args
    else:
      p = args[p_index]
    u, *rest = rule(h, *args)
    return ((p + u).astype(p.dtype), *rest)

  return apply_rule

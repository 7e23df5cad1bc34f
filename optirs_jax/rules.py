"""The elementwise update rule of each optimizer, written once in plain jnp.

Every rule maps one leaf's arrays to new arrays and is called by both executors: the
reference maps it over the pytree with the hyper-parameters optax itself would use (Python
floats stay Python floats, so XLA sees optax's exact expressions), and the Pallas kernels
call the same function on each block with the hyper-parameters read from one traced ``f32``
vector.

A rule's signature is ``rule(h, g, *, p, <state fields>, cast_lr, <static options>) ->
(u, *new state fields)``: ``h`` holds the scalars its spec names (``h.b1``), ``p`` is the
leaf's params or ``None`` where they are not read, and ``cast_lr`` says whether the
learning rate came from a schedule (optax then casts it to the update's dtype). The order
of operations follows optax 0.2.8 exactly (``scale_by_adam``, ``add_decayed_weights``,
``scale_by_learning_rate``, ``trace``, ``scale_by_rms``, ``scale_by_stddev``,
``scale_by_rss``, ``scale_by_lion``), which is what makes float32 results bit-identical on
the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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


def scale_lr(h, u: jax.Array, cast_lr: bool) -> jax.Array:
  """``-lr * u``: optax.scale (constant) or optax.scale_by_schedule (cast to u's dtype)."""
  neg_lr = jnp.asarray(h.neg_lr, dtype=u.dtype) if cast_lr else h.neg_lr
  return neg_lr * u


def _cast(x: jax.Array, dtype) -> jax.Array:
  return x if dtype is None else x.astype(dtype)


def adam_rule(h, g, *, p, mu, nu, nesterov: bool, decay: bool, scale: bool, cast_lr: bool,
              mu_dtype=None):
  r"""Adam moments and direction, optional decoupled decay, optional learning rate.

  .. math::
    m \leftarrow (1-\beta_1) g + \beta_1 m,\quad v \leftarrow (1-\beta_2)|g|^2 + \beta_2 v,\quad
    u = \frac{\hat m}{\sqrt{\hat v + \bar\epsilon} + \epsilon} + \lambda p

  Returns ``(u, mu, nu)``; ``u`` is multiplied by ``-lr`` when ``scale`` (LAMB scales
  after its trust ratio instead).
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
  if scale:
    u = scale_lr(h, u, cast_lr)
  return u, _cast(new_mu, mu_dtype), new_nu.astype(nu.dtype)


def lamb_trust_ratio(h, u, p, p_norm, u_norm, *, cast_lr: bool):
  """LAMB's second pass on one leaf: ``-lr * u * ||p|| / ||u||`` (1 where a norm is 0).

  The norms come from the executor (``jnp.linalg.norm`` on the reference, per-block partial
  sums reduced on the device on Pallas); the arithmetic is optax's
  ``scale_by_trust_ratio`` followed by ``scale_by_learning_rate``.
  """
  # Each norm in its array's dtype, promoted as optax promotes them (params and updates of
  # different dtypes give an update of the wider one).
  with jax.numpy_dtype_promotion("standard"):
    p_norm = p_norm.astype(p.dtype)
    u_norm = u_norm.astype(u.dtype)
    trust_ratio = 1.0 * p_norm / (u_norm + 0.0)
    zero_norm = jnp.logical_or(p_norm == 0.0, u_norm == 0.0)
    safe_ratio = jnp.where(zero_norm, jnp.array(1.0, dtype=p.dtype), trust_ratio)
    return scale_lr(h, u * safe_ratio, cast_lr)


def sgd_rule(h, g, *, p, trace=None, nesterov: bool, cast_lr: bool, accumulator_dtype=None):
  r"""SGD with optional (Nesterov) momentum: :math:`t \leftarrow g + \mu t`, :math:`u = -\eta t`.

  Without a momentum buffer (``trace is None``) the rule is plain ``-lr * g``.
  """
  del p
  if trace is None:
    return (scale_lr(h, g, cast_lr),)
  new_t = g + h.momentum * trace
  u = g + h.momentum * new_t if nesterov else new_t
  return scale_lr(h, u, cast_lr), _cast(new_t, accumulator_dtype)


def rmsprop_rule(h, g, *, p, nu, mu=None, trace=None, eps_in_sqrt: bool, bias_correction: bool,
                 nesterov: bool, cast_lr: bool):
  r"""RMSprop, plain or centered (with ``mu``), with optional bias correction and momentum
  (with ``trace``) after the learning rate.

  .. math::
    v \leftarrow (1-\rho)|g|^2 + \rho v,\quad u = -\eta\, g / \sqrt{\hat v - |\hat m|^2 + \epsilon}

  Returns ``(u, nu[, mu][, trace])``.
  """
  del p
  new_nu = _ema(h.decay, h.c_decay, _sq(g), nu)
  nu_hat = _debias(new_nu, h.bc) if bias_correction else new_nu
  out = [new_nu]
  var = nu_hat
  if mu is not None:
    new_mu = _ema(h.decay, h.c_decay, g, mu)
    mu_hat = _debias(new_mu, h.bc) if bias_correction else new_mu
    var = nu_hat - abs_sq(mu_hat)
    out.append(new_mu)
  if eps_in_sqrt:
    scaling = jax.lax.rsqrt(var + h.eps)
  else:
    scaling = 1 / (jnp.sqrt(var) + h.eps)
  u = scale_lr(h, scaling * g, cast_lr)
  if trace is not None:
    new_t = u + h.momentum * trace
    u = u + h.momentum * new_t if nesterov else new_t
    out.append(new_t)
  return (u, *out)


def adagrad_rule(h, g, *, p, sum_of_squares, cast_lr: bool):
  r"""Adagrad: :math:`s \leftarrow s + |g|^2`, :math:`u = -\eta\, g / \sqrt{s + \epsilon}`
  (0 where s = 0)."""
  del p
  new_s = abs_sq(g) + sum_of_squares
  inv = jnp.where(new_s > 0, jax.lax.rsqrt(new_s + h.eps), 0.0)
  return scale_lr(h, inv * g, cast_lr), new_s


def lion_rule(h, g, *, p, mu, decay: bool, cast_lr: bool, mu_dtype=None):
  r"""Lion: the sign of an interpolation of the gradient and the momentum.

  .. math::
    u = -\eta\,(\mathrm{sign}((1-\beta_1) g + \beta_1 m) + \lambda p),\qquad
    m \leftarrow (1-\beta_2) g + \beta_2 m
  """
  u = jnp.sign(h.c1 * g + h.b1 * mu)
  new_mu = _cast(_ema(h.b2, h.c2, g, mu), mu_dtype)
  if decay:
    u = u + h.wd * p
  return scale_lr(h, u, cast_lr), new_mu

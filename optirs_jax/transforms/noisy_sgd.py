"""Noisy SGD: gradient descent on the gradient plus annealed Gaussian noise."""

from __future__ import annotations

import warnings
from typing import NamedTuple

import jax
import optax

from optirs_jax import rules
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.spec import OptimizerSpec
from optirs_jax.transforms._builder import ROUNDING, build
from optirs_jax.transforms._registry import Entry


class NoisySgdState(NamedTuple):
  """State of :func:`noisy_sgd`."""

  count: jax.Array  # shape=(), dtype=jnp.int32; the step, saturating (noise and schedule).
  rng_key: jax.Array  # the key the next step's noise is split from (a typed key array).


def noisy_sgd_rule(h, g, *, p, cast_lr: bool):
  """optax's ``scale_by_learning_rate`` of the noisy gradient (the builder adds the noise)."""
  del p
  return (rules.scale_lr(h, g, cast_lr),)


NOISY_SGD = OptimizerSpec(
    name="noisy_sgd",
    arguments=(("learning_rate", "schedule"), ("eta", "number"), ("gamma", "number"),
               ("key", "key")) + ROUNDING,
    state=NoisySgdState,
    fields=(),
    rule=noisy_sgd_rule,
    hyper=("neg_lr",),
    scalars=lambda o, count: {},
    noise=True,
)


def noisy_sgd(learning_rate: optax.ScalarOrSchedule, eta: jax.typing.ArrayLike = 0.01,
              gamma: jax.typing.ArrayLike = 0.55, key: jax.Array | int | None = None, *,
              seed: int | None = None, stochastic_rounding: bool = False,
              rounding_seed: int = 0, backend: str = "auto",
              executor_options: ExecutorOptions | None = None
              ) -> optax.GradientTransformationExtraArgs:
  r"""SGD on noisy gradients; the same numbers as :func:`optax.noisy_sgd`.

  .. math::
    \sigma_t = \sqrt{\eta / (t + 1)^\gamma},\qquad
    u_t = -\alpha_t\, (g_t + \sigma_t\, \xi_t),\quad \xi_t \sim \mathcal N(0, I)

  The noise is drawn as optax draws it (the state's key split in two each step, the second
  split into one key per leaf, ``jax.random.normal`` in each leaf's dtype), so a run equals
  optax's bit for bit on the reference. XLA draws it before the kernel: on the fused apply
  the noisy gradient is one more write and read than optax's step, where XLA fuses the
  draw, the scale and the apply into one pass. Links of a chain before it, loss scaling and
  master weights are not folded in (``optirs_jax.apply`` runs ``update`` +
  ``apply_updates`` there).

  Args:
    learning_rate: a number, a scalar array or a schedule ``count -> lr``.
    eta: the noise's initial variance.
    gamma: the variance decays as :math:`(1+t)^{-\gamma}`.
    key: a random key (``jax.random.key(seed)``) or an int seed of one; ``None``: 0, with
      optax's warning.
    seed: deprecated (optax's), use ``key``.
    stochastic_rounding, rounding_seed, backend, executor_options: as in
      :func:`~optirs_jax.adam`.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.noisy_sgd(0.1, eta=0.0, key=0)
    >>> params = {"w": jnp.array([1.0, 2.0])}
    >>> updates, state = tx.update({"w": jnp.array([0.5, -1.0])}, tx.init(params))
    >>> updates["w"], int(state.count)
    (Array([-0.05,  0.1 ], dtype=float32), 1)

  References:
    Neelakantan et al., `Adding Gradient Noise Improves Learning for Very Deep Networks
    <https://arxiv.org/abs/1511.06807>`_, 2015.
  """
  if seed is not None:
    warnings.warn('"seed" is deprecated (as in optax), use "key".', DeprecationWarning,
                  stacklevel=2)
    if key is not None:
      raise ValueError(f"optirs_jax.noisy_sgd: only one of seed={seed!r} and key={key!r} "
                       "can be given")
    key = seed
  if key is None:
    warnings.warn("optirs_jax.noisy_sgd: no key given, 0 is used (optax requires a key "
                  "from 0.2.7 on)", stacklevel=2)
    key = 0
  del seed
  return build(NOISY_SGD, locals())


ENTRIES = (
    Entry("noisy_sgd", noisy_sgd, NOISY_SGD, optax.noisy_sgd,
          cases=({"key": 0}, {"eta": 0.3, "gamma": 0.9, "key": 7}, {"eta": 0.0, "key": 1}),
          typical={"eta": 0.1, "key": 3}, moments=(("rng_key", 0, "rng_key"),),
          alias=({"learning_rate": 1e-3, "eta": 1e-4, "key": 0},),
          complex=False, bytes_per_param=12),
)

"""Gradient noise as optax's ``add_noise`` draws it, for specs with ``noise=True``
(``noisy_sgd``): the state's key, and the noisy gradients the rule then sees."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from optirs_jax.spec import NotFused
from optirs_jax.transforms._checks import is_random_key


def key_state(spec, options) -> dict:
  """``{"rng_key": key}`` for the state of a spec with noise (optax's canonical key: a
  typed key array, or ``jax.random.key`` of an int seed); ``{}`` for the others."""
  if not spec.noise:
    return {}
  key = options["key"]
  return {"rng_key": key if is_random_key(key) else jax.random.key(key)}


def carried(spec, state) -> dict:
  """The new state's ``rng_key`` (the one :func:`add` left in ``state``), or ``{}``."""
  return {"rng_key": state.rng_key} if spec.noise else {}


def add(fn: str, options, updates, state, finite, *, folded: bool):
  """``(updates + noise, state with the next key)``: Gaussian noise of standard deviation
  ``sqrt(eta / (count + 1) ** gamma)``, one key per leaf split from a fresh one (the old key
  kept where ``finite`` is False: a skipped step draws nothing). ``folded``: links, loss
  scaling or master weights were to be folded into the kernel, where they would come after
  the noise (before it in optax): :class:`NotFused`, and the callers fall back."""
  if folded:
    raise NotFused(f"{fn} draws its noise before the kernel: links, loss scaling and master "
                   "weights are not folded in")
  rng_key, sample_key = jax.random.split(state.rng_key)
  if finite is not None:
    rng_key = jax.random.wrap_key_data(jnp.where(finite, jax.random.key_data(rng_key),
                                                 jax.random.key_data(state.rng_key)),
                                       impl=jax.random.key_impl(rng_key))
  with jax.numpy_dtype_promotion("standard"):  # optax's arithmetic, whatever the mode
    std = jnp.sqrt(options["eta"] / optax.safe_increment(state.count) ** options["gamma"])
    noise = optax.tree.random_like(sample_key, updates, sampler=jax.random.normal)
    return optax.tree.add_scale(updates, std, noise), state._replace(rng_key=rng_key)

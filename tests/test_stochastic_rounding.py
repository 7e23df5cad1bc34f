"""Stochastic rounding: unbiased, deterministic for a seed, and it keeps tiny updates alive."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optirs_jax
from optirs_jax import mixed_precision as mp
from optirs_jax.rounding import stochastic_round

BF16_STEP_AT_1 = 2.0**-7


@pytest.mark.parametrize("value", [1.0 + 2.0**-10, -3.3e-3, 1234.5678, 1.0 + 0.5 * BF16_STEP_AT_1])
def test_the_mean_of_many_roundings_converges_to_the_value(value):
  n = 1 << 16
  x = jnp.full((n,), value, jnp.float32)
  y = stochastic_round(x, jnp.bfloat16, seed=3, count=jnp.int32(7), salt=1,
                       index=jnp.arange(n, dtype=jnp.uint32)).astype(jnp.float32)
  lo, hi = np.float32(jnp.asarray(value, jnp.bfloat16)), None
  neighbours = np.unique(np.asarray(y))
  assert len(neighbours) <= 2 and np.float32(value) >= neighbours.min() - 0 and (
      np.float32(value) <= neighbours.max())
  del lo, hi
  step = float(neighbours.max() - neighbours.min()) if len(neighbours) == 2 else 0.0
  # The mean of n Bernoulli choices between the neighbours: within 5 standard errors.
  assert abs(float(jnp.mean(y)) - np.float32(value)) <= 5 * step * 0.5 / np.sqrt(n) + 1e-12


def test_rounding_is_deterministic_per_seed_count_and_element():
  x = jnp.linspace(1.0, 1.01, 4096, dtype=jnp.float32)
  index = jnp.arange(4096, dtype=jnp.uint32)
  r = lambda seed, count, salt=0: stochastic_round(x, jnp.bfloat16, seed=seed,
                                                   count=jnp.int32(count), salt=salt, index=index)
  chex.assert_trees_all_equal(r(1, 5), r(1, 5))
  chex.assert_trees_all_equal(jax.jit(lambda: r(1, 5))(), r(1, 5))
  for other in (r(2, 5), r(1, 6), r(1, 5, salt=1)):
    assert bool(jnp.any(other != r(1, 5)))
  # Non-finite values and values already in bfloat16 pass through; float16 rounds to nearest.
  special = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 1.0], jnp.float32)
  out = stochastic_round(special, jnp.bfloat16, seed=0, count=jnp.int32(0), salt=0,
                         index=jnp.arange(4, dtype=jnp.uint32)).astype(jnp.float32)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(special))
  chex.assert_trees_all_equal(
      stochastic_round(x, jnp.float16, seed=0, count=0, salt=0, index=index),
      x.astype(jnp.float16))


@pytest.mark.parametrize("backend", ["jnp", "pallas"])
def test_tiny_updates_stall_to_nearest_and_add_up_stochastically(backend):
  """SGD with lr 1e-4 on bfloat16 params at 1.0: each update is 1/78 of a bfloat16 step.
  Rounded to nearest the params never move; rounded stochastically they follow the float32
  trajectory on average."""
  params = {"w": jnp.ones((64, 128), jnp.bfloat16)}
  grads = {"w": jnp.ones((64, 128), jnp.bfloat16)}
  steps = 200

  def run(stochastic):
    tx = optirs_jax.sgd(1e-4, stochastic_rounding=stochastic, rounding_seed=11, backend=backend)
    step = jax.jit(lambda p, s: optirs_jax.apply(tx, grads, s, p))
    p, s = params, tx.init(params)
    for _ in range(steps):
      p, s = step(p, s)
    return p["w"].astype(jnp.float32)

  nearest, stochastic = run(False), run(True)
  assert bool(jnp.all(nearest == 1.0))  # stalled
  target = 1.0 - steps * 1e-4
  assert abs(float(jnp.mean(stochastic)) - target) < 2e-4, float(jnp.mean(stochastic))
  chex.assert_trees_all_equal(run(True), stochastic)  # deterministic for the seed


def test_executors_round_alike():
  """The reference and the kernel compute in float32 and draw the same bits."""
  params = {"w": jnp.linspace(-1, 1, 3000, dtype=jnp.float32).astype(jnp.bfloat16)}
  grads = jax.tree.map(lambda x: jnp.cos(x * 7), params)
  out = {}
  for backend in ("jnp", "pallas"):
    tx = optirs_jax.adam(1e-3, mu_dtype=jnp.bfloat16, stochastic_rounding=True,
                         backend=backend)
    out[backend] = jax.jit(lambda p, s, tx=tx: optirs_jax.apply(tx, grads, s, p))(
        params, tx.init(params))
  chex.assert_trees_all_close(out["jnp"], out["pallas"], rtol=2**-7, atol=0)
  same = np.mean(np.asarray(out["jnp"][0]["w"] == out["pallas"][0]["w"]))
  assert same > 0.99, same


def test_master_weights_round_stochastically_on_request(standard_promotion):
  tx = mp.master_weights(optirs_jax.sgd(1e-4), stochastic_rounding=True, rounding_seed=5)
  params = {"w": jnp.ones((32, 128), jnp.bfloat16)}
  state = tx.init(params)
  g = {"w": jnp.ones((32, 128), jnp.bfloat16)}
  for _ in range(50):
    updates, state = jax.jit(tx.update)(g, state, params)
    params = optax.apply_updates(params, updates)
  master = state.master["w"]
  assert abs(float(jnp.mean(params["w"].astype(jnp.float32))) - float(jnp.mean(master))) < 3e-4
  assert bool(jnp.all(jnp.abs(params["w"].astype(jnp.float32) - master) <= BF16_STEP_AT_1))


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_seed(bad):
  with pytest.raises(ValueError, match="rounding_seed=.* must be a non-negative 32-bit int"):
    optirs_jax.adam(1e-3, stochastic_rounding=True, rounding_seed=bad)

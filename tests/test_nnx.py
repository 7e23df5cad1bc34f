"""Every state survives Flax NNX's ``nnx.Optimizer``: jitted steps through it give the params
and the state (same structure, same numbers) that the same steps give through ``tx.update``
and ``optax.apply_updates``."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

from tests.states import IDS, STATES

nnx = pytest.importorskip("flax.nnx", reason="flax is a test extra")


class _Mlp(nnx.Module):
  def __init__(self, dtype, rngs):
    self.hidden = nnx.Linear(16, 64, param_dtype=dtype, rngs=rngs)  # kernel: 1024, 8-bit
    self.out = nnx.Linear(64, 8, param_dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def _loss(model, x, y):
  return jnp.mean((model(x).astype(jnp.float32) - y) ** 2)


@pytest.mark.parametrize("factory, dtype", [s[1:] for s in STATES], ids=IDS)
def test_nnx_optimizer_steps_equal_the_optax_contract(factory, dtype, standard_promotion):
  model = _Mlp(dtype, nnx.Rngs(0))
  params = nnx.as_pure(nnx.state(model, nnx.Param))
  optimizer = nnx.Optimizer(model, factory(), wrt=nnx.Param)

  @nnx.jit
  def nnx_step(model, optimizer, x, y):
    grads = nnx.grad(_loss)(model, x, y)
    optimizer.update(model, grads)
    return nnx.as_pure(grads)

  tx = factory()
  state = tx.init(params)

  @jax.jit
  def contract_step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  keys = jax.random.split(jax.random.key(1), 4)
  for k in keys:
    x = jax.random.normal(k, (32, 16)).astype(dtype)
    y = jnp.sin(jnp.sum(x.astype(jnp.float32), axis=1, keepdims=True)) * jnp.ones((1, 8))
    grads = nnx_step(model, optimizer, x, y)
    params, state = contract_step(params, state, grads)
  # The same structure and numbers; XLA compiles the two programs apart (NNX's step holds
  # the gradient too), so a fused multiply-add may round a few ulps differently.
  ours = (nnx.as_pure(nnx.state(model, nnx.Param)), nnx.as_pure(optimizer.opt_state))
  chex.assert_trees_all_equal_structs(ours, (params, state))
  chex.assert_trees_all_close(ours, (params, state), rtol=1e-5, atol=1e-8)
  assert int(optimizer.step[...]) == len(keys)

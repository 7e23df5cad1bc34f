"""optirs_jax.flax: Flax NNX's Optimizer and linen's TrainState on the fused step, with the
stock classes' numbers and state layout."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optirs_jax

nnx = pytest.importorskip("flax.nnx", reason="flax is a test extra")
train_state = pytest.importorskip("flax.training.train_state", reason="flax is a test extra")
oflax = pytest.importorskip("optirs_jax.flax", reason="flax is a test extra")

TXS = {
    "adamw": lambda: optirs_jax.adamw(1e-2, weight_decay=0.1),
    "chain_clip_adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5),
                                            optirs_jax.adamw(1e-2)),
    "inject_lamb": lambda: optax.inject_hyperparams(optirs_jax.lamb)(
        learning_rate=optax.linear_schedule(1e-2, 1e-3, 10)),
    "adamw8bit": lambda: optirs_jax.adamw8bit(1e-2, min_8bit_size=512),
    "optax_adam": lambda: optax.adam(1e-2),  # no fused step: the stock update
}


class _Mlp(nnx.Module):
  def __init__(self, rngs, dtype=jnp.float32):
    self.hidden = nnx.Linear(16, 64, param_dtype=dtype, rngs=rngs)
    self.out = nnx.Linear(64, 4, param_dtype=dtype, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def _batches(n=3):
  for k in jax.random.split(jax.random.key(2), n):
    x = jax.random.normal(k, (32, 16))
    yield x, jnp.tanh(x[:, :4])


@pytest.mark.parametrize("name", list(TXS))
def test_nnx_optimizer_equals_the_stock_one(name, standard_promotion):
  models = [_Mlp(nnx.Rngs(0)) for _ in range(2)]
  optimizers = [cls(m, TXS[name](), wrt=nnx.Param)
                for cls, m in zip((nnx.Optimizer, oflax.Optimizer), models)]

  @nnx.jit
  def step(model, optimizer, x, y):
    grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    return optimizer.update(model, grads)

  for x, y in _batches():
    stock_updates = step(models[0], optimizers[0], x, y)
    ours_updates = step(models[1], optimizers[1], x, y)
  pure = lambda m, o: (nnx.as_pure(nnx.state(m, nnx.Param)), nnx.as_pure(o.opt_state))
  chex.assert_trees_all_equal_structs(pure(models[1], optimizers[1]),
                                      pure(models[0], optimizers[0]))
  chex.assert_trees_all_close(pure(models[1], optimizers[1]), pure(models[0], optimizers[0]),
                              rtol=1e-5, atol=1e-7)
  chex.assert_trees_all_close(ours_updates, stock_updates, rtol=1e-4, atol=1e-7)
  assert int(optimizers[1].step[...]) == 3


@pytest.mark.parametrize("name", list(TXS))
def test_train_state_equals_the_stock_one(name, standard_promotion):
  module = lambda p, x: jnp.tanh(x @ p["w"] + p["b"][None])
  params = {"w": jax.random.normal(jax.random.key(0), (16, 64)) * 0.3, "b": jnp.zeros(64)}
  states = [cls.create(apply_fn=module, params=params, tx=TXS[name]())
            for cls in (train_state.TrainState, oflax.TrainState)]

  @jax.jit
  def step(state, x, y):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn(p, x)[:, :4] - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  for x, y in _batches():
    states = [step(s, x, y) for s in states]
  stock, ours = states
  assert type(ours) is oflax.TrainState and int(ours.step) == 3
  chex.assert_trees_all_equal_structs((ours.params, ours.opt_state),
                                      (stock.params, stock.opt_state))
  chex.assert_trees_all_close((ours.params, ours.opt_state), (stock.params, stock.opt_state),
                              rtol=1e-5, atol=1e-7)


def test_train_state_overwrite_with_gradient_collection_as_the_stock_one():
  params = {"params": {"w": jnp.ones(3)}, "_overwrite_with_gradient": {"s": jnp.zeros(2)}}
  grads = {"params": {"w": jnp.full(3, 0.5)}, "_overwrite_with_gradient": {"s": jnp.ones(2)}}
  tx = optirs_jax.sgd(0.1)
  stock = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
  stock = stock.replace(opt_state=tx.init(params["params"]))
  ours = oflax.TrainState.create(apply_fn=None, params=params, tx=tx)
  ours = ours.replace(opt_state=tx.init(params["params"]))
  chex.assert_trees_all_close(ours.apply_gradients(grads=grads).params,
                              stock.apply_gradients(grads=grads).params)


def test_the_fused_step_is_what_runs_on_a_gpu():
  """For the cuda target, the stock TrainState's update path sends a large leaf to the
  reference (XLA fuses it with the add), ours runs the fused kernel on it: one Triton call
  writing the params in place."""
  from tests.test_lowering import cuda_triton_calls
  params = {"w": jnp.zeros((1024, 1024))}
  tx = optax.chain(optax.clip_by_global_norm(1.0), optirs_jax.adamw(1e-3))

  def step(cls):
    def run(p, s, g):
      state = cls(step=jnp.zeros([], jnp.int32), apply_fn=None, params=p, tx=tx, opt_state=s)
      new = state.apply_gradients(grads=g)
      return new.params, new.opt_state
    return run

  stock = cuda_triton_calls(step(train_state.TrainState), params, tx.init(params), params)
  ours = cuda_triton_calls(step(oflax.TrainState), params, tx.init(params), params)
  assert ours > stock, (ours, stock)

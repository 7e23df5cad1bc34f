"""optirs_jax transformations inside optax's combinators, schedules and jitted loops."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optirs_jax
from tests import cases

BACKENDS = ["jnp", "pallas"]


def _same_as_optax(make, params, grads, steps=3, tol=1e-6):
  ours, ref = make(optirs_jax), make(optax)
  s, rs = ours.init(params), ref.init(params)
  for _ in range(steps):
    u, s = jax.jit(ours.update)(grads, s, params)
    with jax.numpy_dtype_promotion("standard"):
      ru, rs = jax.jit(ref.update)(grads, rs, params)
    chex.assert_trees_all_close(u, ru, rtol=tol, atol=tol * 1e-3)
  return s


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_with_clip_by_global_norm(backend):
  make = lambda lib: optax.chain(
      optax.clip_by_global_norm(1.0),
      lib.lamb(1e-3, weight_decay=0.01, **({"backend": backend} if lib is optirs_jax else {})))
  _same_as_optax(make, cases.ragged_tree(0), cases.ragged_tree(1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_inject_hyperparams(backend):
  def make(lib):
    kw = {"backend": backend} if lib is optirs_jax else {}
    return optax.inject_hyperparams(lib.adamw, static_args=("backend",) if kw else ())(
        learning_rate=1e-2, weight_decay=0.1, **kw)

  params, grads = cases.ragged_tree(0), cases.ragged_tree(1)
  state = _same_as_optax(make, params, grads)
  # A new learning rate is a new value in the state, not a new program.
  tx = make(optirs_jax)
  update = jax.jit(tx.update)
  u1, _ = update(grads, state, params)
  state.hyperparams["learning_rate"] = jnp.asarray(5e-3, jnp.float32)
  u2, _ = update(grads, state, params)
  assert update._cache_size() == 1
  chex.assert_trees_all_close(u2, jax.tree.map(lambda x: 0.5 * x, u1), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_steps(backend, standard_promotion):
  make = lambda lib: optax.MultiSteps(
      lib.adam(1e-2, **({"backend": backend} if lib is optirs_jax else {})), every_k_schedule=3)
  _same_as_optax(make, cases.ragged_tree(0), cases.ragged_tree(1), steps=7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_apply_if_finite_skips_nan_steps_and_keeps_state(backend):
  opt = optax.apply_if_finite(optirs_jax.adam(1e-2, backend=backend), max_consecutive_errors=3)
  params = cases.ragged_tree(0)
  state = opt.init(params)
  good = cases.ragged_tree(1)
  bad = jax.tree.map(lambda x: x.at[...].set(jnp.nan) if x.ndim == 0 else x, good)
  _, state = jax.jit(opt.update)(good, state, params)
  u, state2 = jax.jit(opt.update)(bad, state, params)
  assert int(state2.notfinite_count) == 1
  chex.assert_trees_all_equal(state2.inner_state, state.inner_state)
  assert all(float(jnp.max(jnp.abs(x))) == 0.0 for x in jax.tree.leaves(u))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_gradients_propagate_like_optax(backend):
  params = {"a": jnp.ones(10), "b": jnp.ones(3)}
  grads = {"a": jnp.ones(10).at[3].set(jnp.nan), "b": jnp.full(3, jnp.inf)}
  for name in cases.NAMES:
    ours, ref = cases.pair(name, {}, backend)
    u, _ = jax.jit(ours.update)(grads, ours.init(params), params)
    with jax.numpy_dtype_promotion("standard"):
      ru, _ = jax.jit(ref.update)(grads, ref.init(params), params)
    for x, y in zip(jax.tree.leaves(u), jax.tree.leaves(ru)):
      np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
      np.testing.assert_array_equal(np.isinf(x), np.isinf(y))


# Every optimizer on the reference; the core ones on the kernels (the schedule's value is one
# of the builder's scalars, read alike by every kernel).
SCHEDULED = [(name, backend) for backend in BACKENDS for name in cases.NAMES
             if backend == "jnp" or name in cases.CORE]


@pytest.mark.parametrize("name, backend", SCHEDULED,
                         ids=[f"{n}-{b}" for n, b in SCHEDULED])
def test_schedule_does_not_recompile(name, backend, standard_promotion):
  if not cases.takes_schedule(name):
    pytest.skip(f"{name}'s learning rate is a number (its initial step size)")
  chex.clear_trace_counter()
  key = {"key": 0} if name in cases.NOISY else {}  # (without one: optax's warning)
  opt = getattr(optirs_jax, name)(optax.linear_schedule(1e-2, 1e-4, 10), backend=backend, **key)
  params = cases.ragged_tree(0)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state):
    updates, state = opt.update(jax.tree.map(jnp.cos, params), state, params)
    return optax.apply_updates(params, updates), state

  state = opt.init(params)
  for _ in range(5):
    params, state = step(params, state)
  assert step._cache_size() == 1
  assert int(state.count) == 5


def test_count_saturates_instead_of_overflowing():
  opt = optirs_jax.adam(1e-3)
  params = {"w": jnp.ones(4)}
  state = opt.init(params)._replace(count=jnp.asarray(np.iinfo(np.int32).max, jnp.int32))
  u, state = jax.jit(opt.update)(params, state, params)
  assert int(state.count) == np.iinfo(np.int32).max
  assert bool(jnp.all(jnp.isfinite(u["w"])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_donated_state_in_a_jitted_loop(backend):
  opt = optirs_jax.adamw(1e-3, backend=backend)
  ref = optax.adamw(1e-3)
  params = cases.ragged_tree(0)

  def make_step(o):
    def step(params, state):
      updates, state = o.update(jax.tree.map(jnp.sin, params), state, params)
      return optax.apply_updates(params, updates), state
    return jax.jit(step, donate_argnums=(0, 1))

  p, s = jax.tree.map(jnp.copy, params), opt.init(params)
  rp, rs = jax.tree.map(jnp.copy, params), ref.init(params)
  step, ref_step = make_step(opt), make_step(ref)
  for _ in range(5):
    p, s = step(p, s)
    with jax.numpy_dtype_promotion("standard"):
      rp, rs = ref_step(rp, rs)
  chex.assert_trees_all_close(p, rp, rtol=1e-6, atol=1e-8)


def test_state_is_a_pytree_of_arrays_and_round_trips():
  opt = optirs_jax.rmsprop(1e-3, centered=True, momentum=0.9)
  params = cases.ragged_tree(0)
  state = opt.init(params)
  leaves, treedef = jax.tree.flatten(state)
  assert all(isinstance(x, jax.Array) for x in leaves)
  again = jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
  u1, _ = opt.update(params, state, params)
  u2, _ = opt.update(params, jax.tree.map(jnp.asarray, again), params)
  chex.assert_trees_all_equal(u1, u2)


def test_sharded_params_on_fake_devices():
  """Params laid out over the test's several CPU devices update like unsharded ones."""
  devices = np.array(jax.devices()[:4])
  mesh = jax.sharding.Mesh(devices, ("d",))
  spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
  params = {"w": jax.device_put(jnp.linspace(-1.0, 1.0, 64), spec)}
  opt = optirs_jax.adam(1e-2)
  u, _ = jax.jit(opt.update)(params, opt.init(params), params)
  ru, _ = jax.jit(opt.update)({"w": jnp.linspace(-1.0, 1.0, 64)},
                              opt.init({"w": jnp.zeros(64)}), None)
  chex.assert_trees_all_close(u, ru, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inside_masked_and_multi_transform(backend, standard_promotion):
  """optax's MaskedNode placeholders and partitioned trees pass through unharmed."""
  kw = lambda lib: {"backend": backend} if lib is optirs_jax else {}
  masked = lambda lib: optax.masked(lib.adam(1e-2, **kw(lib)), {"w": True, "b": False})
  multi = lambda lib: optax.multi_transform(
      {"a": lib.adamw(1e-2, **kw(lib)), "s": lib.sgd(0.1, momentum=0.9, **kw(lib))},
      {"w": "a", "b": "s"})
  params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.arange(4.0)}
  grads = jax.tree.map(jnp.cos, params)
  for make in (masked, multi):
    _same_as_optax(make, params, grads)

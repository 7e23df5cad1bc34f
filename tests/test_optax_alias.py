"""optax's own common alias tests (``optax/_src/alias_test.py``), run on optirs_jax.

The optimizers and keyword arguments are optax's test list for the ones optirs_jax has;
each test is written as optax writes it: convergence on a parabola and Rosenbrock's
function without recompiling, extra keyword arguments to ``update``, ``inject_hyperparams``,
explicit state dtypes, update dtypes, dtype stability under ``lax.cond`` and
``optax.MultiSteps``. They run on the default backend (the reference on CPU, the kernels on
a GPU).
"""

import functools

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optirs_jax
from optirs_jax.transforms import REGISTRY

# optax's own list (alias_test.py's _OPTIMIZERS_UNDER_TEST), for the registry's optimizers.
UNDER_TEST = [(name, dict(kw)) for name, entry in REGISTRY.items() for kw in entry.alias]
NO_COMPLEX = tuple(name for name, entry in REGISTRY.items() if not entry.complex)
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, kw in UNDER_TEST]


def parabola(dtype):
  initial = jnp.array([-1.0, 10.0, 1.0], dtype=dtype)
  final = jnp.array([1.0, -1.0, 1.0], dtype=dtype)
  if jnp.iscomplexobj(initial):
    final *= 1 + 1j
  return initial, final, lambda p: jnp.sum(optirs_jax.rules.abs_sq(p - final))


def rosenbrock(dtype):
  a, b = 1.0, 100.0
  if jnp.issubdtype(dtype, jnp.complexfloating):
    a *= 1 + 1j
  initial = jnp.array([0.0, 0.0], dtype=dtype)
  final = jnp.array([a, a**2], dtype=dtype)
  sq = optirs_jax.rules.abs_sq
  return initial, final, lambda p: sq(a - p[0]) + b * sq(p[1] - p[0] ** 2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.complex64], ids=["f32", "c64"])
@pytest.mark.parametrize("target", [parabola, rosenbrock], ids=["parabola", "rosenbrock"])
@pytest.mark.parametrize("name, kw", UNDER_TEST, ids=IDS)
def test_optimization(name, kw, target, dtype, standard_promotion):
  if name in NO_COMPLEX and jnp.issubdtype(dtype, jnp.complexfloating):
    pytest.skip(f"{name} does not support complex parameters (as in optax)")
  if name in ("sign_sgd", "signum") and target is rosenbrock:  # optax's test skips these too
    pytest.skip(f"{name} needs a learning-rate schedule to solve Rosenbrock's function (as "
                "in optax's test)")
  opt = getattr(optirs_jax, name)(**kw)
  initial, final, objective = target(dtype)

  @jax.jit
  def step(params, state):
    updates = jax.tree.map(jnp.conj, jax.grad(objective)(params))
    updates, state = opt.update(updates, state, params)
    return optax.apply_updates(params, updates), state

  params, state = initial, opt.init(initial)
  state = optax.tree.map_params(opt, lambda v: v, state)  # tree_map_params works
  for _ in range(10_000):
    params, state = step(params, state)
  assert step._cache_size() == 1  # no recompilation on the second call
  if name in ("adadelta", "adafactor") and kw.get("learning_rate") is None:
    pytest.skip(f"{name} needs a learning rate to converge (optax's test checks only that it "
                "runs without recompiling, as here)")
  chex.assert_trees_all_close(params, final, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("name, kw", UNDER_TEST, ids=IDS)
def test_optimizers_accept_extra_args(name, kw):
  opt = getattr(optirs_jax, name)(**kw)
  initial, _, objective = rosenbrock(jnp.float32)

  @jax.jit
  def step(params, state):
    updates = jax.grad(objective)(params)
    updates, state = opt.update(updates, state, params,
                                unexpected_extra_args_your_optimizer_doesnt_expect=1)
    return optax.apply_updates(params, updates), state

  params, state = initial, opt.init(initial)
  for _ in range(2):
    params, state = step(params, state)
  assert int(state.count) == 2


@pytest.mark.parametrize("name, kw", UNDER_TEST, ids=IDS)
def test_optimizers_can_be_wrapped_in_inject_hyperparams(name, kw, standard_promotion):
  factory = getattr(optirs_jax, name)
  opt = factory(**kw)
  # Adafactor's factoring decides its state's shapes: static, as optax's test passes it.
  static = ("min_dim_size_to_factor",) if name == "adafactor" else ()
  injected = optax.inject_hyperparams(factory, static_args=static)(**kw)
  params = [jnp.negative(jnp.ones((2, 3))), jnp.ones((2, 5, 2))]
  grads = [jnp.ones((2, 3)), jnp.negative(jnp.ones((2, 5, 2)))]
  updates, new_state = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  updates_i, new_state_i = jax.jit(injected.update)(grads, jax.jit(injected.init)(params), params)
  chex.assert_trees_all_close(updates_i, updates, rtol=1e-3)
  chex.assert_trees_all_close(optax.tree.unwrap_random_key_data(new_state_i.inner_state),
                              optax.tree.unwrap_random_key_data(new_state), rtol=1e-4)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32", "complex64", None])
@pytest.mark.parametrize("params_dtype", ["bfloat16", "float32", "complex64", None])
@pytest.mark.parametrize("name", ["sgd_mom", "adam", "adamw", "lion"])
def test_explicit_dtype(name, params_dtype, state_dtype):
  if name == "sgd_mom":
    opt, field = optirs_jax.sgd(0.1, momentum=0.9, accumulator_dtype=state_dtype), "trace"
  else:
    opt, field = getattr(optirs_jax, name)(0.1, mu_dtype=state_dtype), "mu"
  params_dtype = jax.dtypes.canonicalize_dtype(params_dtype)
  state = opt.init(jnp.array([0.0, 0.0], dtype=params_dtype))
  expected = params_dtype if state_dtype is None else jax.dtypes.canonicalize_dtype(state_dtype)
  assert getattr(state, field).dtype == expected


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name, kw", UNDER_TEST, ids=IDS)
def test_preserve_dtype(name, kw, dtype):
  opt = getattr(optirs_jax, name)(**kw)
  params = jnp.array([1.0, 2.0], dtype=dtype)
  grads = jax.grad(lambda x: jnp.sum(x**2))(params)
  updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  assert updates.dtype == grads.dtype


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64,
                                   jnp.complex64, jnp.complex128],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("name, kw", UNDER_TEST, ids=IDS)
def test_state_shape_dtype_shard_stability(name, kw, dtype, standard_promotion):
  if name in NO_COMPLEX and jnp.issubdtype(dtype, jnp.complexfloating):
    pytest.skip(f"{name} does not support complex parameters (as in optax)")
  with jax.enable_x64(dtype in (jnp.float64, jnp.complex128)):
    opt = getattr(optirs_jax, name)(**kw)
    initial, _, objective = parabola(dtype)

    @jax.jit
    def step(params, state):
      updates = jax.tree.map(jnp.conj, jax.grad(objective)(params))
      # defeat compiler optimization, use lax.cond to check for stability
      cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
      updates, state = jax.lax.cond(cond, lambda: opt.update(updates, state, params),
                                    lambda: (params, state))
      return optax.apply_updates(params, updates), state

    params, state = initial, opt.init(initial)
    for _ in range(2):
      params, new_state = step(params, state)
      assert jax.tree.leaves(params)[0].dtype == dtype
      cond = jax.random.randint(jax.random.key(0), (), 0, 2) == 0
      state = jax.lax.cond(cond, functools.partial(lambda s: s, state),
                           functools.partial(lambda s: s, new_state))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name, kw", UNDER_TEST, ids=IDS)
def test_gradient_accumulation(name, kw, dtype, standard_promotion):
  opt = optax.MultiSteps(getattr(optirs_jax, name)(**kw), every_k_schedule=4)
  params = jnp.array([1.0, 2.0], dtype=dtype)
  grads = jax.grad(lambda x: jnp.sum(x**2))(params)
  updates, _ = jax.jit(opt.update)(grads, jax.jit(opt.init)(params), params)
  chex.assert_trees_all_equal(updates, jnp.zeros_like(grads))

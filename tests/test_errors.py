"""Bad input gets a clear error that names the bad value, and loses nothing."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optirs_jax

PARAMS = {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}


def test_unknown_backend_lists_the_valid_ones():
  with pytest.raises(ValueError, match=r"backend='cuda'.*\('auto', 'jnp', 'pallas'\)"):
    optirs_jax.adam(1e-3, backend="cuda")


def test_supported_and_available_backends():
  assert optirs_jax.SUPPORTED_BACKENDS == ("auto", "jnp", "pallas")
  assert set(optirs_jax.available_backends()) <= set(optirs_jax.SUPPORTED_BACKENDS)
  assert {"auto", "jnp"} <= set(optirs_jax.available_backends())


def test_unavailable_backend_names_what_is_available(monkeypatch):
  from optirs_jax import backends
  monkeypatch.setattr(backends, "_pallas_import_error", lambda: "ImportError: no pallas here")
  with pytest.raises(RuntimeError, match=r"backend='pallas' cannot run here.*\('auto', 'jnp'\)"):
    optirs_jax.sgd(0.1, backend="pallas")


@pytest.mark.parametrize("bad", ["0.1", None, [0.1]])
def test_learning_rate_must_be_a_number_or_schedule(bad):
  with pytest.raises(TypeError, match="learning_rate="):
    optirs_jax.adam(bad)


def test_hyperparameter_types_are_checked():
  with pytest.raises(TypeError, match=r"b1='0.9'"):
    optirs_jax.adam(1e-3, b1="0.9")
  with pytest.raises(ValueError, match="eps must be a scalar"):
    optirs_jax.adam(1e-3, eps=jnp.ones(3))
  with pytest.raises(TypeError, match="nesterov=1"):
    optirs_jax.sgd(0.1, momentum=0.9, nesterov=1)
  with pytest.raises(TypeError, match="mu_dtype=int32 must be a floating"):
    optirs_jax.adam(1e-3, mu_dtype=jnp.int32)
  with pytest.raises(TypeError, match="accumulator_dtype='nope'"):
    optirs_jax.sgd(0.1, momentum=0.9, accumulator_dtype="nope")
  with pytest.raises(ValueError, match="initial_accumulator_value=-1"):
    optirs_jax.adagrad(0.1, initial_accumulator_value=-1.0)


def test_negative_learning_rate_is_accepted_as_in_optax():
  """optax 0.2.8 takes a negative learning rate (gradient ascent); so does optirs_jax."""
  u, _ = optirs_jax.sgd(-0.5).update(PARAMS, optirs_jax.sgd(-0.5).init(PARAMS))
  ru, _ = optax.sgd(-0.5).update(PARAMS, optax.sgd(-0.5).init(PARAMS))
  np.testing.assert_array_equal(u["w"], ru["w"])


def test_grads_with_another_structure():
  opt = optirs_jax.adam(1e-3)
  state = opt.init(PARAMS)
  with pytest.raises(ValueError, match=r"the updates have no leaf \['b'\], which state.mu have"):
    opt.update({"w": jnp.ones((3, 4))}, state)
  with pytest.raises(ValueError, match="state.mu do not have the structure of the updates"):
    # The same key paths in another container: both structures shown.
    opt.update(collections.OrderedDict(b=jnp.zeros(4), w=jnp.ones((3, 4))), state)


def test_grads_with_another_shape_name_the_leaf():
  opt = optirs_jax.adamw(1e-3)
  state = opt.init(PARAMS)
  grads = {"w": jnp.ones((4, 3)), "b": jnp.zeros(4)}
  with pytest.raises(ValueError, match=r"state.mu leaf \['w'\] has shape \(3, 4\).*\(4, 3\)"):
    opt.update(grads, state, PARAMS)


def test_params_with_another_shape():
  opt = optirs_jax.lamb(1e-3)
  state = opt.init(PARAMS)
  with pytest.raises(ValueError, match=r"params leaf \['b'\] has shape \(5,\)"):
    opt.update(PARAMS, state, {"w": jnp.ones((3, 4)), "b": jnp.zeros(5)})


@pytest.mark.parametrize("name", ["adamw", "lamb"])
def test_missing_params(name):
  opt = getattr(optirs_jax, name)(1e-3)
  with pytest.raises(ValueError, match="params"):
    opt.update(PARAMS, opt.init(PARAMS))


def test_integer_params_are_rejected_with_the_leaf_and_valid_dtypes():
  with pytest.raises(TypeError, match=r"params leaf \['n'\] has dtype int32; valid dtypes"):
    optirs_jax.adam(1e-3).init({"n": jnp.arange(3)})


def test_unsupported_dtype_on_explicit_pallas_backend():
  opt = optirs_jax.adam(1e-3, backend="pallas")
  with jax.enable_x64(True):
    params = {"w": jnp.ones(3, jnp.float64)}
    with pytest.raises(TypeError, match=r"backend='pallas' cannot run leaf \['w'\] of dtype "
                                        r"float64; valid dtypes are \['bfloat16', 'float16', "
                                        r"'float32'\]"):
      opt.update(params, opt.init(params))


def test_bad_mask():
  opt = optirs_jax.adamw(1e-3, mask={"w": True})
  with pytest.raises(ValueError, match="mask must be a tree of bools"):
    opt.update(PARAMS, opt.init(PARAMS), PARAMS)
  opt = optirs_jax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: jnp.array(True), p))
  with pytest.raises(TypeError, match="mask leaves must be Python bools"):
    opt.update(PARAMS, opt.init(PARAMS), PARAMS)


def test_a_failed_step_leaves_donated_state_usable():
  opt = optirs_jax.adam(1e-3)
  state = opt.init(PARAMS)
  step = jax.jit(opt.update, donate_argnums=(1,))
  with pytest.raises(ValueError):
    step({"w": jnp.ones((3, 5)), "b": jnp.zeros(4)}, state, PARAMS)
  updates, new_state = step(PARAMS, state, PARAMS)  # the state was not consumed
  assert int(new_state.count) == 1 and updates["w"].shape == (3, 4)


def test_sgd_checks_params_against_the_updates_naming_the_leaf():
  opt = optirs_jax.sgd(0.1)
  with pytest.raises(ValueError, match=r"params leaf \['b'\] has shape \(5,\) but the updates "
                                       r"leaf has shape \(4,\)"):
    opt.update(PARAMS, opt.init(PARAMS), {"w": jnp.ones((3, 4)), "b": jnp.zeros(5)})


@pytest.mark.parametrize("name", ["sgd", "adam", "lamb", "lion"])
def test_an_empty_tree_steps_to_an_empty_tree(name):
  tx = getattr(optirs_jax, name)(0.1)
  params, state = optirs_jax.apply(tx, {}, tx.init({}), {})
  assert params == {} and int(state.count) == 1


_EVERY = [
    ("adam", lambda: optirs_jax.adam(1e-3)), ("adamw", lambda: optirs_jax.adamw(1e-3)),
    ("sgd", lambda: optirs_jax.sgd(1e-3, momentum=0.9)),
    ("rmsprop", lambda: optirs_jax.rmsprop(1e-3)), ("adagrad", lambda: optirs_jax.adagrad(1e-3)),
    ("lamb", lambda: optirs_jax.lamb(1e-3)), ("lion", lambda: optirs_jax.lion(1e-3)),
    ("adam8bit", lambda: optirs_jax.adam8bit(1e-3, min_8bit_size=8)),
    ("adamw8bit", lambda: optirs_jax.adamw8bit(1e-3, min_8bit_size=8)),
    ("sparse_adam", lambda: optirs_jax.sparse.sparse_adam(1e-3)),
    ("sparse_sgd", lambda: optirs_jax.sparse.sparse_sgd(1e-3, momentum=0.9)),
    ("master_weights", lambda: optirs_jax.mixed_precision.master_weights(optirs_jax.adamw(1e-3))),
]


@pytest.mark.parametrize("make", [m for _, m in _EVERY], ids=[n for n, _ in _EVERY])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply"])
def test_a_missing_leaf_is_named_by_its_key_path(make, fused):
  """Grads without a leaf the state has: the error names ['w3'], for every optimizer."""
  tx = make()
  params = {"w1": jnp.ones((4, 8)), "w2": jnp.ones((4, 8)), "w3": jnp.ones((4, 8))}
  state = tx.init(params)
  fewer = {"w1": params["w1"], "w2": params["w2"]}
  with pytest.raises(ValueError, match=r"\['w3'\]"):
    if fused:
      optirs_jax.apply(tx, fewer, state, fewer)
    else:
      tx.update(fewer, state, fewer)


@pytest.mark.parametrize("make", [
    lambda v: optirs_jax.adam(1e-3, b1=v), lambda v: optirs_jax.adamw(1e-3, b2=v),
    lambda v: optirs_jax.lamb(1e-3, b1=v), lambda v: optirs_jax.lion(1e-3, b2=v),
    lambda v: optirs_jax.rmsprop(1e-3, decay=v), lambda v: optirs_jax.adam8bit(1e-3, b1=v),
    lambda v: optirs_jax.sparse.sparse_adam(1e-3, b2=v),
], ids=["adam", "adamw", "lamb", "lion", "rmsprop", "adam8bit", "sparse_adam"])
def test_one_rule_for_decay_rates_everywhere(make):
  """A decay rate of 1 (a zero bias correction: NaNs) or outside [0, 1) is rejected by every
  optimizer alike, concrete arrays too; 0 and 0.999 are fine."""
  for bad in (1.0, -0.1, jnp.float32(1.0)):
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
      make(bad)
  make(0.0), make(0.999)


def test_noisy_sgd_takes_its_key_as_optax_does():
  """A typed key or an int seed of one (the same noise); optax's warning without one and its
  deprecated ``seed``; anything else a TypeError naming the value."""
  params = {"w": jnp.ones(5)}
  grads = {"w": jnp.full(5, 0.5)}
  run = lambda tx: tx.update(grads, tx.init(params), params)[0]["w"]
  by_int = run(optirs_jax.noisy_sgd(0.1, key=4))
  np.testing.assert_array_equal(run(optirs_jax.noisy_sgd(0.1, key=jax.random.key(4))), by_int)
  assert not np.array_equal(run(optirs_jax.noisy_sgd(0.1, key=5)), by_int)
  with pytest.warns(UserWarning, match="no key given, 0 is used"):
    no_key = optirs_jax.noisy_sgd(0.1)
  np.testing.assert_array_equal(run(no_key), run(optirs_jax.noisy_sgd(0.1, key=0)))
  with pytest.warns(DeprecationWarning, match='"seed" is deprecated'):
    np.testing.assert_array_equal(run(optirs_jax.noisy_sgd(0.1, seed=4)), by_int)
  with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="only one of seed=4"):
    optirs_jax.noisy_sgd(0.1, key=1, seed=4)
  with pytest.raises(TypeError, match=r"key='a' must be a random key \(jax.random.key"):
    optirs_jax.noisy_sgd(0.1, key="a")
  with pytest.raises(TypeError, match="key=1.5 must be"):
    optirs_jax.noisy_sgd(0.1, key=1.5)

"""Every state round-trips through flax.serialization, orbax and pickle, and the step after
a restore is bit for bit the step without one."""

import pickle

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optirs_jax
from tests.states import IDS, STATES

PARAMS_SHAPES = {"w": (16, 64), "b": (64,), "e": (8, 8)}  # "w": 1024 elements, 8-bit


def _params(dtype):
  keys = jax.random.split(jax.random.key(0), len(PARAMS_SHAPES))
  return {k: jax.random.normal(key, shape).astype(dtype)
          for key, (k, shape) in zip(keys, PARAMS_SHAPES.items())}


def _grads(params, seed, scale=1.0):
  keys = jax.random.split(jax.random.key(seed), len(params))
  return {k: (scale * jax.random.normal(key, v.shape)).astype(v.dtype)
          for key, (k, v) in zip(keys, sorted(params.items()))}


def _trained(factory, dtype):
  """(tx, params, state after two steps, a step function)."""
  tx = factory()
  params = _params(dtype)
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))
  for seed in (1, 2):
    params, state = step(params, state, _grads(params, seed))
  return tx, params, state, step


def _assert_same_next_step(step, params, state, restored):
  chex.assert_trees_all_equal(restored, state)
  grads = _grads(params, 3)
  chex.assert_trees_all_equal(step(params, restored, grads), step(params, state, grads))


@pytest.mark.parametrize("factory, dtype", [s[1:] for s in STATES], ids=IDS)
def test_flax_serialization_round_trip(factory, dtype):
  serialization = pytest.importorskip("flax.serialization", reason="flax is a test extra")
  tx, params, state, step = _trained(factory, dtype)
  data = serialization.to_bytes(state)
  restored = serialization.from_bytes(tx.init(params), data)  # into a fresh state
  restored = jax.tree.map(jnp.asarray, restored)  # flax restores numpy arrays
  _assert_same_next_step(step, params, state, restored)


@pytest.mark.parametrize("factory, dtype", [s[1:] for s in STATES], ids=IDS)
def test_pickle_round_trip(factory, dtype):
  tx, params, state, step = _trained(factory, dtype)
  _assert_same_next_step(step, params, state, pickle.loads(pickle.dumps(state)))


@pytest.mark.parametrize("factory, dtype", [s[1:] for s in STATES], ids=IDS)
def test_orbax_round_trip(factory, dtype, tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is a test extra")
  tx, params, state, step = _trained(factory, dtype)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "state", state)
  with ocp.StandardCheckpointer() as ckpt:
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, tx.init(params))
    restored = ckpt.restore(tmp_path / "state", target)
  _assert_same_next_step(step, params, state, restored)


def test_the_catalogue_covers_every_state_kind():
  """Each state type of the library is among those round-tripped above."""
  names = {type(node).__name__ for _, factory, dtype in STATES
           for node in _walk(factory().init(_params(dtype)))}
  assert {"AdamState", "SgdState", "RmspropState", "AdagradState", "LionState",
          "Adam8bitState", "Quantized8bit", "MasterWeightsState", "LossScalingState",
          "DynamicLossScale", "StaticLossScale", "NoOpLossScale", "SparseAdamState",
          "SparseSgdState", "MaskedNode", "InjectStatefulHyperparamsState",
          "LarsState", "NovogradState"} <= names, names


def _walk(tree):
  """Every node of a state (NamedTuples, dataclasses, containers)."""
  out = [tree]
  if isinstance(tree, dict):
    for v in tree.values():
      out += _walk(v)
  elif isinstance(tree, (list, tuple)):
    for v in tree:
      out += _walk(v)
  elif hasattr(tree, "__dataclass_fields__"):
    for name in tree.__dataclass_fields__:
      out += _walk(getattr(tree, name))
  return out


def test_optax_state_for_comparison_round_trips_alike():
  """The same round trips on optax's own adamw state: the reference behaviour."""
  serialization = pytest.importorskip("flax.serialization", reason="flax is a test extra")
  tx = optax.adamw(1e-2)
  params = _params(jnp.float32)
  state = tx.init(params)
  restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
  chex.assert_trees_all_equal(jax.tree.map(jnp.asarray, restored), state)

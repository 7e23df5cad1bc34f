"""The opt-in flat parameter layout: exact round trips, flat gradients, the same training."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optirs_jax
from optirs_jax.flat import FlatLayout
from tests import cases


def mixed_tree():
  t = cases.ragged_tree(0)
  return t | {"half": jnp.arange(10, dtype=jnp.bfloat16), "empty": jnp.zeros((0, 3)),
              "count": jnp.arange(5, dtype=jnp.int32)}


@pytest.mark.parametrize("align", [1, 128, 1000])
def test_ravel_then_unravel_is_exact_and_leaves_start_aligned(align):
  tree = mixed_tree()
  layout = FlatLayout.of(tree, align=align)
  flat = layout.ravel(tree)
  assert set(flat) == {"float32", "bfloat16", "int32"}
  for name, buf in flat.items():
    assert buf.ndim == 1 and buf.shape[0] == layout.sizes[name]
    assert buf.shape[0] % align == 0 and buf.dtype == layout.buffer_dtypes[name]
  for name, offset, _ in layout.slots:
    assert offset % align == 0, (name, offset)
  chex.assert_trees_all_equal(layout.unravel(flat), tree)
  chex.assert_trees_all_equal_dtypes(layout.unravel(flat), tree)
  # Padding is zero: the buffers hold exactly the leaves' values besides zeros.
  total = sum(float(jnp.sum(jnp.abs(b.astype(jnp.float32)))) for b in flat.values())
  assert total == pytest.approx(sum(float(jnp.sum(jnp.abs(x.astype(jnp.float32))))
                                    for x in jax.tree.leaves(tree)), rel=1e-6)


def test_a_buffer_larger_than_the_limit_is_split():
  tree = {f"l{i}": jnp.full((300,), i, jnp.float32) for i in range(5)}
  layout = FlatLayout.of(tree, align=100, max_buffer_elements=700)
  assert layout.sizes == {"float32": 600, "float32_1": 600, "float32_2": 300}
  chex.assert_trees_all_equal(layout.unravel(layout.ravel(tree)), tree)


def test_the_gradient_of_a_loss_through_unravel_is_the_flat_gradient():
  tree = cases.ragged_tree(0)
  layout = FlatLayout.of(tree)
  grads = jax.grad(lambda f: cases.loss(layout.unravel(f)))(layout.ravel(tree))
  chex.assert_trees_all_close(grads, layout.ravel(jax.grad(cases.loss)(tree)), rtol=1e-6)


# Yogi's moments start at 1e-6: its padding lanes move (harmlessly) with a zero gradient,
# and the sign in its rule parts the two programs by single elements over 20 steps.
# A noisy optimizer draws one key per leaf: the flat buffer is one leaf, so other noise.
FLAT_CASES = [c for c in cases.TYPICAL if c[0] in cases.ELEMENTWISE and c[0] != "yogi"
              and c[0] not in cases.NOISY]


@pytest.mark.parametrize("name,kw", FLAT_CASES, ids=[cases.case_id(c) for c in FLAT_CASES])
@pytest.mark.parametrize("backend", ["jnp", "pallas"])
def test_training_on_the_flat_buffers_matches_optax_on_the_tree(name, kw, backend):
  tree = cases.ragged_tree(0)
  layout = FlatLayout.of(tree)
  opt = getattr(optirs_jax, name)(1e-3, **kw, backend=backend)
  ref = getattr(optax, name)(1e-3, **kw)

  @jax.jit
  def flat_step(flat, state):
    grads = jax.grad(lambda f: cases.loss(layout.unravel(f)))(flat)
    return optirs_jax.apply(opt, grads, state, flat)

  @jax.jit
  def tree_step(params, state):
    with jax.numpy_dtype_promotion("standard"):
      updates, state = ref.update(jax.grad(cases.loss)(params), state, params)
    return optax.apply_updates(params, updates), state

  flat, state = layout.ravel(tree), opt.init(layout.ravel(tree))
  params, ref_state = tree, ref.init(tree)
  for _ in range(20):
    flat, state = flat_step(flat, state)
    params, ref_state = tree_step(params, ref_state)
  chex.assert_trees_all_close(layout.unravel(flat), params, rtol=1e-5, atol=1e-6)
  # The padding never moves.
  mask = np.ones(layout.sizes["float32"], bool)
  for _, offset, size in layout.slots:
    mask[offset:offset + size] = False
  assert not np.any(np.asarray(flat["float32"])[mask])


def test_bad_inputs_name_what_is_wrong():
  tree = cases.ragged_tree(0)
  layout = FlatLayout.of(tree)
  with pytest.raises(ValueError, match="structure"):
    layout.ravel({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match=r"leaf 0 is float32\[2\]"):
    layout.ravel(jax.tree.map(lambda x: jnp.ones((2,)), tree))
  with pytest.raises(ValueError, match="named \\['float32'\\]"):
    layout.unravel({"f32": jnp.zeros(3)})
  with pytest.raises(ValueError, match="buffer 'float32' is float32\\[3\\]"):
    layout.unravel({"float32": jnp.zeros(3)})
  with pytest.raises(ValueError, match="align=0"):
    FlatLayout.of(tree, align=0)
  with pytest.raises(ValueError, match="at least one array leaf"):
    FlatLayout.of({})
  with pytest.raises(TypeError, match="leaf 0 of the tree is str"):
    FlatLayout.of(["a"])


def test_a_layout_is_a_hashable_static_argument():
  tree = cases.ragged_tree(0)
  layout = FlatLayout.of(tree)
  assert hash(layout) == hash(FlatLayout.of(tree)) and layout == FlatLayout.of(tree)
  with pytest.raises(TypeError, match="read-only"):
    layout.sizes["float32"] = 0
  unravel = jax.jit(lambda layout, flat: layout.unravel(flat)["rows"], static_argnums=0)
  chex.assert_trees_all_equal(unravel(layout, layout.ravel(tree)), tree["rows"])

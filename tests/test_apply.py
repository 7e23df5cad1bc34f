"""The fused apply path gives the numbers of ``update`` followed by ``optax.apply_updates``."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optirs_jax
from tests import cases

# The rule of every case is held to optax by tests/test_parity.py; the fused pass adds the
# params' update to it alike for every option: every case of the core optimizers and the
# typical one of each other, on both backends.
APPLY = cases.backend_cases(sampled=True)


@pytest.mark.parametrize("case, backend", APPLY,
                         ids=cases.backend_ids(APPLY))
def test_fused_apply_matches_update_then_apply_updates(case, backend):
  name, kw = case
  tx = getattr(optirs_jax, name)(1e-2, **kw, backend=backend)
  ref = getattr(optax, name)(1e-2, **kw)
  params = cases.ragged_tree(0)
  fused = jax.jit(lambda g, s, p: optirs_jax.apply(tx, g, s, p))

  @jax.jit
  def pair(g, s, p):
    u, s = ref.update(g, s, p)
    return optax.apply_updates(p, u), s

  p, s = params, tx.init(params)
  rp, rs = params, ref.init(params)
  for _ in range(3):
    g = jax.tree.map(jnp.sin, p)
    p, s = fused(g, s, p)
    with jax.numpy_dtype_promotion("standard"):
      rp, rs = pair(jax.tree.map(jnp.sin, rp), rs, rp)
  # The fused pass may contract p + (-lr * u) into one FMA: one rounding fewer than the pair.
  chex.assert_trees_all_close(p, rp, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_equal_dtypes(p, params)


def test_apply_of_a_chain_equals_update_and_apply_updates(standard_promotion):
  tx = optax.chain(optax.clip_by_global_norm(1.0), optirs_jax.adam(1e-2))
  params = cases.ragged_tree(0)
  grads = cases.ragged_tree(1)
  state = tx.init(params)
  p, _ = optirs_jax.apply(tx, grads, state, params)
  u, _ = tx.update(grads, state, params)
  if jax.default_backend() == "cpu":  # both on the reference
    chex.assert_trees_all_equal(p, optax.apply_updates(params, u))
  else:  # the chain is fused into the kernel, update + apply_updates runs in XLA
    chex.assert_trees_all_close(p, optax.apply_updates(params, u), rtol=1e-6, atol=1e-7)


def test_fused_apply_half_precision_keeps_param_dtype():
  params = cases.ragged_tree(0, jnp.bfloat16)
  tx = optirs_jax.adam(1e-2, backend="pallas")
  p, s = jax.jit(lambda g, s, p: optirs_jax.apply(tx, g, s, p))(params, tx.init(params), params)
  chex.assert_trees_all_equal_dtypes(p, params)
  chex.assert_trees_all_equal_dtypes(s, tx.init(params))

"""Adafactor's factored reduction: the paper's algorithm in numpy, its memory, its errors and
its fallbacks (parity with optax.adafactor runs in the registry's suites)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optirs_jax
from optirs_jax import mixed_precision as mp


def _paper_step(x, g, r, c, v, t, *, lr, d=1.0, eps1=1e-30, eps2=1e-3, decay_rate=0.8):
  """One step of Shazeer and Stern's Algorithm 4 (factored, 2-D) or 3 (a vector), with
  relative step size ``lr`` and the parameter scale, in float64. ``r``, ``c``, ``v``: the
  row, column and full statistics as optax keeps them (means rather than sums: the
  normalization cancels)."""
  beta = 1.0 - (t + 1.0) ** (-decay_rate)
  g2 = g * g + eps1
  if x.ndim == 2:
    r = beta * r + (1 - beta) * g2.mean(axis=1)
    c = beta * c + (1 - beta) * g2.mean(axis=0)
    v_hat = np.outer(r, c) / r.mean()
  else:
    v = v_hat = beta * v + (1 - beta) * g2
  u = g / np.sqrt(v_hat)
  u = u / max(1.0, np.sqrt(np.mean(u * u)) / d)
  alpha = max(eps2, np.sqrt(np.mean(x * x))) * lr
  return x - alpha * u, r, c, v


@pytest.mark.parametrize("backend", ["jnp", "pallas"])
def test_three_steps_follow_the_papers_algorithm(backend):
  rng = np.random.default_rng(0)
  shapes = {"w": (160, 136), "b": (136,)}
  x = {k: rng.normal(size=s) for k, s in shapes.items()}
  tx = optirs_jax.adafactor(1e-2, backend=backend)
  params = {k: jnp.asarray(v, jnp.float32) for k, v in x.items()}
  state = tx.init(params)
  ref = {"w": (x["w"], np.zeros(160), np.zeros(136), None),
         "b": (x["b"], None, None, np.zeros(136))}
  for t in range(3):
    g = {k: rng.normal(size=s) for k, s in shapes.items()}
    params, state = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))(
        params, state, {k: jnp.asarray(v, jnp.float32) for k, v in g.items()})
    for k in shapes:
      ref[k] = _paper_step(ref[k][0], g[k], *ref[k][1:], t, lr=1e-2)
      np.testing.assert_allclose(params[k], ref[k][0], rtol=2e-6, atol=1e-7)
  # optax's (and so our) v_row drops the largest axis d0 (here the 160 rows): the paper's
  # column statistics; v_col drops the other: the paper's row statistics.
  np.testing.assert_allclose(state.v_row["w"], ref["w"][2], rtol=1e-5)
  np.testing.assert_allclose(state.v_col["w"], ref["w"][1], rtol=1e-5)
  np.testing.assert_allclose(state.v["b"], ref["b"][3], rtol=1e-5)


def test_a_factored_leaf_keeps_its_row_and_column_means_only():
  """Sublinear memory: a 1024 x 512 matrix keeps 1536 statistics, not 524288."""
  tx = optirs_jax.adafactor(1e-2)
  state = tx.init({"w": jnp.zeros((1024, 512)), "conv": jnp.zeros((3, 3, 256, 128)),
                   "small": jnp.zeros((100, 512))})
  size = lambda name: sum(getattr(state, f)[name].size for f in ("v_row", "v_col", "v"))
  assert size("w") == 1024 + 512 + 1
  assert size("conv") == 3 * 3 * 128 + 3 * 3 * 256 + 1  # the two largest axes factored
  assert size("small") == 100 * 512 + 2  # 100 < min_dim_size_to_factor: one per element


def test_bad_state_and_arguments_name_the_leaf_and_the_value():
  tx = optirs_jax.adafactor(1e-2)
  params = {"w": jnp.ones((256, 128))}
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"state.v_row leaf \['w'\] has shape \(256,\) but "
                     r"the updates leaf of shape \(256, 128\) keeps it as \(128,\)"):
    tx.update(params, state._replace(v_row={"w": jnp.zeros(256)}), params)
  with pytest.raises(ValueError, match="min_dim_size_to_factor=-1 must be an int >= 0"):
    optirs_jax.adafactor(1e-2, min_dim_size_to_factor=-1)
  with pytest.raises(ValueError, match="min_dim_size_to_factor=2.5 must be an int"):
    optirs_jax.adafactor(1e-2, min_dim_size_to_factor=2.5)
  injected = optax.inject_hyperparams(optirs_jax.adafactor)(learning_rate=1e-2)
  with pytest.raises(ValueError, match=r"static_args=\('min_dim_size_to_factor',\)"):
    jax.jit(injected.update)(params, injected.init(params), params)
  with pytest.raises(ValueError, match="this transformation needs the params"):
    tx.update(params, state)


@pytest.mark.parametrize("wrap", ["loss_scaling", "master_weights"])
def test_loss_scaling_and_master_weights_fall_back_with_optax_numbers(wrap, standard_promotion):
  """Not folded into the kernels (NotFused): the wrappers run update + apply_updates, with
  optax.adafactor's numbers inside the same wrappers."""
  dtype = jnp.bfloat16 if wrap == "master_weights" else jnp.float32
  params = {"w": jnp.linspace(-1.0, 1.0, 256 * 128).reshape(256, 128).astype(dtype),
            "b": jnp.linspace(0.5, 1.5, 7).astype(dtype)}
  grads = jax.tree.map(lambda x: (jnp.cos(3.0 * x) * 2.0**4).astype(dtype), params)
  make = {"loss_scaling": lambda inner: mp.with_loss_scaling(inner, mp.DynamicLossScale(
      2.0**4)), "master_weights": mp.master_weights}[wrap]
  ours, ref = make(optirs_jax.adafactor(1e-2)), make(optax.adafactor(1e-2))
  new, _ = jax.jit(lambda p, s, g: optirs_jax.apply(ours, g, s, p))(params, ours.init(params),
                                                                     grads)
  u, _ = jax.jit(ref.update)(grads, ref.init(params), params)
  chex.assert_trees_all_close(new, optax.apply_updates(params, u), rtol=1e-6, atol=1e-7)
  assert not np.allclose(np.asarray(new["w"], np.float32), np.asarray(params["w"], np.float32))

"""optirs_jax.apply on what users wrap optimizers in: optax.chain of known links and
optax.inject_hyperparams run as the optimizer's fused step, with the numbers of ``update``
and ``optax.apply_updates`` (bit for bit on the jnp reference); anything else falls back."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optirs_jax
from optirs_jax import mixed_precision as mp
from optirs_jax.fusion import explain, fused_step
from optirs_jax.transforms import REGISTRY
from tests import cases

SHAPES = {"w": (33, 40), "v": (257,), "s": (), "m": (4, 3, 5)}


def _tree(seed, scale=1.0):
  keys = jax.random.split(jax.random.key(seed), len(SHAPES))
  return {k: scale * jax.random.normal(key, s) for key, (k, s) in zip(keys, SHAPES.items())}


def _run(tx, steps=3, fused=True, grad_scale=1.0, params=None):
  params = _tree(0) if params is None else params
  state = tx.init(params)
  if fused:
    step = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))
  else:
    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    step = jax.jit(step)
  for i in range(steps):
    params, state = step(params, state, _tree(10 + i, grad_scale))
  return params, state


def _same(fused, contract):
  """Bit for bit on the CPU, where both run the reference. On a GPU the fused step runs the
  kernel and update + apply_updates runs XLA (every leaf of a rule without norms goes to
  XLA there): float32 rounding apart, compounded over the steps."""
  if jax.default_backend() == "cpu":
    chex.assert_trees_all_equal(fused, contract)
  else:
    chex.assert_trees_all_close(fused, contract, rtol=1e-5, atol=1e-7)


LINKS = {
    "clip_by_global_norm": lambda: optax.clip_by_global_norm(1.0),
    "clip_by_global_norm_inactive": lambda: optax.clip_by_global_norm(1e3),
    "clip": lambda: optax.clip(0.3),
    "scale": lambda: optax.scale(0.5),
    "scale_by_learning_rate": lambda: optax.scale_by_learning_rate(0.7, flip_sign=False),
    "scale_by_schedule": lambda: optax.scale_by_schedule(optax.linear_schedule(1.0, 0.1, 5)),
    "add_decayed_weights": lambda: optax.add_decayed_weights(1e-2),
    "add_decayed_weights_schedule": lambda: optax.add_decayed_weights(
        optax.linear_schedule(1e-2, 0.0, 5)),
    "add_decayed_weights_zero": lambda: optax.add_decayed_weights(0.0),
    "identity": optax.identity,
}


# Every link on the core optimizers; the global-norm clip (the usual recipe) on the others.
# (A noisy optimizer draws its noise before its kernel, Adafactor's factored statistics are
# XLA's: their chains fall back, below.)
CHAINS = [(link, case) for case in cases.TYPICAL for link in LINKS
          if (case[0] in cases.CORE or link == "clip_by_global_norm")
          and case[0] not in cases.NOISY and not REGISTRY[case[0]].spec.factored]


@pytest.mark.parametrize("link, case", CHAINS,
                         ids=[f"{c[0]}-{link}" for link, c in CHAINS])
def test_a_chain_of_known_links_is_fused_and_equals_the_contract(link, case):
  name, kw = case
  first = LINKS["clip_by_global_norm"]() if "clip_by" not in link else optax.identity()
  tx = optax.chain(first, LINKS[link](), getattr(optirs_jax, name)(1e-2, **kw))
  assert explain(tx).startswith("fused: chain(")
  _same(_run(tx), _run(tx, fused=False))


EIGHT_BIT_SHAPES = {"w": (16, 64), "b": (2, 48), "small": (3,)}  # b: not whole blocks


@pytest.mark.parametrize("backend", ["jnp", "pallas"])
@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
@pytest.mark.parametrize("name, kw", [("adamw8bit", {}), ("adam8bit", {"weight_decay": 1e-2})])
def test_8bit_adam_folds_the_chain_links_into_its_kernel(name, kw, fmt, backend):
  """The links run inside 8-bit Adam's kernel (``backend="pallas"``: Pallas' interpreter
  here), before its L2 decay, with the numbers of optax's links then ``update``."""
  keys = jax.random.split(jax.random.key(3), len(EIGHT_BIT_SHAPES))
  params = {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, EIGHT_BIT_SHAPES.items())}
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.add_decayed_weights(
      optax.linear_schedule(1e-2, 0.0, 5)), optax.scale(0.5), getattr(optirs_jax, name)(
      1e-2, block_size=16, min_8bit_size=64, state_quantization=fmt, backend=backend, **kw))
  assert explain(tx) == f"fused: chain(clip_by_global_norm, add_decayed_weights, scale, {name})"
  grads = lambda i: jax.tree.map(lambda x: 3.0 * jax.random.normal(jax.random.key(i), x.shape),
                                 params)
  fused, contract = (params, tx.init(params)), (params, tx.init(params))
  step = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))

  def update(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  for i in range(3):
    fused = step(*fused, grads(i))
    contract = jax.jit(update)(*contract, grads(i))
  # Not bit for bit even on the CPU: XLA compiles the links inside the step's fusion and
  # apart from it, and rounds a few results an ulp apart (a scale, a param); a moment near
  # a code's boundary may then take the next code.
  rtol = 1e-6 if jax.default_backend() == "cpu" else 1e-5
  for a, b in zip(jax.tree.leaves(fused), jax.tree.leaves(contract)):
    a, b = np.asarray(a), np.asarray(b)
    if jnp.issubdtype(a.dtype, jnp.integer):
      assert np.abs(a.astype(int) - b).max() <= 1 and np.mean(a != b) <= 0.01
    else:
      np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=rtol,
                                 atol=1e-7)
  assert not np.allclose(fused[0]["w"], params["w"])


def test_the_global_norm_clips_only_when_it_exceeds_the_bound():
  """A numpy model of clip_by_global_norm then SGD, both branches of the clip."""
  params = _tree(0)
  for scale, bound in ((10.0, 1.0), (0.01, 1.0)):
    grads = _tree(1, scale)
    tx = optax.chain(optax.clip_by_global_norm(bound), optirs_jax.sgd(0.5))
    new, _ = optirs_jax.apply(tx, grads, tx.init(params), params)
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
    factor = 1.0 if norm < bound else bound / norm
    for k in params:
      np.testing.assert_allclose(new[k], np.asarray(params[k]) - 0.5 * factor *
                                 np.asarray(grads[k]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "lamb", "lion", "sgd"])
def test_inject_hyperparams_is_fused_and_equals_the_contract(name):
  tx = optax.inject_hyperparams(getattr(optirs_jax, name))(
      learning_rate=optax.linear_schedule(1e-2, 1e-3, 4))
  assert explain(tx) == f"fused: inject_hyperparams({name})"
  fused, contract = _run(tx, steps=4), _run(tx, steps=4, fused=False)
  _same(fused, contract)
  assert float(fused[1].hyperparams["learning_rate"]) == pytest.approx(1e-2 - 3 * 2.25e-3)


def test_nested_chains_and_inject_inside_a_chain():
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.chain(
      optax.scale(0.5), optax.inject_hyperparams(optirs_jax.adamw)(learning_rate=1e-2)))
  assert explain(tx) == ("fused: chain(clip_by_global_norm, chain(scale, "
                         "inject_hyperparams(adamw)))")
  _same(_run(tx), _run(tx, fused=False))


@pytest.mark.parametrize("tx, why", [
    (lambda: optax.chain(optax.scale_by_adam(), optirs_jax.sgd(1e-2)), "is not a link"),
    (lambda: optax.chain(optirs_jax.adam(1e-2), optax.scale(0.5)), "last transformation"),
    (lambda: optax.chain(optax.scale(0.5), optax.clip_by_global_norm(1.0),
                         optirs_jax.adam(1e-2)), "clip_by_global_norm after another link"),
    (lambda: optax.chain(optax.add_decayed_weights(1e-2, mask=lambda p: jax.tree.map(
        lambda x: x.ndim > 1, p)), optirs_jax.adam(1e-2)), "is not a link"),
    (lambda: optax.chain(optax.clip(1.0), mp.master_weights(optirs_jax.adamw(1e-2))),
     "does not fold links"),
    (lambda: optax.chain(optax.clip_by_global_norm(1.0), optirs_jax.noisy_sgd(1e-2, key=0)),
     "does not fold links"),
    (lambda: optax.chain(optax.clip_by_global_norm(1.0), optirs_jax.adafactor(
        1e-2, min_dim_size_to_factor=4)), "does not fold links"),
    (lambda: mp.with_loss_scaling(optirs_jax.noisy_sgd(1e-2, key=0)),
     "with_loss_scaling(noisy_sgd): noisy_sgd does not fold loss scaling into its kernel"),
    (lambda: mp.with_loss_scaling(optirs_jax.adafactor(1e-2, min_dim_size_to_factor=4)),
     "adafactor does not fold loss scaling into its kernel"),
    (lambda: mp.master_weights(optax.chain(optax.clip(1.0), optirs_jax.adamw8bit(1e-2))),
     "master_weights(chain(clip, adamw8bit)): adamw8bit does not fold master weights"),
    (lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
     "not an optirs_jax optimizer"),
    (lambda: optax.MultiSteps(optirs_jax.adam(1e-2), 2), "is not a transformation"),
    (lambda: mp.with_loss_scaling(mp.master_weights(optax.adamw(1e-2))),
     "master_weights(optax.chain): chain: its last transformation is not fused (optax.scale"),
])
def test_anything_else_falls_back_with_the_same_numbers_and_says_why(tx, why, standard_promotion):
  tx = tx()
  assert fused_step(tx) is None
  assert explain(tx).startswith("update + apply_updates") and why in explain(tx)
  chex.assert_trees_all_equal(_run(tx), _run(tx, fused=False))


def test_loss_scaling_and_master_weights_around_a_chain(standard_promotion):
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _tree(0))
  tx = mp.with_loss_scaling(mp.master_weights(optax.chain(
      optax.clip_by_global_norm(1.0), optax.scale_by_schedule(optax.linear_schedule(1.0, .5, 4)),
      optirs_jax.adamw(1e-2))), mp.DynamicLossScale(2.0**4, period=2))
  assert explain(tx) == ("fused: with_loss_scaling(master_weights(chain(clip_by_global_norm, "
                         "scale_by_schedule, adamw)))")
  fused = _run(tx, steps=4, grad_scale=16.0, params=params)
  contract = _run(tx, steps=4, fused=False, grad_scale=16.0, params=params)
  chex.assert_trees_all_equal_structs(fused, contract)
  # The global norm of the unscaled gradients is reduced in another XLA program: the
  # clip factor, and what follows, may differ in the last bits.
  chex.assert_trees_all_close(fused, contract, rtol=1e-5, atol=1e-6)


def test_a_skipped_step_leaves_the_links_counts_as_they_were():
  tx = mp.with_loss_scaling(optax.chain(
      optax.scale_by_schedule(optax.linear_schedule(1.0, 0.5, 4)), optirs_jax.sgd(1e-2)))
  params = _tree(0)
  state = tx.init(params)
  bad = jax.tree.map(lambda x: x.at[()].set(jnp.inf) if x.ndim == 0 else x, _tree(1))
  new_params, new_state = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))(
      params, state, bad)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert int(mp.skipped_steps_of(new_state)) == 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode (CPU); the Triton "
                    "kernels are compared in tests/test_gpu.py")
def test_the_kernels_run_the_folded_links_as_the_reference():
  tx = lambda backend: optax.chain(optax.clip_by_global_norm(1.0), optax.clip(0.4),
                                   optax.add_decayed_weights(1e-2),
                                   optirs_jax.adamw(1e-2, backend=backend))
  chex.assert_trees_all_close(_run(tx("pallas"), steps=2), _run(tx("jnp"), steps=2),
                              rtol=1e-6, atol=1e-7)


def test_the_cuda_step_of_a_clipped_chain_is_the_optimizers_kernel_and_a_norm_pass():
  from tests.test_lowering import cuda_triton_calls
  params = {"w": jnp.zeros((512, 768)), "b": jnp.zeros(768)}
  step = lambda tx: lambda p, s, g: optirs_jax.apply(tx, g, s, p)
  bare = optirs_jax.adamw(1e-3)
  chain = optax.chain(optax.clip_by_global_norm(1.0), optirs_jax.adamw(1e-3))
  n_bare = cuda_triton_calls(step(bare), params, bare.init(params), params)
  n_chain = cuda_triton_calls(step(chain), params, chain.init(params), params)
  assert n_chain == n_bare + 2, (n_bare, n_chain)  # the norm: a grouped pass and its totals

"""Every small-leaf policy of the kernel backend gives the reference's numbers.

``executor.SMALL_LEAF_POLICY`` decides what happens to the leaves that are too small to
run in place: packed into one buffer, run one launch each, or handed to the reference.
``benchmarks/policy_variants.sh`` times the three on a GPU; here each runs in interpret
mode, on both paths, with LAMB's per-leaf norms, and through the cuda export.
"""

import chex
import jax
import pytest

import optirs_jax
from optirs_jax.pallas import executor, kernel
from tests import cases
from tests.test_lowering import cuda_triton_calls


@pytest.fixture(params=executor.SMALL_LEAF_POLICIES)
def policy(request, monkeypatch):
  cases.use_leaf_policy(monkeypatch, request.param, "in-place")
  # Smaller blocks, so that the ragged tree has leaves on both sides of the threshold.
  monkeypatch.setattr(executor, "SOLO_MIN_BLOCKS", 2)
  monkeypatch.setitem(kernel.TILINGS, "interpret", kernel.Tiling(8))
  return request.param


def tree():
  """The ragged tree plus a leaf of whole lanes longer than one block (1152) and one shorter
  (256): with 1024-element blocks and a threshold of 2 blocks, "block" (4096) and "rows"
  (4224, a partial last block) run in place under every policy."""
  params = cases.ragged_tree(0)
  params |= {"lanes": params["rows"][:9].reshape(-1), "short_lanes": params["rows"][-2:]}
  return params


@pytest.mark.parametrize("name", ["adam", "lamb", "sgd"])
def test_policy_matches_reference_on_both_paths(policy, name):
  params = tree()
  ours, grads, ru, rs = cases.pallas_matches_jnp(name, params)
  p, s = jax.jit(lambda g, s, p: optirs_jax.apply(ours, g, s, p))(grads, ours.init(params),
                                                                    params)
  chex.assert_trees_all_close(p, jax.tree.map(lambda a, b: a + b, params, ru), rtol=1e-6,
                              atol=1e-8)
  chex.assert_trees_all_close(s, rs, rtol=1e-6, atol=1e-9)


def test_policy_changes_the_number_of_kernel_launches(policy, monkeypatch, standard_promotion):
  monkeypatch.setitem(kernel.TILINGS, "cuda", kernel.Tiling(8))
  opt = optirs_jax.adam(1e-3)
  params = tree()
  launches = cuda_triton_calls(lambda p, s, g: optirs_jax.apply(opt, g, s, p), params,
                               opt.init(params), params)
  # pack: "block", "rows", and one launch for everything else packed; reference: the two in
  # place only; solo: also "lanes" on its own (a launch for its whole block; "short_lanes"
  # is shorter than a block, so jnp computes it), and the rest packed.
  # group: the two in place and one grouped launch for every other leaf.
  assert launches == {"pack": 3, "reference": 2, "solo": 4, "group": 3}[policy]


@pytest.mark.parametrize("knob, valid", [
    ("SMALL_LEAF_POLICY", "'group', 'pack', 'solo', 'reference'"),
    ("LARGE_LEAF_POLICY", "'group', 'in-place'")])
def test_an_unknown_policy_is_an_error_naming_the_valid_ones(knob, valid, monkeypatch):
  monkeypatch.setattr(executor, knob, "scatter")
  opt = optirs_jax.sgd(1e-2, backend="pallas")
  params = cases.ragged_tree(0)
  with pytest.raises(ValueError, match=f"{knob}='scatter' is not one of \\({valid}\\)"):
    opt.update(params, opt.init(params), params)

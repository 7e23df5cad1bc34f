"""Every small-leaf policy of the kernel backend gives the reference's numbers.

``ExecutorOptions.small_leaf_policy`` decides what happens to the leaves that are too small
to run in place: grouped launches, packed into one buffer, one launch each, or the
reference. ``benchmarks/policy_variants.sh`` times them on a GPU; here each runs in
interpret mode, on both paths, with LAMB's per-leaf norms, and through the cuda export.
"""

import chex
import jax
import pytest

import optirs_jax
from optirs_jax.pallas.options import SMALL_LEAF_POLICIES
from tests import cases
from tests.test_lowering import cuda_triton_calls


def options(policy):
  # Blocks of 8 rows and a threshold of 2 blocks, so that the ragged tree has leaves on both
  # sides of it.
  return cases.leaf_policy(policy, "in-place", solo_min_blocks=2,
                           cuda_tiling=optirs_jax.Tiling(8))


@pytest.fixture(params=SMALL_LEAF_POLICIES)
def policy(request):
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
  ours, grads, ru, rs = cases.pallas_matches_jnp(name, params, options(policy))
  p, s = jax.jit(lambda g, s, p: optirs_jax.apply(ours, g, s, p))(grads, ours.init(params),
                                                                    params)
  chex.assert_trees_all_close(p, jax.tree.map(lambda a, b: a + b, params, ru), rtol=1e-6,
                              atol=1e-8)
  chex.assert_trees_all_close(s, rs, rtol=1e-6, atol=1e-9)


def test_policy_changes_the_number_of_kernel_launches(policy, standard_promotion):
  opt = optirs_jax.adam(1e-3, executor_options=options(policy))
  params = tree()
  launches = cuda_triton_calls(lambda p, s, g: optirs_jax.apply(opt, g, s, p), params,
                               opt.init(params), params)
  # pack: "block", "rows", and one launch for everything else packed; reference: the two in
  # place only; solo: also "lanes" on its own (a launch for its whole block; "short_lanes"
  # is shorter than a block, so jnp computes it), and the rest packed.
  # group: the two in place and one grouped launch for every other leaf.
  assert launches == {"pack": 3, "reference": 2, "solo": 4, "group": 3}[policy]


@pytest.mark.parametrize("knob, valid", [
    ("small_leaf_policy", "'group', 'pack', 'solo', 'reference'"),
    ("large_leaf_policy", "'group', 'in-place'")])
def test_an_unknown_policy_is_an_error_naming_the_valid_ones(knob, valid):
  with pytest.raises(ValueError, match=f"{knob}='scatter' is not one of \\({valid}\\)"):
    optirs_jax.ExecutorOptions(**{knob: "scatter"})

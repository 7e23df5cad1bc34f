"""Executor options are values: checked when made, part of every kernel cache key, and the
kernel geometries they select give the reference's numbers."""

import jax
import jax.numpy as jnp
import pytest

import optirs_jax
from optirs_jax import Tiling
from tests import cases
from tests.test_lowering import cuda_triton_calls


@pytest.mark.parametrize("kwargs, error, match", [
    ({"solo_min_blocks": 0}, ValueError, "solo_min_blocks=0 must be a positive int"),
    ({"updates_on_reference": 1}, TypeError, "updates_on_reference=1 must be a bool"),
    ({"cuda_tiling": (8, 128)}, TypeError, r"cuda_tiling=\(8, 128\) must be a Tiling"),
    ({"grouped_tiling": Tiling(8)}, ValueError, "must have flat=True"),
    ({"grouped_max_buffers": 0}, ValueError, "grouped_max_buffers=0 must be an int from 1 to 4000"),
    ({"grouped_max_buffers": 5000}, ValueError, r"5000 must be an int from 1 to 4000 \(32 KB"),
    ({"grouped_min_block_bytes": -1}, ValueError, "grouped_min_block_bytes=-1 must be an int >= 0"),
    ({"grouped_min_block_bytes": True}, ValueError, "grouped_min_block_bytes=True must be an int"),
    ({"dynamic_map_coder": "search"}, ValueError,
     r"dynamic_map_coder='search' is not one of \('table', 'arithmetic-decode', 'arithmetic'\)"),
])
def test_bad_options_are_rejected_when_made(kwargs, error, match):
  with pytest.raises(error, match=match):
    optirs_jax.ExecutorOptions(**kwargs)


@pytest.mark.parametrize("dtypes, min_bytes, block", [
    (["float32"] * 7, 4096, 256),  # Adam's fused apply: 28 bytes x 256 = 7 KB, as given
    (["float32"] * 2, 4096, 512),  # 8 bytes: 2 KB at 256, 4 KB at 512
    (["float32"], 4096, 1024),  # 4 bytes: 1 KB, 2 KB, then 4 KB at 1024
    (["bfloat16"], 4096, 1024),  # 2 bytes: 512 bytes at 1024 still, but at most 4x
    (["float32"], 0, 256),  # 0: the blocks as given
])
def test_grouped_blocks_widen_until_a_block_moves_the_minimum(dtypes, min_bytes, block):
  options = optirs_jax.ExecutorOptions(grouped_min_block_bytes=min_bytes)
  tiling = options.grouped_tiling_for([jnp.dtype(d) for d in dtypes])
  assert tiling.block_elems == block and tiling.flat and tiling.num_warps == 4


def test_bad_tiling_and_bad_options_argument():
  with pytest.raises(ValueError, match="block_rows=0 must be a positive int"):
    Tiling(0)
  with pytest.raises(TypeError, match="executor_options='pack' must be None or an "
                                      "optirs_jax.ExecutorOptions"):
    optirs_jax.adam(1e-3, executor_options="pack")


def test_options_are_hashable_values():
  a = optirs_jax.ExecutorOptions(small_leaf_policy="pack")
  assert a == optirs_jax.ExecutorOptions(small_leaf_policy="pack") and hash(a) == hash(
      optirs_jax.ExecutorOptions(small_leaf_policy="pack"))
  assert a != optirs_jax.ExecutorOptions()


def test_two_optimizers_with_different_options_in_one_program():
  """Options are part of the kernels' cache keys: each optimizer gets its own launches."""
  params = cases.ragged_tree(0)
  grouped = optirs_jax.adam(1e-3)
  packed = optirs_jax.adam(1e-3, executor_options=cases.leaf_policy("pack", "in-place"))

  def step(p, s1, s2):
    p1, _ = optirs_jax.apply(grouped, p, s1, p)
    p2, _ = optirs_jax.apply(packed, p, s2, p)
    return p1, p2

  # One grouped launch and one packed launch (every leaf is below the in-place threshold);
  # with one cache key for both, the second would reuse the first's layout.
  assert cuda_triton_calls(step, params, grouped.init(params), packed.init(params)) == 2


# Kernel geometries: the 2-D default, 2-D blocks of 8 rows, 1-D blocks of 4096 (8 warps).
GEOMETRIES = {"2d-r32": Tiling(32), "2d-r8": Tiling(8), "1d-4096": Tiling(32, num_warps=8,
                                                                          flat=True)}


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_packed_and_in_place_geometries_match_reference(geometry, name):
  options = cases.leaf_policy("pack", "in-place", cuda_tiling=GEOMETRIES[geometry],
                              solo_min_blocks=2)
  params = cases.ragged_tree(0) | {"ragged_big": jax.random.normal(jax.random.PRNGKey(9),
                                                                   (64 * 33 + 1, 128))}
  cases.pallas_matches_jnp(name, params, options)


def test_launches_keep_to_4kb_of_kernel_parameters_before_volta(monkeypatch):
  # CUDA's 32 KB kernel parameters need Volta (7.0) or newer: an older GPU in the process
  # keeps each grouped launch to the 384 buffers of 4 KB, whatever the option says.
  from optirs_jax.pallas import dispatch
  options = optirs_jax.ExecutorOptions(grouped_max_buffers=2800)
  monkeypatch.setattr(dispatch, "_oldest_cuda_capability", lambda: 9.0)
  assert dispatch._launch_buffers(options, "cuda") == 2800
  monkeypatch.setattr(dispatch, "_oldest_cuda_capability", lambda: 6.1)
  assert dispatch._launch_buffers(options, "cuda") == 384
  assert dispatch._launch_buffers(options, "interpret") == 2800

"""Every kernel geometry the executor supports gives the reference's numbers.

The 1-D geometry (blocks of ``block_elems`` over the flattened buffer) is what
``benchmarks/tiling_variants.py`` times against the default on a GPU; here it runs in
interpret mode and through the cuda export.
"""

import jax
import pytest

import optirs_jax
from optirs_jax.pallas import kernel
from tests import cases
from tests.test_lowering import cuda_triton_calls

GEOMETRIES = {"2d-r8": kernel.Tiling(8), "1d-4096": kernel.Tiling(32, num_warps=8, flat=True),
              "1d-1024": kernel.Tiling(8, flat=True)}


@pytest.fixture(params=sorted(GEOMETRIES))
def geometry(request, monkeypatch):
  tiling = GEOMETRIES[request.param]
  monkeypatch.setitem(kernel.TILINGS, "interpret", tiling)
  monkeypatch.setitem(kernel.TILINGS, "cuda", tiling)
  return tiling


@pytest.mark.parametrize("name", ["adam", "lamb", "rmsprop"])
def test_geometry_matches_reference(geometry, name):
  params = cases.ragged_tree(0) | {"ragged_big": jax.random.normal(jax.random.PRNGKey(9),
                                                                   (64 * 33 + 1, 128))}
  cases.pallas_matches_jnp(name, params)


def test_geometry_lowers_to_triton(geometry, standard_promotion):
  opt = optirs_jax.lamb(1e-3)
  params = cases.ragged_tree(0)
  assert cuda_triton_calls(lambda p, s, g: optirs_jax.apply(opt, g, s, p), params,
                           opt.init(params), params) >= 1

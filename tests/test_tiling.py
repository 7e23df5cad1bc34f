"""Every kernel geometry the executor supports gives the reference's numbers.

The 1-D geometry (blocks of ``block_elems`` over the flattened buffer) is what
``benchmarks/tiling_variants.py`` times against the default on a GPU; here it runs in
interpret mode and through the cuda export.
"""

import chex
import jax
import pytest

import optirs_jax
from optirs_jax.pallas import kernel
from tests import cases
from tests.test_lowering import TRITON, abstract_target

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
  grads = jax.tree.map(lambda x: 0.5 * x + 0.1, params)
  ours = getattr(optirs_jax, name)(1e-2, backend="pallas")
  ref = getattr(optirs_jax, name)(1e-2, backend="jnp")
  u, s = jax.jit(ours.update)(grads, ours.init(params), params)
  ru, rs = jax.jit(ref.update)(grads, ref.init(params), params)
  chex.assert_trees_all_close(u, ru, rtol=1e-6, atol=1e-9)
  chex.assert_trees_all_close(s, rs, rtol=1e-6, atol=1e-9)


def test_geometry_lowers_to_triton(geometry, standard_promotion):
  opt = optirs_jax.lamb(1e-3)
  params = cases.ragged_tree(0)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        (params, opt.init(params), params))
  with abstract_target("NVIDIA H200", "cuda"):
    exp = jax.export.export(
        jax.jit(lambda g, s, p: optirs_jax.apply(opt, g, s, p)), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*shapes)
  assert TRITON in exp.mlir_module()

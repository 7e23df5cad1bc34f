"""The Mosaic GPU kernels (``ExecutorOptions(gpu_kernels="mosaic_gpu")``).

On a CPU machine: the option's checks, and (jax >= 0.11) the cuda export of every
elementwise optimizer carrying Mosaic GPU calls and no Triton call, while LAMB (per-leaf
norms) stays on Triton. On a GPU: the kernels run and match optax, on the update path and
the fused apply, one thread block per block and persistent thread blocks.
"""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optirs_jax
from optirs_jax import ExecutorOptions, Tiling
from optirs_jax import mixed_precision as mp
from optirs_jax.pallas import mosaic_gpu
from optirs_jax.pallas.options import MOSAIC_GPU_MIN_JAX
from tests import cases
from tests.test_lowering import TRITON, abstract_target

ELEMENTWISE = cases.ELEMENTWISE
KW = dict(cases.TYPICAL)
NEW_JAX = jax.__version_info__ >= MOSAIC_GPU_MIN_JAX
needs_new_jax = pytest.mark.skipif(
    not NEW_JAX, reason=f"Mosaic GPU lowers sqrt from jax {MOSAIC_GPU_MIN_JAX} on; this is "
    f"jax {jax.__version__} (the option is refused, tested below)")
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu",
                            reason="needs a CUDA GPU (Mosaic GPU has no CPU interpret mode)")
# One thread block per block, and 132 persistent thread blocks of 3 blocks in flight.
TILINGS = {"per-block": Tiling(block_rows=32, num_stages=2),
           "persistent": Tiling(block_rows=16, num_stages=3, programs=132)}


def options(tiling="per-block", **kw):
  return ExecutorOptions(gpu_kernels="mosaic_gpu", mosaic_gpu_tiling=TILINGS[tiling], **kw)


@pytest.mark.parametrize("kwargs, match", [
    ({"gpu_kernels": "cutlass"}, r"gpu_kernels='cutlass' is not one of \('triton', "
                                 r"'mosaic_gpu'\)"),
    ({"mosaic_gpu_tiling": Tiling(block_rows=512)}, "at most 256 rows"),
    ({"mosaic_gpu_tiling": Tiling(block_rows=8, flat=True)}, "at most 256 rows"),
])
def test_bad_mosaic_gpu_options_are_rejected(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ExecutorOptions(**kwargs)
  with pytest.raises(ValueError, match=r"programs=0 must be a positive int"):
    Tiling(block_rows=8, programs=0)


@pytest.mark.skipif(NEW_JAX, reason="the option runs on this jax")
def test_mosaic_gpu_on_old_jax_is_refused_with_the_version():
  with pytest.raises(ValueError, match=rf"needs jax >= 0.11 .* this is jax {jax.__version__}"):
    ExecutorOptions(gpu_kernels="mosaic_gpu")


def test_geometry_gives_equal_runs_of_whole_blocks():
  g = mosaic_gpu.geometry(10 * 32, 7 * 512, block_rows=32, stages=2, programs=132)
  assert g == (32, 10, 1, 1) and g.covered_rows == 320  # one block each: one in flight
  g = mosaic_gpu.geometry(1000 * 16 + 5, 7 * 512, block_rows=16, stages=3, programs=132)
  assert g == (16, 132, 7, 3) and g.covered_rows == 132 * 7 * 16  # 76 blocks + 5 rows left
  assert mosaic_gpu.geometry(5 * 8, 512, block_rows=8, stages=9, programs=None) == (8, 5, 1, 1)
  assert mosaic_gpu.geometry(7, 512, block_rows=8, stages=2, programs=None).covered_rows == 0


def test_geometry_fits_the_blocks_in_flight_in_shared_memory():
  # Adam's fused apply in float32: 7 operands, 3584 bytes a row; 227 KB hold 64 rows.
  row = 7 * 128 * 4
  assert mosaic_gpu.geometry(1 << 16, row, block_rows=32, stages=2, programs=132) == (
      32, 132, 15, 2)
  assert mosaic_gpu.geometry(1 << 16, row, block_rows=32, stages=4, programs=132).stages == 2
  assert mosaic_gpu.geometry(1 << 16, row, block_rows=256, stages=2, programs=None)[0] == 64
  g = mosaic_gpu.geometry(1 << 16, row, block_rows=128, stages=3, programs=132)
  assert g.block_rows * row * g.stages <= mosaic_gpu.SMEM_BYTES and g.block_rows == 64


def _export(name, opts, params, fused):
  opt = getattr(optirs_jax, name)(1e-3, **KW.get(name, {}), executor_options=opts)

  def step(p, s, g):
    if fused:
      return optirs_jax.apply(opt, g, s, p)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        (params, opt.init(params), params))
  with abstract_target("NVIDIA H200", "cuda"):
    exp = jax.export.export(jax.jit(step), platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(TRITON),
        jax.export.DisabledSafetyCheck.custom_call(mosaic_gpu.CUSTOM_CALL_TARGET)])(*shapes)
  text = exp.mlir_module()
  return text.count(mosaic_gpu.CUSTOM_CALL_TARGET), text.count(TRITON)


@needs_new_jax
@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize("tiling", list(TILINGS))
def test_cuda_export_runs_elementwise_optimizers_on_mosaic_gpu(name, tiling):
  # The ragged tree's leaves are packed per dtype (one launch for its float32 leaves).
  mosaic, triton = _export(name, options(tiling), cases.ragged_tree(0), fused=True)
  assert mosaic >= 1 and triton == 0


@needs_new_jax
@pytest.mark.parametrize("name", ["adamw", "rmsprop"])
def test_tilings_past_shared_memory_are_fitted_at_lowering(name):
  # Unfitted, 256-row float32 blocks x 4 stages of 7 (AdamW) or 9 (centered RMSprop with
  # momentum) operands would ask Mosaic GPU for 3.5-4.5 MB of shared memory.
  opts = ExecutorOptions(gpu_kernels="mosaic_gpu", mosaic_gpu_tiling=Tiling(
      block_rows=256, num_stages=4, programs=132))
  mosaic, triton = _export(name, opts, cases.ragged_tree(0, shapes=BIG), fused=True)
  assert mosaic >= 1 and triton == 0


@needs_new_jax
def test_the_loss_scaling_guard_runs_on_mosaic_gpu():
  # The non-finite step's guard selects with a scalar: Mosaic GPU needs it broadcast.
  tx = mp.with_loss_scaling(mp.master_weights(optirs_jax.adamw(1e-3, executor_options=options())))
  params = cases.ragged_tree(0, jnp.bfloat16, BIG)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        (params, tx.init(params), params))
  with abstract_target("NVIDIA H200", "cuda"):
    exp = jax.export.export(jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p)),
                            platforms=["cuda"], disabled_checks=[
        jax.export.DisabledSafetyCheck.custom_call(TRITON),
        jax.export.DisabledSafetyCheck.custom_call(mosaic_gpu.CUSTOM_CALL_TARGET)])(*shapes)
  assert exp.mlir_module().count(mosaic_gpu.CUSTOM_CALL_TARGET) >= 1


@needs_new_jax
def test_lamb_stays_on_triton_and_the_default_is_triton():
  params = cases.ragged_tree(0)
  mosaic, triton = _export("lamb", options(), params, fused=True)
  assert mosaic == 0 and triton >= 1
  mosaic, triton = _export("adam", ExecutorOptions(), params, fused=True)
  assert mosaic == 0 and triton >= 1


BIG = {"emb": (50257, 64), "aligned": (1024, 1024), "w": (768, 3072), "b": (768,), "s": (),
       "odd": (7, 13), "h": (300, 128)}


@on_gpu
@needs_new_jax
@pytest.mark.parametrize("name", ELEMENTWISE)
@pytest.mark.parametrize("tiling", list(TILINGS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_mosaic_gpu_matches_optax(name, tiling, dtype):
  """Three steps of updates and of the fused apply's params against optax's: float32 at
  parity's tolerances (the fused apply's of tests/test_apply.py: near-zero params after
  cancellation differ by an ulp of the operands); bfloat16 updates within 4 ulps (the
  kernels compute in float32 and round once, optax rounds each op: tests/test_dtypes.py),
  and one bfloat16 fused apply against optax's float32 step rounded once."""
  kw = KW.get(name, {})
  ours = getattr(optirs_jax, name)(1e-3, **kw, backend="pallas", executor_options=options(tiling))
  ref = getattr(optax, name)(1e-3, **kw)
  params, grads = cases.ragged_tree(0, dtype, BIG), cases.ragged_tree(1, dtype, BIG)
  apply = jax.jit(lambda g, s, p: optirs_jax.apply(ours, g, s, p))
  with jax.numpy_dtype_promotion("standard"):
    s, rs, p, ps, rp, rps = ours.init(params), ref.init(params), params, ours.init(params), \
        params, ref.init(params)
    for _ in range(3):
      u, s = jax.jit(ours.update)(grads, s, params)
      ru, rs = jax.jit(ref.update)(grads, rs, params)
      p, ps = apply(grads, ps, p)
      rstep, rps = jax.jit(ref.update)(grads, rps, rp)
      rp = optax.apply_updates(rp, rstep)
  chex.assert_trees_all_equal_dtypes(u, ru)
  chex.assert_trees_all_equal_dtypes(p, rp)
  if dtype == jnp.float32:
    chex.assert_trees_all_close(u, ru, rtol=1e-6, atol=1e-9)
    chex.assert_trees_all_close(p, rp, rtol=1e-6, atol=1e-7)
    return
  eps = float(jnp.finfo(dtype).eps)
  chex.assert_trees_all_close(u, ru, rtol=4 * eps, atol=1e-6)
  up = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
  p1, _ = apply(grads, ours.init(params), params)
  with jax.numpy_dtype_promotion("standard"):
    want, _ = ref.update(up(grads), ref.init(up(params)), up(params))
  want = jax.tree.map(lambda a, b: (a + b).astype(dtype), up(params), want)
  chex.assert_trees_all_close(up(p1), up(want), rtol=eps, atol=1e-6)


@on_gpu
@needs_new_jax
def test_compiled_step_holds_mosaic_gpu_calls():
  opt = optirs_jax.adam(1e-3, executor_options=options())
  params = cases.ragged_tree(0, shapes=BIG)
  step = jax.jit(lambda g, s, p: optirs_jax.apply(opt, g, s, p))
  text = step.lower(params, opt.init(params), params).compile().as_text()
  assert "mosaic_gpu" in text and "triton" not in text.lower()

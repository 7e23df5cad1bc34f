"""Half precision, mixed accumulator dtypes and complex parameters, against optax."""

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import optirs_jax
from optirs_jax.transforms import REGISTRY
from tests import cases

HALF = [jnp.bfloat16, jnp.float16]
BACKENDS = ["jnp", "pallas"]
SIMPLE = cases.TYPICAL


def _run(ours, ref, params, grads, steps=3):
  s, rs = ours.init(params), ref.init(params)
  for _ in range(steps):
    u, s = jax.jit(ours.update)(grads, s, params)
    with jax.numpy_dtype_promotion("standard"):
      ru, rs = jax.jit(ref.update)(grads, rs, params)
  return u, s, ru, rs


# On the kernels float16 (compared on one step, below) runs on the core optimizers; bfloat16
# (several steps) on every optimizer, and both on the reference.
HALF_CASES = [(case, dtype, backend) for backend in BACKENDS for dtype in HALF
              for case in SIMPLE
              if backend == "jnp" or dtype == jnp.bfloat16 or case[0] in cases.CORE]


@pytest.mark.parametrize("case, dtype, backend", HALF_CASES,
                         ids=[f"{cases.case_id(c)}-{jnp.dtype(d).name}-{b}"
                              for c, d, b in HALF_CASES])
def test_half_precision_params(case, dtype, backend):
  """Updates keep the gradients' dtype and state dtypes are stable, as in optax.

  The reference repeats optax's half-precision arithmetic bit for bit. The kernels compute
  in float32 and round once on store: one step is float32 math rounded to the half type,
  and over several bfloat16 steps they stay within a few ulps of optax. (optax's float16
  moments fall into subnormals, e.g. 0.001 * g**2, so float16 is compared on one step.)
  """
  name, kw = case
  ours, ref = cases.pair(name, kw, backend)
  params, grads = cases.ragged_tree(0, dtype), cases.ragged_tree(1, dtype)
  u, s, ru, rs = _run(ours, ref, params, grads)
  chex.assert_trees_all_equal_dtypes(u, ru)
  chex.assert_trees_all_equal_dtypes(u, grads)
  chex.assert_trees_all_equal_dtypes(s, ours.init(params))  # stable across steps
  eps = float(jnp.finfo(dtype).eps)
  if backend == "jnp" and REGISTRY[name].norms and jax.default_backend() == "gpu":
    # XLA on a GPU sums per-leaf norms in an order that depends on the program's fusions:
    # the two programs' trust ratios part in their last bit (of the half type's norm).
    chex.assert_trees_all_close(u, ru, rtol=2 * eps, atol=0)
  elif backend == "jnp":
    chex.assert_trees_all_close(u, ru, rtol=0, atol=0)
  elif dtype == jnp.bfloat16 and not name.startswith("optimistic") and name not in (
      "novograd", "adafactor"):
    # (Optimistic steps are (alpha + beta) d_t - beta d_{t-1}, NovoGrad's g / |g| + wd p,
    # Adafactor's bfloat16 momentum plus wd p: where the terms cancel, optax's bfloat16 sums
    # and the kernel's float32 ones part by more than a few ulps; the one step below,
    # against float32, still holds.)
    chex.assert_trees_all_close(u, ru, rtol=4 * eps, atol=1e-6)
  if backend == "jnp":
    return
  if name == "yogi" and dtype == jnp.float16:
    return  # its moments start at 1e-6, which float16 rounds: float32 optax starts elsewhere
  if name in cases.NOISY:
    return  # the noise is drawn in the gradients' dtype: float32 optax draws other numbers
  up = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
  u1, _ = jax.jit(ours.update)(grads, ours.init(params), params)
  with jax.numpy_dtype_promotion("standard"):
    ref32 = getattr(__import__("optax"), name)(1e-2, **kw)
    want, _ = ref32.update(up(grads), ref32.init(up(params)), up(params))
    fac = REGISTRY[name].spec.factored
    if fac is not None:  # factored leaves run optax's half-precision arithmetic, in XLA
      half, _ = jax.jit(ref.update)(grads, ref.init(params), params)
      options = {"factored": True, "min_dim_size_to_factor": 128, **kw}
      want = {k: up(half[k]) if fac.dims(options, x.shape) else want[k]
              for k, x in params.items()}
  # A trust ratio (LAMB's, Fromage's) is applied in the half type.
  tol = 4 * eps if REGISTRY[name].norms else eps
  chex.assert_trees_all_close(up(u1), up(jax.tree.map(lambda x: x.astype(dtype), want)),
                              rtol=tol, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mu_dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
def test_adam_mu_dtype(mu_dtype, backend, standard_promotion):
  ours, ref = cases.pair("adam", {"mu_dtype": mu_dtype}, backend)
  params, grads = cases.ragged_tree(0), cases.ragged_tree(1)
  u, s, ru, rs = _run(ours, ref, params, grads)
  assert all(m.dtype == mu_dtype for m in jax.tree.leaves(s.mu))
  assert all(v.dtype == jnp.float32 for v in jax.tree.leaves(s.nu))
  chex.assert_trees_all_equal_dtypes(u, ru)
  # bf16 moments: the kernel rounds once where optax rounds each op (one bf16 ulp apart).
  tol = 2 * float(jnp.finfo(mu_dtype).eps) if backend == "pallas" else 0.0
  chex.assert_trees_all_close(u, ru, rtol=tol, atol=1e-5 if tol else 0.0)
  chex.assert_trees_all_close(s.mu, rs[0].mu, rtol=tol, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_accumulator_dtype(backend, standard_promotion):
  ours, ref = cases.pair("sgd", {"momentum": 0.9, "accumulator_dtype": jnp.bfloat16}, backend)
  params, grads = cases.ragged_tree(0), cases.ragged_tree(1)
  u, s, ru, rs = _run(ours, ref, params, grads)
  assert all(t.dtype == jnp.bfloat16 for t in jax.tree.leaves(s.trace))
  chex.assert_trees_all_equal_dtypes(u, ru)
  chex.assert_trees_all_close(u, ru, rtol=1e-2 if backend == "pallas" else 0, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", SIMPLE, ids=cases.case_id)
def test_complex64_params(case, backend, standard_promotion):
  """Complex leaves run on the reference (also under ``backend='pallas'``)."""
  name, kw = case
  if not REGISTRY[name].complex:
    pytest.skip(f"{name} does not support complex parameters (as in optax)")
  ours, ref = cases.pair(name, kw, backend)
  params = jax.tree.map(lambda x: jax.lax.complex(x, 0.5 * jnp.flip(x)), cases.ragged_tree(0))
  grads = jax.tree.map(lambda x: jax.lax.complex(x, -0.25 * x), cases.ragged_tree(1))
  u, s, ru, rs = _run(ours, ref, params, grads)
  chex.assert_trees_all_equal_dtypes(u, ru)
  # On a GPU XLA sums per-leaf norms in an order that depends on the program's fusions.
  rtol = 1e-6 if REGISTRY[name].norms and jax.default_backend() == "gpu" else 0
  chex.assert_trees_all_close(u, ru, rtol=rtol, atol=0)


def test_mixed_real_and_complex_tree_on_pallas(standard_promotion):
  ours, ref = cases.pair("adam", {}, "pallas")
  params = {"r": jnp.linspace(-1.0, 1.0, 300),
            "c": jax.lax.complex(jnp.ones(5), jnp.full(5, 2.0))}
  grads = jax.tree.map(lambda x: x * 0.1, params)
  u, _, ru, _ = _run(ours, ref, params, grads)
  chex.assert_trees_all_close(u, ru, rtol=1e-6, atol=1e-9)


def test_float64_params_with_x64_on_the_reference():
  with jax.enable_x64(True):
    ours, ref = cases.pair("adam", {}, "auto")
    params = {"w": jnp.linspace(-1.0, 1.0, 50, dtype=jnp.float64)}
    u, _, ru, _ = _run(ours, ref, params, params)
    assert u["w"].dtype == jnp.float64
    chex.assert_trees_all_close(u, ru, rtol=0, atol=0)


def test_lamb_on_float64_and_float32_leaves_with_x64():
  # The second pass gets the norms of both leaves in one array (float64, the wider): the
  # float32 leaf's norms convert back exactly, the float64 leaf's stay float64 (on a GPU
  # the float32 leaf runs on the Triton kernel: parity's tolerance).
  with jax.enable_x64(True):
    ours, ref = cases.pair("lamb", {"weight_decay": 0.01}, "auto")
    params = {"a": jnp.linspace(-1.0, 1.0, 50, dtype=jnp.float64),
              "b": jnp.linspace(-2.0, 1.0, 70, dtype=jnp.float32)}
    u, _, ru, _ = _run(ours, ref, params, jax.tree.map(lambda x: 0.5 * x, params))
    assert (u["a"].dtype, u["b"].dtype) == (jnp.float64, jnp.float32)
    exact = jax.default_backend() == "cpu"
    chex.assert_trees_all_close(u, ru, rtol=0 if exact else 1e-6, atol=0 if exact else 1e-9)


@pytest.mark.parametrize("name", ["lamb", "adam"])
def test_kernels_under_x64(name):
  # With x64 on, Python and jnp integers default to int64: the kernels (interpret mode
  # here, Triton on a GPU) and the per-leaf totals index in int32 all the same.
  with jax.enable_x64(True):
    ours, ref = cases.pair(name, {}, "pallas")
    params = {"a": jnp.linspace(-1.0, 1.0, 3000, dtype=jnp.float32),
              "b": jnp.linspace(-2.0, 1.0, 70, dtype=jnp.float32).reshape(7, 10)}
    u, _, ru, _ = _run(ours, ref, params, jax.tree.map(lambda x: 0.5 * x, params))
    chex.assert_trees_all_close(u, ru, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params_dtype, grads_dtype", [(jnp.float32, jnp.bfloat16),
                                                       (jnp.bfloat16, jnp.float32)],
                         ids=["f32-params-bf16-grads", "bf16-params-f32-grads"])
@pytest.mark.parametrize("name", ["lamb", "adam", "sgd"])
def test_params_and_grads_of_different_dtypes_match_optax(name, params_dtype, grads_dtype,
                                                          backend, standard_promotion):
  """Mixed dtypes promote op by op as in optax (weak Python-float hyper-parameters
  included); the kernels hand such leaves to the reference, so every executor matches, and
  the fused apply equals update + apply_updates. (One step: optax's state then drifts to
  the wider dtype, where optirs_jax keeps the state's dtype from init.)"""
  kw = {"momentum": 0.9} if name == "sgd" else {}
  ours, ref = cases.pair(name, kw, backend)
  params, grads = cases.ragged_tree(0, params_dtype), cases.ragged_tree(1, grads_dtype)
  u, s, ru, rs = _run(ours, ref, params, grads, steps=1)
  chex.assert_trees_all_equal_dtypes(s, ours.init(params))
  chex.assert_trees_all_equal_dtypes(u, ru)
  rtol = 0
  if name == "lamb" and jax.default_backend() == "gpu":
    # XLA on a GPU sums LAMB's norms in an order that depends on the program's fusions: the
    # two programs' norms differ in their last bit (of a bfloat16 norm: 2^-8 relative).
    rtol = 8e-3 if params_dtype == jnp.bfloat16 else 1e-6
  chex.assert_trees_all_close(u, ru, rtol=rtol, atol=0)
  p, _ = jax.jit(lambda g, s, p: optirs_jax.apply(ours, g, s, p))(grads, ours.init(params),
                                                                   params)
  u1, _ = jax.jit(ours.update)(grads, ours.init(params), params)
  chex.assert_trees_all_close(p, optax.apply_updates(params, u1), rtol=1e-6, atol=1e-6)

"""8-bit Adam's "fp8" state format against its definition written out in numpy (ml_dtypes'
float8_e4m3fn, round to nearest even): each block of 256 elements times float32(1 / its
absmax), times 448, stored as float8_e4m3fn (torchao's AdamWFp8 format)."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optirs_jax
from optirs_jax.quantization import (
  Quantized8bit,
  adam8bit,
  adamw8bit,
  quantize_blockwise,
  state_nbytes,
)
from tests.states import assert_quantized_close

F8 = ml_dtypes.float8_e4m3fn


def _np_fp8(x: np.ndarray, block: int):
  """(codes as float8_e4m3fn, absmax [..., blocks], the values they stand for)."""
  x = np.asarray(x, np.float32)
  codes = np.empty(x.shape, F8)
  values = np.empty_like(x)
  starts = range(0, x.shape[-1], block)
  absmax = np.zeros((*x.shape[:-1], len(starts)), np.float32)
  for j, start in enumerate(starts):
    blk = x[..., start:start + block]
    m = np.abs(blk).max(axis=-1, keepdims=True)
    inv = np.float32(1) / np.where(m >= np.finfo(np.float32).tiny, m, np.float32(1))
    c = ((blk * inv) * np.float32(448)).astype(F8)
    codes[..., start:start + block] = c
    values[..., start:start + block] = c.astype(np.float32) * np.float32(1 / 448) * m
    absmax[..., j] = m[..., 0]
  return codes, absmax, values


@pytest.mark.parametrize("shape", [(5000,), (12, 300), (3, 256)])
def test_codes_and_scales_are_the_format_bit_for_bit(shape):
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(shape) * np.exp(rng.uniform(-12, 2, shape))).astype(np.float32)
  q = quantize_blockwise(jnp.asarray(x), block_size=256, state_quantization="fp8")
  codes, absmax, values = _np_fp8(x, 256)
  assert q.codes.dtype == jnp.float8_e4m3fn and q.codes.shape == x.shape
  np.testing.assert_array_equal(np.asarray(q.absmax), absmax)
  np.testing.assert_array_equal(np.asarray(q.codes).view(np.uint8), codes.view(np.uint8))
  np.testing.assert_array_equal(np.asarray(q.dequantize()), values)
  # Three mantissa bits: within 1/16 of each element's magnitude, or below the format's
  # smallest subnormal (2^-9 of the block's absmax over 448) for the tiniest.
  assert np.all(np.abs(values - x) <= np.abs(x) / 16 + absmax.max() * 2.0**-9 / 448)


def _np_step(p, g, mu, nu, t, *, lr, b1, b2, eps, wd, decoupled):
  g = g + (0 if decoupled else wd * p)
  mu = b1 * mu + (1 - b1) * g
  nu = b2 * nu + (1 - b2) * g * g
  u = (mu / (1 - b1**t)) / (np.sqrt(nu / (1 - b2**t)) + eps)
  u = -lr * (u + (wd * p if decoupled else 0))
  return p + u, _np_fp8(mu, 256)[2], _np_fp8(nu, 256)[2]


def _moment(state, field, key):
  q = getattr(state, field)
  return np.asarray(Quantized8bit(q.codes[key], q.absmax[key]).dequantize())


@pytest.mark.parametrize("decoupled, wd", [(False, 0.01), (True, 0.05)])
@pytest.mark.parametrize("shape", [(16, 512), (33, 257)])
def test_steps_match_numpy_reference(decoupled, wd, shape):
  make = adamw8bit if decoupled else adam8bit
  tx = make(1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=wd, min_8bit_size=1024,
            state_quantization="fp8")
  rng = np.random.default_rng(1)
  params = {"w": jnp.asarray(rng.standard_normal(shape), jnp.float32)}
  state = tx.init(params)
  assert state.mu.codes["w"].dtype == state.nu.codes["w"].dtype == jnp.float8_e4m3fn
  for t in range(1, 6):
    g = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 1)).astype(np.float32)
    p0, mu0, nu0 = np.asarray(params["w"]), _moment(state, "mu", "w"), _moment(state, "nu", "w")
    params, state = optirs_jax.apply(tx, {"w": jnp.asarray(g)}, state, params)
    p1, mu1, nu1 = _np_step(p0, g, mu0, nu0, t, lr=1e-2, b1=0.9, b2=0.99, eps=1e-8, wd=wd,
                            decoupled=decoupled)
    np.testing.assert_allclose(np.asarray(params["w"]), p1, rtol=1e-5, atol=1e-7)
    for ours, ref in ((_moment(state, "mu", "w"), mu1), (_moment(state, "nu", "w"), nu1)):
      # The moments summed in another order (a last-bit difference, the block's absmax
      # with it): the same code but where a value sits on a rounding boundary, and then
      # one code step (1/8 relative) at most.
      assert np.mean(np.isclose(ours, ref, rtol=1e-5, atol=0)) > 0.999
      np.testing.assert_allclose(ours, ref, rtol=0.13, atol=1e-12)


def test_pallas_kernel_equals_reference():
  # Interpret mode here; tests/test_cuda_compile.py compiles the Triton kernel for an H200.
  rng = np.random.default_rng(4)
  params = {"w": jnp.asarray(rng.standard_normal((19, 512)), jnp.float32)}
  grads = {"w": jnp.asarray(rng.standard_normal((19, 512)), jnp.float32)}
  out = {}
  for backend in ("jnp", "pallas"):
    tx = adamw8bit(1e-2, min_8bit_size=0, state_quantization="fp8", backend=backend)
    step = jax.jit(lambda p, s, g, tx=tx: optirs_jax.apply(tx, g, s, p))
    p, s = step(params, tx.init(params), grads)
    out[backend] = step(p, s, grads)
  # The params to float32 rounding (XLA may contract p + (-lr) * x, or c1 * g + b1 * mu, into
  # one fma in one program and not in the other). The 8-bit state exactly where the kernel
  # is interpreted (the CPU); on a GPU the moments' last bit may differ, and so an absmax's,
  # and a code at a rounding boundary by one step.
  chex.assert_trees_all_close(out["jnp"][0], out["pallas"][0], rtol=1e-6, atol=1e-9)
  if jax.default_backend() == "cpu":
    chex.assert_trees_all_equal(out["jnp"][1], out["pallas"][1])
  for field in ("mu", "nu"):  # one e4m3 step: 2^-3
    assert_quantized_close(getattr(out["jnp"][1], field), getattr(out["pallas"][1], field),
                           step_rtol=0.13)


def test_state_bytes_are_about_a_quarter_of_float32_adam(standard_promotion):
  params = {"a": jnp.zeros((67, 131)), "b": jnp.zeros((1024, 768))}
  s8 = adam8bit(1e-3, state_quantization="fp8").init(params)
  s32 = optax.adam(1e-3).init(params)
  assert state_nbytes(s8) <= 0.27 * state_nbytes(s32)


def test_an_mlp_trains_as_with_float32_state(standard_promotion):
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((512, 32)), jnp.float32)
  y = jnp.tanh(x @ jnp.asarray(rng.standard_normal((32, 1)), jnp.float32))
  params = {"w1": jnp.asarray(rng.standard_normal((32, 256)) * 0.1, jnp.float32),
            "w2": jnp.asarray(rng.standard_normal((256, 1)) * 0.1, jnp.float32)}
  loss = lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)
  finals = {}
  for name, tx in (("f32", optax.adamw(3e-3)),
                   ("fp8", adamw8bit(3e-3, min_8bit_size=0, state_quantization="fp8"))):
    p, s = params, tx.init(params)

    @jax.jit
    def step(p, s, tx=tx):
      u, s = tx.update(jax.grad(loss)(p), s, p)
      return optax.apply_updates(p, u), s

    # 200 steps: the loss falls 1800-fold (1.89 to about 1e-3). By 300 both are near 3e-5,
    # where the state's 8-bit rounding sets the floor and the gap (9% with XLA's default
    # CPU compiles, 11% with tests/conftest.py's quick ones) is that floor's, not training's.
    for _ in range(200):
      p, s = step(p, s)
    finals[name] = float(loss(p))
  assert finals["fp8"] < 0.01 * float(loss(params))  # it learned
  assert abs(finals["fp8"] - finals["f32"]) <= 0.1 * finals["f32"], finals


def test_an_unknown_format_is_named():
  with pytest.raises(ValueError, match=r"state_quantization='int4' is not one of"):
    adamw8bit(1e-3, state_quantization="int4")
  with pytest.raises(ValueError, match=r"state_quantization='fp4' is not one of"):
    quantize_blockwise(jnp.ones(4), state_quantization="fp4")



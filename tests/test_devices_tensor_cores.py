"""Device capabilities and matrix-unit planning."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optirs_jax.planning.devices import DeviceCapabilities, block_size_for
from optirs_jax.planning.tensor_cores import gemm, plan_gemm_layout, select_precision


def test_from_a_real_device_reports_only_what_jax_knows():
  caps = DeviceCapabilities.from_device(jax.devices()[0])
  assert caps.platform == jax.devices()[0].platform and caps.source == "jax.Device"
  if caps.platform == "cpu":
    assert caps.compute_capability is None and not caps.supports("bf16")


def test_presets_and_features():
  h200, t4 = DeviceCapabilities.preset("h200"), DeviceCapabilities.preset("t4")
  assert h200.supports("fp8") and h200.supports("bf16") and not t4.supports("bf16")
  assert DeviceCapabilities.preset("l4").supports("fp8")
  assert not DeviceCapabilities.preset("a100").supports("fp8")
  assert DeviceCapabilities.preset("tpu-v5e").supports("bf16")
  with pytest.raises(ValueError, match="unknown preset 'h300'"):
    DeviceCapabilities.preset("h300")
  with pytest.raises(ValueError, match="unknown feature 'fp4'"):
    h200.supports("fp4")


def test_precision_selection():
  assert select_precision(DeviceCapabilities.preset("h200"), allow_fp8=True) == "fp8"
  assert select_precision(DeviceCapabilities.preset("h200")) == "bf16"
  assert select_precision(DeviceCapabilities.preset("v100")) == "fp16"
  assert select_precision(DeviceCapabilities.preset("tpu-v5e")) == "bf16"
  assert select_precision(DeviceCapabilities.preset("a100"), need_fp32_accuracy=True) == "fp32"


@pytest.mark.parametrize("mnk, precision, platform, padded", [
    ((1000, 1000, 1000), "bf16", "gpu", (1000, 1000, 1000)),
    ((1001, 30, 7), "bf16", "gpu", (1008, 32, 8)),
    ((1001, 30, 7), "fp8", "gpu", (1008, 32, 16)),
    ((1001, 30, 7), "tf32", "gpu", (1004, 32, 8)),
    ((100, 100, 100), "bf16", "tpu", (112, 128, 128)),
    ((100, 100, 100), "fp32", "tpu", (104, 128, 128)),
])
def test_gemm_layout_padding(mnk, precision, platform, padded):
  plan = plan_gemm_layout(*mnk, precision, platform=platform)
  assert plan.padded == padded
  m, n, k = mnk
  assert plan.flop_overhead == pytest.approx(np.prod(padded) / (m * n * k) - 1)


def test_gemm_layout_errors():
  with pytest.raises(ValueError, match="k=0 must be positive"):
    plan_gemm_layout(1, 1, 0, "bf16")
  with pytest.raises(ValueError, match="unknown precision 'fp64'"):
    plan_gemm_layout(1, 1, 1, "fp64")
  with pytest.raises(ValueError, match="not a TPU matrix-unit type"):
    plan_gemm_layout(8, 8, 8, "fp8", platform="tpu")


@pytest.mark.parametrize("precision, tol", [("fp32", 1e-5), ("bf16", 2e-2), ("fp16", 2e-3)])
def test_gemm_accumulates_in_float32(precision, tol):
  ka, kb = jax.random.split(jax.random.PRNGKey(0))
  a, b = jax.random.normal(ka, (64, 96)), jax.random.normal(kb, (96, 32))
  out = gemm(a, b, precision)
  assert out.dtype == jnp.float32 and out.shape == (64, 32)
  ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
  assert np.linalg.norm(np.asarray(out) - ref) / np.linalg.norm(ref) < tol
  with pytest.raises(ValueError, match="need a"):
    gemm(a, a, precision)


def test_block_size_for():
  assert block_size_for(1) == 32 and block_size_for(1000) == 1024 and block_size_for(100) == 128
  with pytest.raises(ValueError):
    block_size_for(0)

"""Strict test configuration: several fake CPU devices, strict dtype and rank promotion.

Set before jax initialises its backends, so every test sees 4 CPU devices.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_report_header(config):
  return (f"jax {jax.__version__}, default backend {jax.default_backend()}, "
          f"{jax.device_count()} devices: {jax.devices()[0].device_kind}")


@pytest.fixture
def standard_promotion():
  """For tests whose optax reference itself mixes dtypes (e.g. mu_dtype != params dtype)."""
  with jax.numpy_dtype_promotion("standard"):
    yield


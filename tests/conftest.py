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


def pytest_collection_modifyitems(config, items):
  """With ``OPTIRS_TEST_SHARD=i/n`` in the environment, only every ``n``-th collected test
  from the ``i``-th on runs (tests/test_multi_device.py splits its 8-device child so)."""
  shard = os.environ.get("OPTIRS_TEST_SHARD")
  if not shard:
    return
  i, n = (int(x) for x in shard.split("/"))
  if not 0 <= i < n:
    raise ValueError(f"OPTIRS_TEST_SHARD={shard!r}: need i/n with 0 <= i < n")
  kept = items[i::n]
  config.hook.pytest_deselected(items=[x for x in items if x not in kept])
  items[:] = kept


def pytest_report_header(config):
  return (f"jax {jax.__version__}, default backend {jax.default_backend()}, "
          f"{jax.device_count()} devices: {jax.devices()[0].device_kind}")


@pytest.fixture
def standard_promotion():
  """For tests whose optax reference itself mixes dtypes (e.g. mu_dtype != params dtype)."""
  with jax.numpy_dtype_promotion("standard"):
    yield


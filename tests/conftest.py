"""Strict test configuration: several fake CPU devices, quick CPU compiles, strict dtype and
rank promotion.

Set before jax initialises its backends, so every test sees 4 CPU devices. The suite's time
is mostly XLA compiling small CPU programs: LLVM's cheaper passes compile them about a third
faster (tests/test_parity.py's one-step cases: 51 s -> 34 s). Every test compares programs
compiled under the same flags (optax's reference included) within tolerances that already
allow an fma contracted in one program and not in another. Where a GPU plugin is installed
(the GPU machine, and CI's compile-only stage) the compilers keep their defaults; a flag
already in ``XLA_FLAGS`` wins.
"""

import importlib.util
import os

QUICK_CPU_COMPILES = {"xla_backend_optimization_level": "0",
                      "xla_llvm_disable_expensive_passes": "true"}

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its package is not
    return False


_gpu_plugin = any(_installed(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
for flag, value in ({} if _gpu_plugin else QUICK_CPU_COMPILES).items():
  if flag not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += f" --{flag}={value}"

import jax  # noqa: E402  (after XLA_FLAGS is set)
import pytest  # noqa: E402

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


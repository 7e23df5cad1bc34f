"""Runs tests/multi_device_cases.py on 8 CPU devices, in a process of its own (the device
count is fixed when jax starts; this process has 4)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


SHARDS = 4  # children, each every 4th case: pytest-xdist's workers share them out


@pytest.mark.parametrize("shard", range(SHARDS))
def test_multi_device_cases_on_8_cpu_devices(shard):
  # Without the plugins the suite does not use: with pytest-xdist and pytest-benchmark
  # installed (the GPU machine), the child stopped at startup with an INTERNALERROR.
  # This process's XLA flags (tests/conftest.py's quick compiles) with 8 devices.
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                 os.environ.get("XLA_FLAGS", ""))
  env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", OPTIRS_TEST_SHARD=f"{shard}/{SHARDS}")
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
       "-p", "no:benchmark", "-x",
       str(HERE / "multi_device_cases.py")],
      cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=3000)
  tail = (proc.stdout + proc.stderr)[-6000:]
  assert proc.returncode == 0, tail
  summary = [line for line in tail.splitlines() if " passed" in line][-1]
  # The shard's cases ran (the module holds over 200), none skipped.
  assert int(re.search(r"(\d+) passed", summary).group(1)) >= 200 // SHARDS, summary
  assert "skipped" not in summary and "failed" not in summary, summary

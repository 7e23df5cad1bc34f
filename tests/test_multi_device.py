"""Runs tests/multi_device_cases.py on 8 CPU devices, in a process of its own (the device
count is fixed when jax starts; this process has 4)."""

import os
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_multi_device_cases_on_8_cpu_devices():
  # Without the plugins the suite does not use: with pytest-xdist and pytest-benchmark
  # installed (the GPU machine), the child stopped at startup with an INTERNALERROR.
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
       "-p", "no:benchmark", "-x",
       str(HERE / "multi_device_cases.py")],
      cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=3000)
  tail = (proc.stdout + proc.stderr)[-6000:]
  assert proc.returncode == 0, tail
  summary = [line for line in tail.splitlines() if " passed" in line][-1]
  assert int(re.search(r"(\d+) passed", summary).group(1)) >= 100, summary  # the cases ran
  assert "skipped" not in summary and "failed" not in summary, summary

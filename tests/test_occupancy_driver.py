"""The occupancy model against the CUDA driver's own answers, recorded on an H200.

``benchmarks/results/2026-12-02-h200-occupancy-driver.json`` holds what
``cuOccupancyMaxActiveBlocksPerMultiprocessor`` and ``cuOccupancyMaxPotentialBlockSize``
returned (driver 580.159.04, sm_90, 2026-12-02) for real PTX kernels built by
``benchmarks/occupancy_vs_driver.py``; each row is replayed here on CPU.
"""

import json
import pathlib

import pytest

from optirs_jax.planning.occupancy import (
  KernelResourceUsage,
  SmResourceLimits,
  best_block_size,
  calculate_occupancy,
  carveout_from_percent,
)

RECORD = (pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
          / "2026-12-02-h200-occupancy-driver.json")


@pytest.fixture(scope="module")
def record():
  return json.loads(RECORD.read_text())


def test_the_record_covers_every_limiting_factor(record):
  limits = SmResourceLimits.for_compute_capability(*record["compute_capability"])
  cols = record["columns"]
  factors = set()
  for row in record["rows"]:
    c = dict(zip(cols, row))
    r = calculate_occupancy(
        KernelResourceUsage(c["registers"], c["static_smem"] + c["dynamic_smem"], c["block"]),
        limits, carveout_bytes=carveout_from_percent(c["carveout_pct"], limits))
    if r.active_blocks_per_sm:
      factors.add(r.limiting_factor)
  assert factors == {"registers", "shared_memory", "warps", "blocks"}
  assert len(record["rows"]) > 10_000
  assert any(dict(zip(cols, row))["driver_blocks"] == 0 for row in record["rows"])


def test_blocks_per_sm_equal_the_drivers_on_every_recorded_case(record):
  limits = SmResourceLimits.for_compute_capability(*record["compute_capability"])
  cols = record["columns"]
  differ = []
  for row in record["rows"]:
    c = dict(zip(cols, row))
    r = calculate_occupancy(
        KernelResourceUsage(c["registers"], c["static_smem"] + c["dynamic_smem"], c["block"]),
        limits, carveout_bytes=carveout_from_percent(c["carveout_pct"], limits))
    if r.active_blocks_per_sm != c["driver_blocks"]:
      differ.append((c, r.active_blocks_per_sm))
  assert not differ, f"{len(differ)} cases differ, e.g. {differ[:3]}"


def test_best_block_size_equals_the_drivers_potential_block_size(record):
  limits = SmResourceLimits.for_compute_capability(*record["compute_capability"])
  for case in record["potential"]:
    size, _ = best_block_size(case["registers"], limits,
                              shared_mem_per_block_bytes=case["smem"])
    assert size == case["driver_block"], case


def test_a_carveout_percent_outside_0_to_100_is_an_error():
  with pytest.raises(ValueError, match="percent=101"):
    carveout_from_percent(101, SmResourceLimits.sm_90())

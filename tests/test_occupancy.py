"""Occupancy against hand-worked driver answers (cuda_occupancy.h rules)."""

import pytest

from optirs_jax.planning.occupancy import (
  KernelResourceUsage,
  SmResourceLimits,
  best_block_size,
  calculate_occupancy,
)

SM80, SM90 = SmResourceLimits.sm_80(), SmResourceLimits.sm_90()


@pytest.mark.parametrize("regs, smem, threads, limits, blocks, factor", [
    (32, 0, 256, SM80, 8, "warps"),          # 8 warps x 8 blocks = 64 warps
    (64, 0, 256, SM80, 4, "registers"),      # 2048 regs/warp: 32 warps fit
    (255, 0, 256, SM80, 1, "registers"),     # 8192 regs/warp x 8 warps = 65536: just fits
    (255, 0, 128, SM80, 2, "registers"),     # 16384 per sub-partition: 2 warps each, 8 in all
    (255, 0, 288, SM80, 0, "registers"),     # 9 warps x 8192 > 65536: cannot launch
    (40, 0, 96, SM80, 16, "registers"),      # 1280 regs/warp: 12 per sub-partition, 48 warps
    (32, 48 * 1024, 128, SM80, 3, "shared_memory"),   # (48K + 1K) -> 3 in 164K
    (32, 163 * 1024, 128, SM80, 1, "shared_memory"),  # the opt-in maximum: one block
    (32, 164 * 1024, 128, SM80, 0, "shared_memory"),  # over the opt-in maximum
    (32, 0, 32, SM80, 32, "blocks"),         # one warp per block: the 32-block limit
    (32, 0, 1025, SM80, 0, "warps"),         # more than 1024 threads cannot launch
    (32, 100 * 1024, 256, SM90, 2, "shared_memory"),  # 2 x 101K in 228K
    (16, 0, 64, SmResourceLimits.sm_86(), 16, "blocks"),
    (16, 0, 1024, SmResourceLimits.sm_75(), 1, "warps"),
])
def test_blocks_per_sm(regs, smem, threads, limits, blocks, factor):
  r = calculate_occupancy(KernelResourceUsage(regs, smem, threads), limits)
  assert r.active_blocks_per_sm == blocks
  assert r.limiting_factor == factor
  assert r.active_warps_per_sm == blocks * -(-threads // 32)
  assert 0.0 <= r.occupancy <= 1.0


def test_register_check_rounds_warps_up_to_four():
  # 3 warps of 6144 regs: 18432 allocated, but the hardware checks 4 x 6144 = 24576 <= 65536.
  assert calculate_occupancy(KernelResourceUsage(192, 0, 96), SM80).active_blocks_per_sm == 2
  # 11 warps of 6144 regs = 67584 > 65536: cannot launch.
  assert calculate_occupancy(KernelResourceUsage(192, 0, 352), SM80).active_blocks_per_sm == 0


def test_carveout_limits_shared_memory():
  usage = KernelResourceUsage(32, 20 * 1024, 128)  # 21K per block
  assert calculate_occupancy(usage, SM80).active_blocks_per_sm == 7  # 164K // 21K
  assert calculate_occupancy(usage, SM80, carveout_bytes=60_000).active_blocks_per_sm == 3


@pytest.mark.parametrize("bad", [(0, 0, 128), (32, -1, 128), (32, 0, 0), (-5, 0, 32)])
def test_non_positive_inputs_are_rejected(bad):
  with pytest.raises(ValueError):
    KernelResourceUsage(*bad)


def test_compute_capability_lookup():
  assert SmResourceLimits.for_compute_capability(9, 0) == SM90
  with pytest.raises(ValueError, match="compute capability 6.1 is not modelled; known: 7.0"):
    SmResourceLimits.for_compute_capability(6, 1)


def test_best_block_size():
  assert best_block_size(32, SM90) == (1024, 2)
  size, blocks = best_block_size(64, SM80)  # 32 warps fit by registers
  assert size * blocks // 32 == 32
  # 200 B of shared memory per thread: 832 threads (26 warps, 163.5K with the reserved 1K)
  # is the best; 864 threads would pass the 163K opt-in limit.
  assert best_block_size(32, SM80, shared_mem_per_thread_bytes=200) == (832, 1)
  # Up to 100 threads: 96 (3 warps) fits 21 blocks = 63 warps; 64 fits 32 blocks = 64 warps.
  assert best_block_size(32, SM80, block_size_limit=100) == (64, 32)

"""CUDA occupancy: how many blocks of a kernel fit on one streaming multiprocessor.

Reproduces what the driver's ``cuOccupancyMaxActiveBlocksPerMultiprocessor`` computes (the
algorithm of CUDA's ``cuda_occupancy.h``) from three numbers of a kernel -- registers per
thread, shared memory per block, threads per block -- and the SM's limits:

* warps: ``ceil(threads / 32)`` per block against the SM's warp limit;
* blocks: the SM's resident-block limit;
* registers: per warp ``ceil(regs * 32 / 256) * 256``; the SM's registers are split over 4
  sub-partitions, so ``floor(floor(65536 / 4) / regs_per_warp) * 4`` warps fit; a block whose
  registers exceed the per-block limit -- checked with its warp count rounded up to 4, as
  the hardware does -- cannot launch;
* shared memory: ``ceil((static + dynamic + reserved) / granule) * granule`` per block (1 KB
  reserved by the runtime per block and a 128 B granule from compute capability 8.0; no
  reservation and 256 B before) against the SM's shared memory at the chosen carve-out (by
  default the largest), and a block asking for more than the per-block opt-in maximum
  cannot launch.

A configuration that cannot launch (too many threads, registers or shared memory) gives 0
blocks, as the driver does; non-positive inputs are a ValueError.

Sources: CUDA C++ Programming Guide, "Compute Capabilities" (technical specifications per
compute capability) and "Shared Memory" (carve-outs); ``cuda_occupancy.h`` (CUDA 12).
Checked against the driver: ``benchmarks/occupancy_vs_driver.py`` asked
``cuOccupancyMaxActiveBlocksPerMultiprocessor`` on an H200 (sm_90, driver 580) for 16,896
configurations of real kernels (4 to 255 registers, 0 to 200 KB of shared memory, block
sizes 1 to 1025, carve-out preferences none/0/50/100%) and ``cuOccupancyMaxPotentialBlockSize``
for 72; ``tests/test_occupancy_driver.py`` replays the recorded answers, all equal.
Limits: no partitioned global caching (compute capability 3.x), no clusters; the other
compute capabilities follow the Programming Guide's tables, not a driver.

>>> limits = SmResourceLimits.sm_80()
>>> r = calculate_occupancy(KernelResourceUsage(32, 0, 256), limits)
>>> (r.active_blocks_per_sm, r.active_warps_per_sm, r.occupancy, r.limiting_factor)
(8, 64, 1.0, 'warps')
"""

from __future__ import annotations

import dataclasses

WARP_SIZE = 32


@dataclasses.dataclass(frozen=True)
class KernelResourceUsage:
  """What one block of a kernel needs."""

  registers_per_thread: int
  shared_mem_per_block_bytes: int  # static + dynamic
  threads_per_block: int

  def __post_init__(self):
    if self.registers_per_thread <= 0:
      raise ValueError(f"registers_per_thread={self.registers_per_thread} must be positive")
    if self.shared_mem_per_block_bytes < 0:
      raise ValueError(f"shared_mem_per_block_bytes={self.shared_mem_per_block_bytes} must be "
                       ">= 0")
    if self.threads_per_block <= 0:
      raise ValueError(f"threads_per_block={self.threads_per_block} must be positive")


@dataclasses.dataclass(frozen=True)
class SmResourceLimits:
  """Per-SM limits of one compute capability (CUDA Programming Guide tables)."""

  compute_capability: tuple[int, int]
  max_threads_per_block: int
  max_threads_per_sm: int
  max_warps_per_sm: int
  max_blocks_per_sm: int
  registers_per_sm: int
  max_registers_per_block: int
  max_registers_per_thread: int
  register_allocation_unit: int
  register_sub_partitions: int
  shared_mem_per_sm_bytes: int  # the largest carve-out
  max_shared_mem_per_block_optin_bytes: int
  reserved_shared_mem_per_block_bytes: int
  shared_mem_allocation_unit: int
  shared_mem_carveouts_kb: tuple[int, ...]

  @staticmethod
  def _make(cc, warps, blocks, smem_kb, optin_kb, carveouts, reserved, smem_unit):
    return SmResourceLimits(
        compute_capability=cc, max_threads_per_block=1024, max_threads_per_sm=warps * 32,
        max_warps_per_sm=warps, max_blocks_per_sm=blocks, registers_per_sm=65536,
        max_registers_per_block=65536, max_registers_per_thread=255,
        register_allocation_unit=256, register_sub_partitions=4,
        shared_mem_per_sm_bytes=smem_kb * 1024,
        max_shared_mem_per_block_optin_bytes=optin_kb * 1024,
        reserved_shared_mem_per_block_bytes=reserved, shared_mem_allocation_unit=smem_unit,
        shared_mem_carveouts_kb=carveouts)

  @classmethod
  def sm_70(cls):  # V100
    return cls._make((7, 0), 64, 32, 96, 96, (0, 8, 16, 32, 64, 96), 0, 256)

  @classmethod
  def sm_75(cls):  # T4, RTX 20
    return cls._make((7, 5), 32, 16, 64, 64, (32, 64), 0, 256)

  @classmethod
  def sm_80(cls):  # A100
    return cls._make((8, 0), 64, 32, 164, 163, (0, 8, 16, 32, 64, 100, 132, 164), 1024, 128)

  @classmethod
  def sm_86(cls):  # RTX 30, A10
    return cls._make((8, 6), 48, 16, 100, 99, (0, 8, 16, 32, 64, 100), 1024, 128)

  @classmethod
  def sm_89(cls):  # L4, L40, RTX 40
    return cls._make((8, 9), 48, 24, 100, 99, (0, 8, 16, 32, 64, 100), 1024, 128)

  @classmethod
  def sm_90(cls):  # H100, H200
    return cls._make((9, 0), 64, 32, 228, 227,
                     (0, 8, 16, 32, 64, 100, 132, 164, 196, 228), 1024, 128)

  @classmethod
  def for_compute_capability(cls, major: int, minor: int) -> SmResourceLimits:
    table = {(7, 0): cls.sm_70, (7, 2): cls.sm_70, (7, 5): cls.sm_75, (8, 0): cls.sm_80,
             (8, 6): cls.sm_86, (8, 7): cls.sm_86, (8, 9): cls.sm_89, (9, 0): cls.sm_90}
    if (major, minor) not in table:
      known = ", ".join(f"{a}.{b}" for a, b in sorted(table))
      raise ValueError(f"compute capability {major}.{minor} is not modelled; known: {known}")
    return table[(major, minor)]()


@dataclasses.dataclass(frozen=True)
class OccupancyResult:
  active_blocks_per_sm: int
  active_warps_per_sm: int
  occupancy: float  # active warps / max warps per SM, 0..1
  limiting_factor: str  # "registers", "shared_memory", "warps" or "blocks" (ties: in this
  # order of preference: warps, blocks, registers, shared memory)
  blocks_limit_by: dict  # each factor's own limit on blocks per SM


def _round_up(x: int, unit: int) -> int:
  return -(-x // unit) * unit


def _smem_per_sm(limits: SmResourceLimits, carveout_bytes: int | None, block_smem: int) -> int:
  """The shared-memory configuration the driver picks: the largest without a preference;
  with one, the smallest supported carve-out that holds both the preference and one block
  (so a block larger than the preference still launches, once per SM)."""
  if carveout_bytes is None:
    return limits.shared_mem_per_sm_bytes
  need = max(carveout_bytes, block_smem)
  for kb in limits.shared_mem_carveouts_kb:
    if kb * 1024 >= need:
      return kb * 1024
  return limits.shared_mem_per_sm_bytes


def carveout_from_percent(percent: int, limits: SmResourceLimits) -> int | None:
  """Bytes asked for by ``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = percent``
  (a percentage of the largest configuration; -1, the default, is no preference: None).

  >>> carveout_from_percent(50, SmResourceLimits.sm_90())
  116736
  """
  if percent == -1:
    return None
  if not 0 <= percent <= 100:
    raise ValueError(f"carve-out {percent=} must be -1 (no preference) or within 0..100")
  return -(-percent * limits.shared_mem_per_sm_bytes // 100)


def calculate_occupancy(usage: KernelResourceUsage, limits: SmResourceLimits, *,
                        carveout_bytes: int | None = None) -> OccupancyResult:
  """Active blocks and warps per SM of a kernel, as the CUDA driver computes them.

  Args:
    usage: the kernel's registers per thread, shared memory per block and block size.
    limits: the SM's limits (e.g. ``SmResourceLimits.sm_90()``).
    carveout_bytes: shared memory per SM requested through the carve-out preference (see
      :func:`carveout_from_percent`); the driver rounds it up to a supported configuration
      that also holds one block. ``None``: the largest.
  """
  warps_per_block = -(-usage.threads_per_block // WARP_SIZE)
  if usage.threads_per_block > limits.max_threads_per_block:  # cannot launch
    zero = dict.fromkeys(("registers", "shared_memory", "warps", "blocks"), 0)
    return OccupancyResult(0, 0, 0.0, "warps", zero)
  by = {}
  by["warps"] = min(limits.max_warps_per_sm // warps_per_block,
                    limits.max_threads_per_sm // (warps_per_block * WARP_SIZE))
  by["blocks"] = limits.max_blocks_per_sm

  regs_per_warp = _round_up(usage.registers_per_thread * WARP_SIZE,
                            limits.register_allocation_unit)
  parts = limits.register_sub_partitions
  regs_checked = regs_per_warp * _round_up(warps_per_block, parts)  # the hardware's check
  if (usage.registers_per_thread > limits.max_registers_per_thread
      or regs_checked > limits.max_registers_per_block
      or regs_per_warp * warps_per_block > limits.max_registers_per_block):
    by["registers"] = 0
  else:
    warps_fit = (limits.registers_per_sm // parts) // regs_per_warp * parts
    by["registers"] = warps_fit // warps_per_block

  smem = _round_up(usage.shared_mem_per_block_bytes + limits.reserved_shared_mem_per_block_bytes,
                   limits.shared_mem_allocation_unit)
  if usage.shared_mem_per_block_bytes > limits.max_shared_mem_per_block_optin_bytes:
    by["shared_memory"] = 0
  elif smem == 0:
    by["shared_memory"] = limits.max_blocks_per_sm
  else:
    by["shared_memory"] = _smem_per_sm(limits, carveout_bytes, smem) // smem

  order = ("warps", "blocks", "registers", "shared_memory")  # ties name the first
  blocks = min(by[k] for k in order)
  limiting = next(k for k in order if by[k] == blocks)
  warps = blocks * warps_per_block
  return OccupancyResult(blocks, warps, warps / limits.max_warps_per_sm, limiting, by)


def best_block_size(registers_per_thread: int, limits: SmResourceLimits, *,
                    shared_mem_per_block_bytes: int = 0,
                    shared_mem_per_thread_bytes: int = 0,
                    block_size_limit: int = 0) -> tuple[int, int]:
  """``(block size, blocks per SM)`` with the highest occupancy, the largest such block
  first, in the spirit of ``cudaOccupancyMaxPotentialBlockSize``.

  Candidates are the multiples of 32 up to the block limit (or ``block_size_limit``);
  shared memory per block is ``shared_mem_per_block_bytes + threads *
  shared_mem_per_thread_bytes``. Returns ``(0, 0)`` when no size can launch.

  >>> best_block_size(32, SmResourceLimits.sm_90())
  (1024, 2)
  """
  top = limits.max_threads_per_block if block_size_limit <= 0 else min(
      block_size_limit, limits.max_threads_per_block)
  best = (0, 0, -1)  # (warps, block size, blocks)
  for size in range(_round_up(top, WARP_SIZE), 0, -WARP_SIZE):
    if size > top:
      continue
    usage = KernelResourceUsage(registers_per_thread,
                                shared_mem_per_block_bytes + size * shared_mem_per_thread_bytes,
                                size)
    r = calculate_occupancy(usage, limits)
    if r.active_warps_per_sm > best[0]:
      best = (r.active_warps_per_sm, size, r.active_blocks_per_sm)
  return (best[1], best[2]) if best[0] > 0 else (0, 0)

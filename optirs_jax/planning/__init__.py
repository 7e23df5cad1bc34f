"""Pure-CPU, GPU-aware planning models. Nothing here needs a device to import or test.

============================  ===============================================================
module                        what it models
============================  ===============================================================
``layout``                    the optimizer kernels' layouts: flat buffers, grouped launches
``occupancy``                 CUDA occupancy (the driver's blocks per SM) and block sizes
``kernel_fusion``             grouping elementwise/broadcast/reduction ops into kernels
``memory``                    arena, buddy and slab allocators; device memory telemetry
``memory_policies``           compaction, eviction (LRU, LFU, size-aware), GC, prefetch
``tensor_cores``              padded GEMM layouts, precision choice, a float32-accumulating GEMM
``devices``                   device capabilities from a ``jax.Device`` or presets
============================  ===============================================================
"""

from optirs_jax.planning.devices import DeviceCapabilities, block_size_for
from optirs_jax.planning.kernel_fusion import (
                                              FusionPlan,
                                              Graph,
                                              adam_update_graph,
                                              evaluate,
                                              plan_fusion,
)
from optirs_jax.planning.layout import (
                                              Group,
                                              GroupedCall,
                                              LayoutPlan,
                                              Placement,
                                              padded_size,
                                              plan_grouped_calls,
                                              plan_layout,
)
from optirs_jax.planning.memory import (
                                              ArenaAllocator,
                                              BuddyAllocator,
                                              HardwareUtilization,
                                              MemoryStats,
                                              OutOfMemoryError,
                                              SlabAllocator,
                                              device_memory_stats,
)
from optirs_jax.planning.occupancy import (
                                              KernelResourceUsage,
                                              OccupancyResult,
                                              SmResourceLimits,
                                              best_block_size,
                                              calculate_occupancy,
                                              carveout_from_percent,
)
from optirs_jax.planning.tensor_cores import GemmLayout, gemm, plan_gemm_layout, select_precision

__all__ = [
                                              "ArenaAllocator",
                                              "BuddyAllocator",
                                              "DeviceCapabilities",
                                              "FusionPlan",
                                              "GemmLayout",
                                              "Graph",
                                              "Group",
                                              "GroupedCall",
                                              "HardwareUtilization",
                                              "KernelResourceUsage",
                                              "LayoutPlan",
                                              "MemoryStats",
                                              "OccupancyResult",
                                              "OutOfMemoryError",
                                              "Placement",
                                              "SlabAllocator",
                                              "SmResourceLimits",
                                              "adam_update_graph",
                                              "best_block_size",
                                              "block_size_for",
                                              "calculate_occupancy",
                                              "carveout_from_percent",
                                              "device_memory_stats",
                                              "evaluate",
                                              "gemm",
                                              "padded_size",
                                              "plan_fusion",
                                              "plan_gemm_layout",
                                              "plan_grouped_calls",
                                              "plan_layout",
                                              "select_precision",
]

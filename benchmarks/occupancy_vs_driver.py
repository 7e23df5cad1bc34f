"""Compares optirs_jax.planning.occupancy with the CUDA driver on real kernels.

    PYTHONPATH=. python3 benchmarks/occupancy_vs_driver.py OUT.json

Builds PTX kernels that keep K float registers live (K volatile loads, then K volatile
stores: the loads cannot move past the stores, so all K values are live at once) and a
static shared buffer, loads them through the driver (libcuda, ctypes), reads each kernel's
real register count and static shared memory, and asks
``cuOccupancyMaxActiveBlocksPerMultiprocessor`` for every (kernel, block size, dynamic
shared memory, carve-out preference) in the grid. Writes every case with the driver's and
the model's answers; tests/test_occupancy_driver.py replays the file on CPU.
"""

import ctypes
import itertools
import json
import sys

from optirs_jax.planning.occupancy import (
  KernelResourceUsage,
  SmResourceLimits,
  best_block_size,
  calculate_occupancy,
)

ATTR_MAX_THREADS, ATTR_SHARED, ATTR_NUM_REGS = 0, 1, 4
ATTR_MAX_DYN_SHARED, ATTR_CARVEOUT = 8, 9
DEV_ATTR_CC_MAJOR, DEV_ATTR_CC_MINOR = 75, 76


def ptx(live: int, static_smem: int, arch: str) -> bytes:
  regs = max(live, 1)
  lines = [".version 7.8", f".target {arch}", ".address_size 64",
           ".visible .entry k(.param .u64 ptr)", "{", "  .reg .b64 %rd<2>;",
           f"  .reg .f32 %f<{regs}>;"]
  if static_smem:
    lines.insert(3, f".shared .align 16 .b8 buf[{static_smem}];")
  lines.append("  ld.param.u64 %rd0, [ptr];")
  lines += [f"  ld.volatile.global.f32 %f{i}, [%rd0+{4 * i}];" for i in range(live)]
  lines += [f"  st.volatile.global.f32 [%rd0+{4 * (live + i)}], %f{i};" for i in range(live)]
  if static_smem:
    if not live:
      lines.append("  mov.f32 %f0, 0f00000000;")
    lines.append("  st.volatile.shared.f32 [buf], %f0;")
  lines += ["  ret;", "}", ""]
  return "\n".join(lines).encode()


class Driver:
  def __init__(self):
    self.cu = ctypes.CDLL("libcuda.so.1")
    self.check(self.cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    self.check(self.cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    self.dev = dev
    ctx = ctypes.c_void_p()
    self.check(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx retain")
    self.check(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

  def check(self, rc, what):
    if rc != 0:
      msg = ctypes.c_char_p()
      self.cu.cuGetErrorString(rc, ctypes.byref(msg))
      raise RuntimeError(f"{what}: CUDA error {rc} {msg.value}")

  def device_attr(self, attr):
    v = ctypes.c_int()
    self.check(self.cu.cuDeviceGetAttribute(ctypes.byref(v), attr, self.dev), "dev attr")
    return v.value

  def load(self, source: bytes):
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    self.check(self.cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(source)), "load")
    self.check(self.cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"k"), "get function")
    return fn

  def attr(self, fn, a):
    v = ctypes.c_int()
    self.check(self.cu.cuFuncGetAttribute(ctypes.byref(v), a, fn), f"func attr {a}")
    return v.value

  def set_attr(self, fn, a, value):
    self.check(self.cu.cuFuncSetAttribute(fn, a, value), f"set func attr {a}={value}")

  def blocks(self, fn, block, dyn):
    n = ctypes.c_int()
    rc = self.cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), fn, block,
                                                             ctypes.c_size_t(dyn))
    return n.value if rc == 0 else f"error {rc}"

  def potential_block(self, fn, dyn):
    grid, block = ctypes.c_int(), ctypes.c_int()
    rc = self.cu.cuOccupancyMaxPotentialBlockSize(ctypes.byref(grid), ctypes.byref(block), fn,
                                                  None, ctypes.c_size_t(dyn), 0)
    return block.value if rc == 0 else f"error {rc}"


def main(out_path):
  drv = Driver()
  cc = (drv.device_attr(DEV_ATTR_CC_MAJOR), drv.device_attr(DEV_ATTR_CC_MINOR))
  limits = SmResourceLimits.for_compute_capability(*cc)
  arch = f"sm_{cc[0]}{cc[1]}"
  optin = limits.max_shared_mem_per_block_optin_bytes
  cases, potentials = [], []
  lives = (0, 24, 30, 40, 56, 72, 90, 120, 126, 150, 200, 250)
  statics = (0, 4096)
  blocks = (1, 32, 33, 64, 96, 128, 160, 192, 256, 288, 384, 512, 640, 768, 1024, 1025)
  dyns = (0, 1, 1000, 3072, 8192, 20000, 48 * 1024, 70000, 100 * 1024, 150000, 200 * 1024)
  carveouts = (-1, 0, 50, 100)
  for live, static in itertools.product(lives, statics):
    fn = drv.load(ptx(live, static, arch))
    regs, smem = drv.attr(fn, ATTR_NUM_REGS), drv.attr(fn, ATTR_SHARED)
    max_threads = drv.attr(fn, ATTR_MAX_THREADS)
    drv.set_attr(fn, ATTR_MAX_DYN_SHARED, optin - smem)
    for carve in carveouts:
      drv.set_attr(fn, ATTR_CARVEOUT, carve)
      carve_bytes = None if carve < 0 else -(-carve * limits.shared_mem_per_sm_bytes // 100)
      for block, dyn in itertools.product(blocks, dyns):
        if smem + dyn > optin:
          continue
        driver = drv.blocks(fn, block, dyn)
        model = calculate_occupancy(KernelResourceUsage(regs, smem + dyn, block), limits,
                                    carveout_bytes=carve_bytes)
        cases.append(dict(registers=regs, static_smem=smem, dynamic_smem=dyn, block=block,
                          carveout_pct=carve, kernel_max_threads=max_threads,
                          driver_blocks=driver, model_blocks=model.active_blocks_per_sm))
    drv.set_attr(fn, ATTR_CARVEOUT, -1)
    for dyn in (0, 8192, 100 * 1024):
      if smem + dyn <= optin:
        potentials.append(dict(registers=regs, smem=smem + dyn,
                               driver_block=drv.potential_block(fn, dyn),
                               model=list(best_block_size(regs, limits,
                                                          shared_mem_per_block_bytes=smem + dyn))))
  columns = ["registers", "static_smem", "dynamic_smem", "block", "carveout_pct",
             "kernel_max_threads", "driver_blocks"]
  with open(out_path, "w") as f:  # compact: one row per case
    json.dump({"compute_capability": list(cc), "columns": columns,
               "rows": [[c[k] for k in columns] for c in cases], "potential": potentials}, f)
  same = sum(c["driver_blocks"] == c["model_blocks"] for c in cases)
  for carve in carveouts:
    sub = [c for c in cases if c["carveout_pct"] == carve]
    print(f"  carve-out {carve}%: {sum(c['driver_blocks'] == c['model_blocks'] for c in sub)}"
          f" of {len(sub)} agree")
  print(f"{arch}: model == driver on {same} of {len(cases)} cases "
        f"(registers seen: {sorted({c['registers'] for c in cases})})")
  for c in [c for c in cases if c["driver_blocks"] != c["model_blocks"]][:60]:
    print("  differs:", c)
  for p in potentials:
    print("  potential block size:", p)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "occupancy_driver.json"))

"""Device capabilities from a real ``jax.Device`` or from presets, and small helpers.

:meth:`DeviceCapabilities.from_device` reads what JAX reports: platform, device kind,
compute capability (CUDA devices expose it), memory limit from ``memory_stats()``. What a
backend does not report stays ``None``; nothing is guessed. Presets carry datasheet values
for planning without a device.

>>> DeviceCapabilities.preset("h200").compute_capability
(9, 0)
>>> block_size_for(1000, warp=32, max_threads=1024)
1024
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class DeviceCapabilities:
  platform: str  # "gpu", "tpu", "cpu"
  device_kind: str
  compute_capability: tuple[int, int] | None = None
  memory_bytes: int | None = None
  multiprocessors: int | None = None
  source: str = "preset"

  @classmethod
  def from_device(cls, device: Any = None) -> DeviceCapabilities:
    import jax
    device = device if device is not None else jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    if isinstance(cc, str) and "." in cc:
      major, minor = cc.split(".")[:2]
      cc = (int(major), int(minor))
    elif not (isinstance(cc, tuple) and len(cc) == 2):
      cc = None
    memory = None
    try:
      stats = device.memory_stats()
    except Exception:
      stats = None
    if stats and "bytes_limit" in stats:
      memory = int(stats["bytes_limit"])
    sms = getattr(device, "core_count", None)
    return cls(platform=device.platform, device_kind=device.device_kind, compute_capability=cc,
               memory_bytes=memory, multiprocessors=sms if isinstance(sms, int) else None,
               source="jax.Device")

  @classmethod
  def preset(cls, name: str) -> DeviceCapabilities:
    presets = {
        "v100": cls("gpu", "Tesla V100-SXM2-32GB", (7, 0), 32 << 30, 80),
        "t4": cls("gpu", "Tesla T4", (7, 5), 16 << 30, 40),
        "a100": cls("gpu", "NVIDIA A100-SXM4-80GB", (8, 0), 80 << 30, 108),
        "a10": cls("gpu", "NVIDIA A10", (8, 6), 24 << 30, 72),
        "l4": cls("gpu", "NVIDIA L4", (8, 9), 24 << 30, 58),
        "h100": cls("gpu", "NVIDIA H100 80GB HBM3", (9, 0), 80 << 30, 132),
        "h200": cls("gpu", "NVIDIA H200", (9, 0), 141 * 10**9, 132),
        "tpu-v5e": cls("tpu", "TPU v5 lite", None, 16 << 30, None),
    }
    if name not in presets:
      raise ValueError(f"unknown preset {name!r}; valid presets are {sorted(presets)}")
    return presets[name]

  def supports(self, feature: str) -> bool:
    """Whether the matrix units take ``feature``: "bf16", "tf32", "fp8", "int8"."""
    valid = ("bf16", "tf32", "fp8", "int8")
    if feature not in valid:
      raise ValueError(f"unknown feature {feature!r}; valid features are {valid}")
    if self.platform == "tpu":
      return feature in ("bf16", "int8")
    if self.platform != "gpu" or self.compute_capability is None:
      return False
    cc = self.compute_capability
    return {"bf16": cc >= (8, 0), "tf32": cc >= (8, 0), "fp8": cc >= (8, 9),
            "int8": cc >= (7, 5)}[feature]


def block_size_for(n: int, *, warp: int = 32, max_threads: int = 1024) -> int:
  """Threads per block for ``n`` independent elements: ``n`` rounded up to a warp, capped."""
  if n <= 0:
    raise ValueError(f"n={n} must be positive")
  return min(max_threads, -(-n // warp) * warp)

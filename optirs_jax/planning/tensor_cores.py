"""Matrix-unit planning: padded GEMM layouts, precision choice, and a real GEMM.

* :func:`plan_gemm_layout` pads ``(m, n, k)`` to the multiples the matrix units want for a
  dtype -- on NVIDIA tensor cores 8 elements for fp16/bf16 (16 bytes), 4 for tf32, 16 for
  fp8 and int8; on TPU 128 for the lane dimensions (8 rows for f32 sublanes, 16 for bf16) --
  and reports the padding overhead in FLOPs.
* :func:`select_precision` picks the fastest input dtype the device's matrix units take
  (fp8 on sm_89+, bf16 on sm_80+ and TPU, fp16 on sm_70+, else float32), unless the caller
  needs float32 accuracy.
* :func:`gemm` runs ``lax.dot_general`` in the chosen input dtype with
  ``preferred_element_type=float32``: on an NVIDIA GPU, XLA lowers bf16/fp16/fp8 products to
  tensor-core kernels (cuBLAS/cuBLASLt); ``benchmarks/gemm_tflops.py`` measures each dtype's
  throughput (results and dates in ``benchmarks/NOTES.md`` and ``benchmarks/results/``).

Sources: NVIDIA cuBLAS and "Matrix Multiplication Background" user guides (dimension
multiples for tensor cores); Cloud TPU performance guide (128-lane tiles).
Limits: the multiples are the documented minimums for full-rate kernels, not a tuned model.

>>> plan = plan_gemm_layout(1000, 1000, 1000, "bf16", platform="gpu")
>>> plan.padded, round(plan.flop_overhead, 4)
((1000, 1000, 1000), 0.0)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from optirs_jax.planning.devices import DeviceCapabilities

GPU_MULTIPLE = {"fp32": 1, "tf32": 4, "fp16": 8, "bf16": 8, "fp8": 16, "int8": 16}
TPU_MULTIPLE = {"fp32": (8, 128), "bf16": (16, 128), "int8": (32, 128), "fp16": (16, 128)}
DTYPES = {"fp32": jnp.float32, "tf32": jnp.float32, "fp16": jnp.float16, "bf16": jnp.bfloat16,
          "fp8": jnp.float8_e4m3fn, "int8": jnp.int8}


@dataclasses.dataclass(frozen=True)
class GemmLayout:
  shape: tuple[int, int, int]  # (m, n, k) as asked
  padded: tuple[int, int, int]
  precision: str

  @property
  def flop_overhead(self) -> float:
    """Extra FLOPs of the padded product over the asked one (0.25 = 25% more)."""
    m, n, k = self.shape
    pm, pn, pk = self.padded
    return pm * pn * pk / (m * n * k) - 1.0


def _up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def plan_gemm_layout(m: int, n: int, k: int, precision: str, *,
                     platform: str = "gpu") -> GemmLayout:
  """Pads ``(m, n, k)`` of ``C[m, n] = A[m, k] @ B[k, n]`` for the matrix units."""
  for name, v in (("m", m), ("n", n), ("k", k)):
    if v <= 0:
      raise ValueError(f"{name}={v} must be positive")
  if precision not in GPU_MULTIPLE:
    raise ValueError(f"unknown precision {precision!r}; valid: {sorted(GPU_MULTIPLE)}")
  if platform == "gpu":
    q = GPU_MULTIPLE[precision]
    padded = (_up(m, q), _up(n, q), _up(k, q))
  elif platform == "tpu":
    if precision not in TPU_MULTIPLE:
      raise ValueError(f"precision {precision!r} is not a TPU matrix-unit type; valid: "
                       f"{sorted(TPU_MULTIPLE)}")
    rows, lanes = TPU_MULTIPLE[precision]
    padded = (_up(m, rows), _up(n, lanes), _up(k, lanes))
  else:
    raise ValueError(f"platform={platform!r}; valid platforms are ('gpu', 'tpu')")
  return GemmLayout((m, n, k), padded, precision)


def select_precision(caps: DeviceCapabilities, *, allow_fp8: bool = False,
                     need_fp32_accuracy: bool = False) -> str:
  """The matrix-unit input type to use on ``caps``: "fp8", "bf16", "fp16", "tf32", "fp32"."""
  if need_fp32_accuracy:
    return "fp32"
  if allow_fp8 and caps.supports("fp8"):
    return "fp8"
  if caps.supports("bf16"):
    return "bf16"
  if caps.platform == "gpu" and caps.compute_capability and caps.compute_capability >= (7, 0):
    return "fp16"
  return "fp32"


def gemm(a: jax.Array, b: jax.Array, precision: str = "bf16") -> jax.Array:
  """``a @ b`` with inputs cast to ``precision`` and float32 accumulation and result."""
  if precision not in DTYPES:
    raise ValueError(f"unknown precision {precision!r}; valid: {sorted(DTYPES)}")
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
    raise ValueError(f"need a[m, k] @ b[k, n]; got {a.shape} and {b.shape}")
  dt = DTYPES[precision]
  lax_precision = {"fp32": jax.lax.Precision.HIGHEST, "tf32": jax.lax.Precision.DEFAULT}.get(
      precision, jax.lax.Precision.DEFAULT)
  return jax.lax.dot_general(a.astype(dt), b.astype(dt), (((1,), (0,)), ((), ())),
                             precision=lax_precision, preferred_element_type=jnp.float32)

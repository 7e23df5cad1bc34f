"""How the kernel executors lay out and launch an update: a frozen value, not module state.

Every optimizer takes ``executor_options=ExecutorOptions(...)``; the options are part of
every kernel cache key, so two optimizers with different options in one program each get
their own kernels. The defaults are what measured fastest on an H200
(``benchmarks/NOTES.md``: "Runs 4-6" for the leaf policies, "run 2" for the tilings and for
leaving large leaves to XLA on the update path).

>>> from optirs_jax import ExecutorOptions
>>> ExecutorOptions(small_leaf_policy="pack").tiling("cuda")
Tiling(block_rows=32, lanes=128, num_warps=4, num_stages=1, flat=False, programs=None)
>>> ExecutorOptions(small_leaf_policy="scatter")
Traceback (most recent call last):
...
ValueError: small_leaf_policy='scatter' is not one of ('group', 'pack', 'solo', 'reference')
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from optirs_jax.pallas.op import LANES
from optirs_jax.planning.layout import MAX_POINTERS_PER_CALL_32KB

SMALL_LEAF_POLICIES = ("group", "pack", "solo", "reference")
LARGE_LEAF_POLICIES = ("group", "in-place")
KERNEL_PLATFORMS = ("cuda", "mosaic_gpu", "tpu", "interpret")
# Which Pallas lowering runs the GPU's kernels: Triton, or Mosaic GPU for the elementwise
# ops it takes (no per-leaf norms or element indices; those stay on Triton).
GPU_KERNELS = ("triton", "mosaic_gpu")
# How the 8-bit kernels' coders of the dynamic map read their table
# (optirs_jax.formats.codes: lookups, or decade constants and arithmetic).
DYNAMIC_MAP_CODERS = ("table", "arithmetic-decode", "arithmetic")
MOSAIC_GPU_MAX_BLOCK_ROWS = 256  # Mosaic GPU: at most 256 elements per block dimension
# Mosaic GPU lowers sqrt (Adam, RMSprop) from jax 0.11 on.
MOSAIC_GPU_MIN_JAX = (0, 11)
# Platforms where the grouped kernel runs (masked 1-D loads). Mosaic TPU would move every
# operand's block for every program, so the TPU packs the leaves instead.
GROUPED_PLATFORMS = ("cuda", "interpret")


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Block geometry and launch settings of a kernel.

  Attributes:
    block_rows: rows of ``lanes`` elements per block.
    lanes: elements per row (the TPU's lane count, 128).
    num_warps, num_stages: Triton launch settings; on Mosaic GPU ``num_stages`` is the
      number of blocks each thread block has in flight (ignored elsewhere).
    flat: 1-D blocks of ``block_elems`` over the flattened buffer instead of 2-D blocks.
    programs: Mosaic GPU only: how many thread blocks share a buffer's blocks (each
      streams an equal run of them); ``None``: one thread block per block.
  """

  block_rows: int
  lanes: int = LANES
  num_warps: int = 4
  num_stages: int = 1
  flat: bool = False
  programs: int | None = None

  def __post_init__(self):
    for name in ("block_rows", "lanes", "num_warps", "num_stages", "programs"):
      value = getattr(self, name)
      if name == "programs" and value is None:
        continue
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"Tiling: {name}={value!r} must be a positive int")

  @property
  def block_elems(self) -> int:
    return self.block_rows * self.lanes


@dataclasses.dataclass(frozen=True)
class ExecutorOptions:
  """Layout and launch options of the Pallas executors (``backend="auto"`` or ``"pallas"``).

  Attributes:
    small_leaf_policy: what the kernels do with leaves too small to run in place (fewer than
      ``solo_min_blocks`` blocks, or not a whole number of lanes): ``"group"`` them into a
      few launches that each read and write many leaves in their own buffers (GPU and
      interpret mode; the TPU packs instead), ``"pack"`` them into one buffer per dtype
      (a concatenation in and one slice per leaf and output back), run each ``"solo"``
      (one launch per leaf), or hand them to the ``"reference"`` (one XLA fusion per leaf).
    large_leaf_policy: what the kernels do with leaves large enough to run in place: join
      the grouped launches (``"group"``, when small leaves are grouped) or one launch each
      (``"in-place"``). The same for the leaves of 8-bit state (``state_quantization``,
      :func:`~optirs_jax.adamw8bit`): ``"group"`` puts those of one format and block size
      in grouped launches of one quantization block a program (GPT-2 small on an H100, run
      75: ``adamw8bit`` 0.768 ms, 85.4% of copy, against 0.886 ms with a launch a leaf;
      fp8 0.669 against 0.778), ``"in-place"`` gives each its own launch; the same numbers
      either way.
    solo_min_blocks: a leaf of at least this many blocks (and a whole number of lanes) is
      large: it runs in place instead of being packed.
    updates_on_reference: on the optax-contract path (``update``, no fused apply) with
      ``backend="auto"``, hand every leaf of rules without per-leaf norms to the reference,
      so that XLA fuses each leaf's update with what surrounds it (``optax.apply_updates``
      after it, a chain's links before it), which a kernel cannot: it would write the
      updates out for XLA to read back. Small leaves went to the grouped kernel until run
      43 (H100, GPT-2): ``chain(clip_by_global_norm, adamw)`` through ``update`` took 1.988
      ms against optax's 1.889 (the clip's output and the updates of small leaves written
      out), 1.891 ms with every leaf on the reference; bare AdamW 1.384 against 1.416 ms.
      The fused apply (:func:`optirs_jax.apply`) is where the kernels' speed is.
    cuda_tiling, tpu_tiling: the packed and in-place kernels' geometry per platform.
    interpret_tiling: the geometry in interpret mode; ``None`` takes ``cuda_tiling``, so
      tests on a CPU run the GPU's layout.
    grouped_tiling: the grouped kernel's geometry (1-D blocks). 256-element blocks, 4 warps:
      on an H200 (runs 38-39), 2000 leaves of 16K Adam at 85.4-85.5% of copy against 83.5%
      with 512 and 79.0% with 1024 (each launch's ramp and drain weigh less with shorter
      programs; 128 elements: 78.3%), GPT-2 Adam, LAMB and the master-weights step within
      0.8% of the 1024-element blocks'.
    grouped_min_block_bytes: a grouped launch whose operands move fewer bytes per element
      doubles ``grouped_tiling``'s blocks (at most twice) until a block moves this many:
      on an H100 (run 60, GPT-2) NovoGrad's first pass (the gradient alone, 1 KB a
      256-element block) took its step from 84.8% of copy to 95.0% with 512-element
      blocks; Fromage 93.4% to 96.3% (512) and 96.9% (1024). ``0``: the blocks as given.
    grouped_max_buffers: the operand buffers one grouped launch holds at most (Adam's fused
      apply: 7 a leaf). Fewer, bigger launches run closer to the copy bandwidth, but the
      Triton compile of a launch grows faster than its leaves (H200, Adam on 2000 leaves of
      16K, runs 31-32: 384 buffers, 38 launches: 64% of copy; 1512, 10 launches: 80%, first
      call 7-8.5 s; 2800, 5 launches: 87%, about 7 s more; ``benchmarks/NOTES.md``). More than
      ``MAX_POINTERS_PER_CALL`` (384) needs CUDA's 32 KB kernel parameters (Volta or
      newer); on older GPUs launches keep to 384.
    gpu_kernels: the Pallas lowering of the GPU's kernels: ``"triton"``, or
      ``"mosaic_gpu"`` (``jax.experimental.pallas.mosaic_gpu``) for ops without per-leaf
      norms or element indices (Adam, AdamW, SGD, RMSprop, Adagrad, Lion); those leaves are
      then packed or run in place (``mosaic_gpu_tiling``) instead of grouped, and the
      outputs are new buffers (Mosaic GPU's ``plgpu.kernel`` takes no aliases).
    mosaic_gpu_tiling: the Mosaic GPU kernel's geometry: ``block_rows`` (at most 256) x 128
      blocks, ``num_stages`` blocks in flight per thread block, ``programs`` thread blocks.
    quantized_tiling: the 8-bit optimizers' kernel (:func:`~optirs_jax.adam8bit`):
      ``block_rows`` quantization blocks per program (its ``lanes`` is unused: a row is one
      quantization block), and the Triton launch settings (1 block, 1 warp: fastest of
      1-4 blocks x 1-4 warps for both state formats on an H100 with the table-driven codes,
      benchmarks/NOTES.md "Run 46"; 2 warps were fastest of 2-8 with the arithmetic codes on
      an H200, "Runs 8-9"; 4 blocks a program were slower again in run 70; in the grouped
      launches, which take one block a program, 1 warp beat 2 and 4 in runs 73 and 77).
      ``block_rows`` above 1 gives each 8-bit leaf its own launch.
    dynamic_map_coder: how the 8-bit kernels' coders of the dynamic map read their constant
      table (:data:`DYNAMIC_MAP_CODERS`; the same codes and values either
      way): ``"table"``, a magnitude by one lookup in ``2^K`` values and a code by a
      bucket's and a threshold's lookups; ``"arithmetic-decode"``, magnitudes computed from
      ``K`` pairs of decade constants; ``"arithmetic"``, the threshold's test too on two
      magnitudes so computed (:mod:`optirs_jax.formats.codes`). The table is the fastest
      on an H100: GPT-2 small's ``adamw8bit`` 0.952, 1.049 and 1.378 ms, the kernels being
      bound by their operations, not their loads (benchmarks/NOTES.md, run 70).
  """

  small_leaf_policy: str = "group"
  large_leaf_policy: str = "group"
  solo_min_blocks: int = 64
  updates_on_reference: bool = True
  cuda_tiling: Tiling = Tiling(block_rows=32, num_warps=4)
  tpu_tiling: Tiling = Tiling(block_rows=512)
  interpret_tiling: Tiling | None = None
  grouped_tiling: Tiling = Tiling(block_rows=2, num_warps=4, flat=True)
  grouped_max_buffers: int = 1512
  grouped_min_block_bytes: int = 4096
  quantized_tiling: Tiling = Tiling(block_rows=1, num_warps=1)
  dynamic_map_coder: str = "table"
  gpu_kernels: str = "triton"
  mosaic_gpu_tiling: Tiling = Tiling(block_rows=32, num_stages=2)

  def __post_init__(self):
    if self.small_leaf_policy not in SMALL_LEAF_POLICIES:
      raise ValueError(f"small_leaf_policy={self.small_leaf_policy!r} is not one of "
                       f"{SMALL_LEAF_POLICIES}")
    if self.large_leaf_policy not in LARGE_LEAF_POLICIES:
      raise ValueError(f"large_leaf_policy={self.large_leaf_policy!r} is not one of "
                       f"{LARGE_LEAF_POLICIES}")
    if (not isinstance(self.solo_min_blocks, int) or isinstance(self.solo_min_blocks, bool)
        or self.solo_min_blocks < 1):
      raise ValueError(f"solo_min_blocks={self.solo_min_blocks!r} must be a positive int")
    if (not isinstance(self.grouped_max_buffers, int) or isinstance(self.grouped_max_buffers, bool)
        or not 1 <= self.grouped_max_buffers <= MAX_POINTERS_PER_CALL_32KB):
      raise ValueError(f"grouped_max_buffers={self.grouped_max_buffers!r} must be an int from 1 "
                       f"to {MAX_POINTERS_PER_CALL_32KB} (32 KB of kernel parameters)")
    if (not isinstance(self.grouped_min_block_bytes, int)
        or isinstance(self.grouped_min_block_bytes, bool) or self.grouped_min_block_bytes < 0):
      raise ValueError(f"grouped_min_block_bytes={self.grouped_min_block_bytes!r} must be an "
                       "int >= 0")
    if not isinstance(self.updates_on_reference, bool):
      raise TypeError(f"updates_on_reference={self.updates_on_reference!r} must be a bool")
    if self.dynamic_map_coder not in DYNAMIC_MAP_CODERS:
      raise ValueError(f"dynamic_map_coder={self.dynamic_map_coder!r} is not one of "
                       f"{DYNAMIC_MAP_CODERS}")
    if self.gpu_kernels not in GPU_KERNELS:
      raise ValueError(f"gpu_kernels={self.gpu_kernels!r} is not one of {GPU_KERNELS}")
    if self.gpu_kernels == "mosaic_gpu" and jax.__version_info__ < MOSAIC_GPU_MIN_JAX:
      raise ValueError(f"gpu_kernels='mosaic_gpu' needs jax >= "
                       f"{'.'.join(map(str, MOSAIC_GPU_MIN_JAX))} (its Mosaic GPU lowering "
                       f"lacks sqrt before); this is jax {jax.__version__}: use 'triton'")
    for name in ("cuda_tiling", "tpu_tiling", "interpret_tiling", "grouped_tiling",
                 "quantized_tiling", "mosaic_gpu_tiling"):
      value = getattr(self, name)
      if not isinstance(value, Tiling) and not (name == "interpret_tiling" and value is None):
        raise TypeError(f"{name}={value!r} must be a Tiling")
    if not self.grouped_tiling.flat:
      raise ValueError(f"grouped_tiling={self.grouped_tiling} must have flat=True (the "
                       "grouped kernel reads 1-D blocks)")
    rows = self.mosaic_gpu_tiling.block_rows
    if not 1 <= rows <= MOSAIC_GPU_MAX_BLOCK_ROWS or self.mosaic_gpu_tiling.flat:
      raise ValueError(f"mosaic_gpu_tiling={self.mosaic_gpu_tiling} must have 2-D blocks of "
                       f"at most {MOSAIC_GPU_MAX_BLOCK_ROWS} rows (Mosaic GPU's limit per "
                       "block dimension)")

  def tiling(self, platform: str) -> Tiling:
    """The packed and in-place kernels' geometry on ``platform``."""
    if platform == "interpret":
      return self.interpret_tiling or self.cuda_tiling
    return {"cuda": self.cuda_tiling, "mosaic_gpu": self.mosaic_gpu_tiling,
            "tpu": self.tpu_tiling}[platform]

  def grouped_tiling_for(self, operands) -> Tiling:
    """The grouped kernel's geometry for a launch whose leaves each have these operands
    (arrays or dtypes: inputs, then outputs): ``grouped_tiling``, its blocks doubled at
    most twice while a block moves fewer than ``grouped_min_block_bytes``."""
    per_element = sum(np.dtype(getattr(x, "dtype", x)).itemsize for x in operands)
    tiling = self.grouped_tiling
    for _ in range(2):
      if tiling.block_elems * per_element >= self.grouped_min_block_bytes:
        break
      tiling = dataclasses.replace(tiling, block_rows=2 * tiling.block_rows)
    return tiling

  def groups(self, platform: str) -> bool:
    """Whether small leaves go through grouped launches on ``platform``."""
    return self.small_leaf_policy == "group" and platform in GROUPED_PLATFORMS


DEFAULT_OPTIONS = ExecutorOptions()

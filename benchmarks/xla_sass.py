"""What XLA compiles a bench case's fused apply into for an H200, on a machine without a
GPU: the step is compiled for a compile-only H200 (``optirs_jax.bench.compile_only``: jax's
CUDA plugin, XLA's own Triton, LLVM and ptxas), the cubins are taken out of the serialized
executable and disassembled with ``cuobjdump``, and each kernel's SASS is counted by opcode,
beside the lowering's and the compile's seconds.

  PYTHONPATH=. python benchmarks/xla_sass.py [tree] [plan,...] [case]

``tree``: a bench tree (``leaves``: 2000 x 16K, ``gpt2``); ``plan``: a launch-plan spec of
:mod:`optirs_jax.bench.variants` (``MAX[/SPLIT[/BLOCKS]][:greedy][:branch][:select]``);
``case``: a name of ``optirs_jax.bench.cases.OPTIMIZERS``.
Needs ``jax-cuda13-plugin`` and ``jax-cuda13-pjrt`` at jax's version, the CUDA toolkit's
ptxas, and a ``cuobjdump`` (the toolkit's, or the one in the ``triton`` package).

The executable's serialization is XLA's, not an API: a riegeli file (64 KiB blocks with
24-byte headers) whose chunk holds snappy-compressed records, the executable proto, in
which a second riegeli file holds the kernels' cubins (jax 0.10.2 and 0.11.2). Every
program runs what is outside the search's branches: where SEL and LDC grow with the
launch's leaves, each program selects among every leaf's pointers.
"""

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import jax
from jax.experimental.serialize_executable import serialize

from optirs_jax.bench.cases import OPTIMIZERS, abstract_tree, jax_step
from optirs_jax.bench.compile_only import lower_for_h200
from optirs_jax.bench.variants import PlanVariant, plan_variant

COUNTED = ("SEL", "LDC", "ULDC", "BRA", "ISETP", "LDG", "STG")
RIEGELI = b"\x83\xafp\xd1\r\x88J?"  # the hash of a riegeli file's first block header
CUBIN = b"\x7fELF\x02\x01\x01A\x08\x00\x00\x00\x00\x00\x00\x00\x02\x00\xbe\x00"


def _varint(b: bytes, p: int) -> tuple[int, int]:
  v = shift = 0
  while True:
    c = b[p]
    v |= (c & 0x7F) << shift
    p += 1
    shift += 7
    if c < 0x80:
      return v, p


def _snappy(src: bytes, pos: int, size: int) -> bytes | None:
  """``size`` bytes of the raw snappy stream whose first tag is at ``pos``; None where the
  stream is not one."""
  out = bytearray()
  while len(out) < size and pos < len(src):
    tag, kind = src[pos], src[pos] & 3
    if kind == 0:  # literal
      n = tag >> 2
      if n < 60:
        n, pos = n + 1, pos + 1
      else:
        n, pos = int.from_bytes(src[pos + 1:pos + n - 58], "little") + 1, pos + n - 58
      out += src[pos:pos + n]
      pos += n
      continue
    if kind == 1:
      n, off, pos = ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | src[pos + 1], pos + 2
    elif kind == 2:
      n, off, pos = (tag >> 2) + 1, int.from_bytes(src[pos + 1:pos + 3], "little"), pos + 3
    else:
      n, off, pos = (tag >> 2) + 1, int.from_bytes(src[pos + 1:pos + 5], "little"), pos + 5
    if not 0 < off <= len(out):
      return None
    for _ in range(n):
      out.append(out[-off])
  return bytes(out[:size]) if len(out) >= size else None


def _riegeli_records(data: bytes) -> bytes:
  """The decompressed records of the riegeli file in ``data`` (its snappy chunk)."""
  start = data.index(RIEGELI)
  body = b"".join(data[p + 24:p + 65536] for p in range(start, len(data), 65536))
  best = b""
  for p in (m.start() for m in re.finditer(b"s", body)):  # 's': snappy-compressed chunk
    try:
      sizes, q = _varint(body, p + 1)
      size, r = _varint(body, q + sizes)
      again, r = _varint(body, r)
    except IndexError:
      continue
    if size == again and size > len(best):
      records = _snappy(body, r, size)
      if records is not None:
        best = records
  return best


def cubins(compiled) -> list[bytes]:
  """The cubins in a compiled executable's serialization."""
  data = serialize(compiled)[0]
  while CUBIN not in data and RIEGELI in data:
    data = _riegeli_records(data)
  starts = [m.start() for m in re.finditer(re.escape(CUBIN), data)]
  return [data[a:b] for a, b in zip(starts, starts[1:] + [len(data)])]


def _cuobjdump() -> str:
  found = shutil.which("cuobjdump")
  if found:
    return found
  try:
    import triton
  except ImportError:
    raise SystemExit("needs cuobjdump: the CUDA toolkit's, or pip install triton") from None
  return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                      "cuobjdump")


def sass_counts(cubin: bytes, tool: str) -> dict[str, collections.Counter]:
  """Per kernel function of the cubin, its SASS opcodes counted."""
  with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(cubin)
    f.flush()
    sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
  counts = {}
  for part in re.split(r"\n\s+Function : ", sass)[1:]:
    name, body = part.split("\n", 1)
    counts[name.strip()] = collections.Counter(
      m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)",
                                      body))
  return counts


def main():
  tree = sys.argv[1] if len(sys.argv) > 1 else "leaves"
  plans = (sys.argv[2] if len(sys.argv) > 2 else "384/112,384/112:select").split(",")
  name = sys.argv[3] if len(sys.argv) > 3 else "adam"
  tool = _cuobjdump()
  opt = OPTIMIZERS[name]
  params = abstract_tree(tree, opt.dtype)
  print(f"# jax {jax.__version__}; {name} on {tree}, fused apply, compiled for a "
        "compile-only H200 (sm_90); per kernel: launches, instructions, "
        + ", ".join(COUNTED), flush=True)
  for spec in plans:
    PlanVariant.parse(spec)  # a bad spec stops the run before any compile
  for spec in plans:
    with plan_variant(spec) as variant:
      tx, fn = jax_step("optirs-apply", opt, variant.options())
      state = jax.eval_shape(tx.init, params)
      t0 = time.perf_counter()
      lowered = lower_for_h200(fn, params, state, params)
      t1 = time.perf_counter()
      compiled = lowered.compile()
      t2 = time.perf_counter()
    kernels = collections.Counter()
    for cubin in cubins(compiled):
      for kernel, ops in sass_counts(cubin, tool).items():
        kernels[(kernel.split("__")[0], tuple(ops[o] for o in COUNTED),
                 sum(ops.values()))] += 1
    print(f"plan {spec}: lower {t1 - t0:.2f} s, compile {t2 - t1:.2f} s", flush=True)
    for (kernel, row, total), count in sorted(kernels.items(), key=lambda kv: -kv[0][2]):
      print(f"  {kernel:32s} x{count:3d}: {total:6d} instructions, "
            + ", ".join(f"{op} {n}" for op, n in zip(COUNTED, row)), flush=True)


if __name__ == "__main__":
  main()

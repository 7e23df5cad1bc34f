"""Registers per thread and code size of each kernel XLA compiles a bench case's fused apply
into for a compile-only H200 (no GPU needed: jax's CUDA plugin, XLA's Triton and ptxas, as
``benchmarks/xla_sass.py``; no disassembler either: both numbers are read from the cubins'
ELF sections, the registers from ``.nv.info``'s ``EIATTR_REGCOUNT`` records).

    PYTHONPATH=. python benchmarks/kernel_registers.py [tree] [case] [policy:warps:coder ...]

``tree``: a bench tree (default ``gpt2``); ``case``: a name of
``optirs_jax.bench.cases.OPTIMIZERS`` (default ``adamw8bit``); each spec sets
``ExecutorOptions.large_leaf_policy``, the 8-bit kernels' warps and
``dynamic_map_coder`` (default ``group:1:table``). A one-warp program of more than 64
registers a thread leaves fewer than the SM's 32 resident programs (65536 registers).
"""

import collections
import struct
import sys

import jax

import optirs_jax
from optirs_jax.bench.cases import OPTIMIZERS, abstract_tree, jax_step
from optirs_jax.bench.compile_only import lower_for_h200

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from xla_sass import cubins

EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 0x04


def _sections(elf: bytes) -> dict[str, tuple]:
  """Section headers of a 64-bit little-endian ELF by name."""
  shoff, = struct.unpack_from("<Q", elf, 0x28)
  entsize, count, names = struct.unpack_from("<HHH", elf, 0x3A)
  headers = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize) for i in range(count)]
  table = headers[names][4]
  name = lambda h: elf[table + h[0]:elf.index(b"\0", table + h[0])].decode()
  return {name(h): h for h in headers}


def registers(elf: bytes) -> dict[str, tuple[int, int]]:
  """Per kernel function of a cubin: (registers a thread, bytes of code)."""
  sec = _sections(elf)
  symtab, strtab = sec[".symtab"], sec[".strtab"]
  symbols = []
  for i in range(symtab[5] // 24):
    at = strtab[4] + struct.unpack_from("<I", elf, symtab[4] + 24 * i)[0]
    symbols.append(elf[at:elf.index(b"\0", at)].decode())
  out = {}
  info = sec[".nv.info"]
  p, end = info[4], info[4] + info[5]
  while p < end:  # records: format, attribute, then a size and a payload, or a value
    fmt, attr = elf[p], elf[p + 1]
    if fmt != EIFMT_SVAL:
      p += 4
      continue
    size, = struct.unpack_from("<H", elf, p + 2)
    if attr == EIATTR_REGCOUNT:
      sym, value = struct.unpack_from("<II", elf, p + 4)
      text = sec.get(".text." + symbols[sym])
      out[symbols[sym]] = (value, text[5] if text else 0)
    p += 4 + size
  return out


def main(argv):
  tree = argv[1] if len(argv) > 1 else "gpt2"
  name = argv[2] if len(argv) > 2 else "adamw8bit"
  specs = argv[3:] or ["group:1:table"]
  opt = OPTIMIZERS[name]
  params = abstract_tree(tree, opt.dtype)
  print(f"# jax {jax.__version__}; {name} on {tree}, fused apply, compiled for a compile-only "
        "H200 (sm_90): per kernel, launches, registers a thread, bytes of code", flush=True)
  for spec in specs:
    policy, warps, coder = spec.split(":")
    options = optirs_jax.ExecutorOptions(
      large_leaf_policy=policy, dynamic_map_coder=coder,
      quantized_tiling=optirs_jax.Tiling(block_rows=1, num_warps=int(warps)))
    tx, fn = jax_step("optirs-apply", opt, options)
    state = jax.eval_shape(tx.init, params)
    compiled = lower_for_h200(fn, params, state, params).compile()
    kernels = collections.Counter()
    for cubin in cubins(compiled):
      for kernel, (regs, code) in registers(cubin).items():
        kernels[(kernel.split("__")[0], regs, code)] += 1
    print(f"{spec}:", flush=True)
    for (kernel, regs, code), n in sorted(kernels.items(), key=lambda kv: -kv[0][2]):
      print(f"  {kernel:32s} x{n:3d}: {regs:4d} registers, {code:6d} bytes", flush=True)


if __name__ == "__main__":
  main(sys.argv)

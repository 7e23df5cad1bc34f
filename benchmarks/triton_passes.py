"""Where Triton's compile of one grouped launch goes, by pass, as the launch's leaves grow:
the fused apply's distinct Triton kernels for each launch plan are lowered for an abstract
H200 (no GPU needed), compiled for sm_90 by the ``triton`` package in a fresh process
each (``MLIR_ENABLE_TIMING=1``), and each kernel's compile seconds are printed beside the
passes that took the most.

  PYTHONPATH=. python benchmarks/triton_passes.py [tree] [plan,...] [case] [top]

``tree``: a bench tree (``leaves``: 2000 x 16K, ``gpt2``); ``plan``: a launch-plan spec of
:mod:`optirs_jax.bench.variants`; ``case``: a name of ``optirs_jax.bench.cases.OPTIMIZERS``;
``top``: the passes shown per kernel. Needs ``triton`` (``pip install triton``; its wheel
carries ptxas) importable by ``$TRITON_PYTHON`` (default: this interpreter). XLA compiles
the same modules with its own Triton, whose passes are close to, not the same as, these.
"""

import collections
import os
import re
import subprocess
import sys
import tempfile

import jax
from jax._src.pallas.triton import pallas_call_registration

from optirs_jax.bench.cases import OPTIMIZERS, abstract_tree, jax_step
from optirs_jax.bench.compile_only import h200_meshes
from optirs_jax.bench.variants import PlanVariant, plan_variant

TRITON = "__gpu$xla.gpu.triton"
# Compiles one TTIR file for sm_90 (4 warps) and prints the wall seconds; a comment with
# the time keeps Triton's cache from answering.
COMPILE = """
import sys, time
import triton
from triton.backends.compiler import GPUTarget
path = sys.argv[1]
with open(path, "a") as f:
  f.write(f"\\n// {time.time_ns()}\\n")
t0 = time.perf_counter()
triton.compile(path, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(f"compile seconds {time.perf_counter() - t0:.3f}")
"""
PASS_LINE = re.compile(r"^\s+([0-9.]+) \(\s*[0-9.]+%\)\s+(\S.*)$")


def triton_modules(tree: str, name: str, spec: str) -> list[str]:
  """The Triton modules (text) of the case's fused apply under plan ``spec``: one per
  distinct launch (jax lowers a repeated launch once)."""
  opt = OPTIMIZERS[name]
  params = abstract_tree(tree, opt.dtype)
  modules = []
  lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
  try:
    with plan_variant(spec) as variant:
      tx, fn = jax_step("optirs-apply", opt, variant.options())
      state = jax.eval_shape(tx.init, params)
      with jax.sharding.use_abstract_mesh(h200_meshes()[1]):
        jax.export.export(jax.jit(fn, donate_argnums=(0, 1)), platforms=["cuda"],
                          disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
          params, state, params)
  finally:
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower
  return modules


def pass_seconds(module: str, workdir: str) -> tuple[float, dict[str, float]]:
  """(Triton's compile seconds, seconds per pass summed over the pipelines) of ``module``."""
  path = os.path.join(workdir, "kernel.ttir")
  with open(path, "w") as f:
    f.write(module)
  env = dict(os.environ, MLIR_ENABLE_TIMING="1", TRITON_CACHE_DIR=os.path.join(workdir, "cache"),
             TRITON_DEFAULT_FP_FUSION="1")
  python = os.environ.get("TRITON_PYTHON", sys.executable)
  run = subprocess.run([python, "-c", COMPILE, path], capture_output=True, text=True, env=env)
  if run.returncode:
    raise RuntimeError(f"triton could not compile the kernel:\n{run.stderr[-2000:]}")
  passes = collections.Counter()
  for line in (run.stdout + run.stderr).splitlines():
    m = PASS_LINE.match(line)
    if m and m.group(2) not in ("Total", "Rest"):
      passes[m.group(2).strip()] += float(m.group(1))
  total = float(re.search(r"compile seconds ([0-9.]+)", run.stdout).group(1))
  return total, passes


def main():
  tree = sys.argv[1] if len(sys.argv) > 1 else "leaves"
  plans = (sys.argv[2] if len(sys.argv) > 2 else "378,756,1512/112,2800/112,4000/112").split(",")
  name = sys.argv[3] if len(sys.argv) > 3 else "adam"
  top = int(sys.argv[4]) if len(sys.argv) > 4 else 4
  for spec in plans:
    PlanVariant.parse(spec)  # a bad spec stops the run before any compile
  print(f"# jax {jax.__version__}; {name} on {tree}; each distinct Triton kernel compiled for "
        f"sm_90 by the triton package, pass seconds from MLIR_ENABLE_TIMING", flush=True)
  with tempfile.TemporaryDirectory() as workdir:
    for spec in plans:
      for module in triton_modules(tree, name, spec):
        signature = next(line for line in module.splitlines() if "tt.func" in line)
        leaves = module.count("// leaf ")  # one marked branch per leaf
        total, passes = pass_seconds(module, workdir)
        print(f"plan {spec}: {leaves} leaves, {signature.count('!tt.ptr')} pointers, "
              f"{total:.2f} s; " + ", ".join(f"{p} {s:.3f}" for p, s in passes.most_common(top)),
              flush=True)


if __name__ == "__main__":
  main()

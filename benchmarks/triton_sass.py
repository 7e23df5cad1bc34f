"""What the grouped launches' Triton kernels compile to for an H200 (sm_90), on any machine:
the step's Pallas calls are lowered for CUDA under an abstract H200 (no GPU needed), each
distinct Triton module is compiled by the ``triton`` package, disassembled with its
``cuobjdump``, and its SASS counted by opcode, with Triton's compile seconds.

  PYTHONPATH=. python benchmarks/triton_sass.py [tree] [plan,...] [case]

``tree``: a bench tree (``leaves``: 2000 x 16K, ``gpt2``); ``plan``:
``MAX[/SPLIT][:select|:branch]``, the buffers a launch holds at most and after which it
closes once it holds enough blocks (``plan_grouped_calls``'s ``max_pointers`` and
``split_pointers``; SPLIT defaults to MAX), ``:select`` for the leaf table's search
without its per-leaf marks, ``:branch`` for one branch per leaf around its loads and
stores; ``case``: a name of ``optirs_jax.bench.cases.OPTIMIZERS``. Needs ``triton`` (``pip
install triton``: its wheel carries ptxas and cuobjdump). XLA compiles the same modules
with its own Triton, so the counts are close to, not the same as, what runs on the GPU.

Every program runs the instructions outside the search's branches: where SEL and LDC grow
with the launch's leaves, each program selects among every leaf's pointers.
"""

import collections
import functools
import os
import re
import subprocess
import sys
import time

import jax
from jax._src.pallas.triton import pallas_call_registration

from optirs_jax.bench.cases import OPTIMIZERS, jax_step, tree_shapes
from optirs_jax.pallas import dispatch, grouped, leaf_table
from optirs_jax.planning.layout import plan_grouped_calls

TRITON = "__gpu$xla.gpu.triton"
COUNTED = ("SEL", "LDC", "ULDC", "BRA", "ISETP", "LDG", "STG")


def triton_modules(tree: str, name: str, max_pointers: int, split_pointers: int) -> list[str]:
  """The Triton modules (text) of the case's fused apply, one per Pallas call lowered."""
  opt = OPTIMIZERS[name]
  shapes = tree_shapes(tree, 1.0)
  params = {k: jax.ShapeDtypeStruct(s, opt.dtype) for k, s in shapes.items()}
  tx, fn = jax_step("optirs-apply", opt)
  state = jax.eval_shape(tx.init, params)
  grads = params  # shapes only; the gradients have the params' dtype
  modules = []
  lower = pallas_call_registration.lowering.lower_jaxpr_to_triton_module

  def capture(*args, **kwargs):
    result = lower(*args, **kwargs)
    modules.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  dispatch.plan_grouped_calls = functools.partial(
    plan_grouped_calls, max_pointers=max_pointers, split_pointers=split_pointers)
  pallas_call_registration.lowering.lower_jaxpr_to_triton_module = capture
  grouped._launch.cache_clear()
  jax.clear_caches()
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=None,
                                       platform="cuda")
  try:
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                   abstract_device=device)):
      jax.export.export(jax.jit(fn, donate_argnums=(0, 1)), platforms=["cuda"],
                        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
        params, state, grads)
  finally:
    pallas_call_registration.lowering.lower_jaxpr_to_triton_module = lower
    dispatch.plan_grouped_calls = plan_grouped_calls
  return modules


def sass_counts(module: str, workdir: str, warps: int = 4):
  """(opcode counts of the module's SASS for sm_90, Triton's compile seconds: the less of
  two compiles)."""
  import triton
  from triton.backends.compiler import GPUTarget

  path = os.path.join(workdir, "kernel.ttir")
  seconds = []
  for _ in range(2):  # the first compile in a process also loads the compiler
    with open(path, "w") as f:
      f.write(f"{module}\n// {time.time_ns()}\n")  # a new source: no cached compile
    t0 = time.perf_counter()
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})
    seconds.append(time.perf_counter() - t0)
  cubin = os.path.join(workdir, "kernel.cubin")
  with open(cubin, "wb") as f:
    f.write(kernel.asm["cubin"])
  tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
  sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout
  ops = collections.Counter()
  for line in sass.splitlines():
    m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
    if m:
      ops[m.group(1)] += 1
  return ops, min(seconds)


def main():
  tree = sys.argv[1] if len(sys.argv) > 1 else "leaves"
  plans = (sys.argv[2] if len(sys.argv) > 2 else "378,378:select,756,756:select").split(",")
  name = sys.argv[3] if len(sys.argv) > 3 else "adam"
  try:
    import triton
  except ImportError:
    raise SystemExit("needs the triton package (pip install triton) to compile for "
                     "sm_90") from None
  workdir = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"triton_sass_{os.getpid()}")
  os.makedirs(workdir, exist_ok=True)
  print(f"# jax {jax.__version__}, triton {triton.__version__}; {name} on {tree}; SASS for "
        "sm_90, 4 warps; per distinct kernel: pointer arguments, instructions, "
        + ", ".join(COUNTED) + ", Triton compile s", flush=True)
  for spec in plans:
    bound, *flags = spec.split(":")
    if set(flags) - {"select", "branch"}:
      raise SystemExit(f"unknown plan flags {flags} in {spec!r}; valid: select, branch")
    leaf_table.MARKED_BRANCHES = "select" not in flags
    grouped.POINTER_SELECT = "branch" not in flags
    try:
      pointers, split = (bound.split("/") + [None])[:2]
      modules = triton_modules(tree, name, int(pointers), int(split or pointers))
    finally:
      leaf_table.MARKED_BRANCHES = True
      grouped.POINTER_SELECT = True
    distinct = collections.Counter(modules)
    print(f"plan {spec}: {len(distinct)} distinct Triton kernels (jax lowers a repeated "
          "launch once)", flush=True)
    for module, count in distinct.most_common():
      ops, seconds = sass_counts(module, workdir)
      signature = next(line for line in module.splitlines() if "tt.func" in line)
      pointers = signature.count("!tt.ptr")
      print(f"  x{count:3d}: {pointers:5d} pointers, {sum(ops.values()):6d} instructions, "
            + ", ".join(f"{op} {ops[op]}" for op in COUNTED) + f", {seconds:.2f} s", flush=True)


if __name__ == "__main__":
  main()

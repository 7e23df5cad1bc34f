"""The kernels through XLA's whole CUDA compile for an H200 on a machine without a GPU.

jax's CUDA plugin (``jax-cuda13-plugin`` at jax's version, which ``.ci/run`` installs)
compiles for a compile-only topology built from a device description: XLA's own Triton,
LLVM and the CUDA toolkit's ptxas run on every kernel, which ``jax.export`` (the other
lowering tests) stops short of. The tests skip where the plugin or ptxas is missing, and
on a machine with a GPU, whose own tests compile for it.
"""

import importlib.util
import os
import re
import shutil

import jax
import jax.numpy as jnp
import optax
import pytest

import optirs_jax
from optirs_jax import mixed_precision as mp
from optirs_jax.bench import compile_only
from optirs_jax.pallas import dispatch
from tests import cases
from tests.test_lowering import KWARGS, OPTIMIZERS, TRITON


def _installed(module: str) -> bool:
  """Whether ``module`` can be imported; a missing parent package (no ``jax_plugins`` at
  all, as in a fresh environment) is not installed either, where find_spec would raise."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


def _ptxas() -> str | None:
  cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
  found = shutil.which("ptxas") or os.path.join(cuda, "bin", "ptxas")
  return found if os.path.exists(found) else None


@pytest.fixture(scope="module")
def h200():
  """(a one-device mesh of a compile-only H200, the abstract mesh Pallas lowers under)."""
  if not any(_installed(f"jax_plugins.xla_cuda{v}") for v in (12, 13)):
    pytest.skip("jax's CUDA plugin is not installed (.ci/run installs jax-cuda13-plugin)")
  if _ptxas() is None:
    pytest.skip("no ptxas (the CUDA toolkit) on this machine for XLA's CUDA compile")
  if any(d.platform == "gpu" for d in jax.devices()):
    pytest.skip("a GPU is present: the GPU tests compile for it")
  return compile_only.h200_meshes()


def _compile(step, *args):
  """The optimized HLO text of ``jit(step)`` compiled for the H200 (donating the first two
  arguments, as a training step does)."""
  return compile_only.compile_for_h200(step, *args).as_text()


def test_a_gpu_topology_of_an_nvidia_kind_traces_the_cuda_kernels():
  # A compile-only GPU topology's devices call their platform "gpu"; the kind tells CUDA.
  def mesh(kind):
    return jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
      device_kind=kind, num_cores=None, platform="gpu"))

  assert dispatch._platform_of(mesh("NVIDIA H200")) == "cuda"
  assert dispatch._platform_of(mesh("AMD Instinct MI300X")) is None
  with jax.sharding.use_abstract_mesh(mesh("NVIDIA H200")):
    assert "cuda" in dispatch.lowering_targets()


def test_the_compile_only_h200_is_an_nvidia_gpu(h200):
  _, abstract = h200
  assert dispatch._platform_of(abstract) == "cuda"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_apply_compiles_through_xla_for_an_h200(h200, name, standard_promotion):
  lr = optax.cosine_decay_schedule(1e-3, 100) if cases.takes_schedule(name) else 1e-3
  opt = getattr(optirs_jax, name)(lr, **KWARGS.get(name, {}))
  params = cases.ragged_tree(0)
  text = _compile(lambda p, s, g: optirs_jax.apply(opt, g, s, p), params,
                  opt.init(params), params)
  assert TRITON in text


def test_optax_contract_path_compiles_through_xla_for_an_h200(h200):
  opt = optirs_jax.lamb(1e-3, weight_decay=0.01)
  params = cases.ragged_tree(1)

  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  assert TRITON in _compile(step, params, opt.init(params), params)


def test_many_leaves_compile_in_several_leaf_table_launches(h200):
  # 300 leaves of Adam's 7 buffers: two launches (216 leaves, 12 KB of pointers: CUDA's
  # 32 KB kernel parameters, and 84) of the leaf table's search, each leaf's branch marked
  # with its own inline asm, through XLA's Triton and ptxas.
  opt = optirs_jax.adam(1e-3)
  params = {f"w{i:03d}": jnp.zeros((700 + i,)) for i in range(300)}
  text = _compile(lambda p, s, g: optirs_jax.apply(opt, g, s, p), params,
                  opt.init(params), params)
  assert text.count(f'custom_call_target="{TRITON}"') == 2


def test_master_weights_with_loss_scaling_compile_through_xla_for_an_h200(
    h200, standard_promotion):
  tx = mp.with_loss_scaling(mp.master_weights(optirs_jax.adamw(1e-3)))
  params = {f"w{i}": jnp.ones((i % 5 + 1, 130 + i), jnp.bfloat16) for i in range(30)}
  text = _compile(lambda p, s, g: optirs_jax.apply(tx, g, s, p), params,
                  tx.init(params), params)
  assert text.count(f'custom_call_target="{TRITON}"') == 3


@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
@pytest.mark.parametrize("policy", ["group", "in-place"])
def test_master_weights_with_quantized_state_compile_in_one_kernel(
    h200, fmt, policy, standard_promotion):
  # bfloat16 params, float32 masters, 8-bit moments: the large leaves' kernel reads the
  # bfloat16 gradient, the codes and the master and writes all three back, so one grouped
  # launch for both leaves (or one launch each, "in-place") and the loss scale's check
  # (two launches); XLA decodes no state around them.
  tx = mp.with_loss_scaling(mp.master_weights(optirs_jax.adamw(
      1e-3, state_quantization=fmt, min_quantized_size=1024,
      executor_options=optirs_jax.ExecutorOptions(large_leaf_policy=policy))))
  params = {"w": jnp.ones((64, 512), jnp.bfloat16), "v": jnp.ones((32, 1024), jnp.bfloat16)}
  text = _compile(lambda p, s, g: optirs_jax.apply(tx, g, s, p), params,
                  tx.init(params), params)
  assert text.count(f'custom_call_target="{TRITON}"') == {"group": 1, "in-place": 2}[policy] + 2
  assert ("f8e4m3fn" in text) == (fmt == "fp8")
  # the kernel's outputs: bfloat16 params, both fields' codes and scales, the float32 master
  # (flat buffers in the grouped launch, [blocks, 256] rows in a leaf's own)
  codes = {"dynamic8": "s8", "fp8": "f8e4m3fn"}[fmt]
  shape = {"group": r"\[32768\]\{0\}", "in-place": r"\[128,256\]\{1,0\}"}[policy]
  kernel = re.search(r"\(bf16" + shape + ", " + codes + shape + r".*?\) custom-call", text)
  assert kernel is not None and re.search("f32" + shape + r"\)", kernel.group(0))


@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
def test_8bit_adam_kernels_compile_for_an_h200_in_both_formats(h200, fmt):
  # The fp8 codes are a float32 -> float8_e4m3fn conversion inside the Triton kernel
  # (Pallas's Triton lowering allows it from compute capability 8.9).
  opt = optirs_jax.adamw8bit(1e-3, state_quantization=fmt, min_8bit_size=0)
  params = {"w": jnp.zeros((64, 512))}
  text = _compile(lambda p, s, g: optirs_jax.apply(opt, g, s, p), params,
                  opt.init(params), params)
  assert TRITON in text
  assert ("f8e4m3fn" in text) == (fmt == "fp8")


@pytest.mark.parametrize("coder", ["arithmetic-decode", "arithmetic"])
def test_8bit_kernels_compile_with_each_coder_for_an_h200(h200, coder):
  # The decade constants' coders: a float's exponent bits, shifts and two products per
  # magnitude in the Triton kernel, four blocks a program.
  opts = optirs_jax.ExecutorOptions(dynamic_map_coder=coder,
                                    quantized_tiling=optirs_jax.Tiling(block_rows=4))
  opt = optirs_jax.adamw8bit(1e-3, min_8bit_size=0, executor_options=opts)
  params = {"w": jnp.zeros((64, 512))}
  text = _compile(lambda p, s, g: optirs_jax.apply(opt, g, s, p), params,
                  opt.init(params), params)
  assert TRITON in text


@pytest.mark.parametrize("name, kw", [("lion", {}), ("sgd", {"momentum": 0.9}),
                                      ("rmsprop", {"centered": True})])
@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
def test_quantized_state_runs_in_one_grouped_kernel_for_an_h200(h200, name, kw, fmt):
  # The large leaves' fields are decoded, stepped and encoded inside one grouped Triton
  # launch (no float32 copy of a field between XLA passes); the small float32 leaf runs in
  # the float kernels' grouped launch on the fused apply, and on XLA on optax's contract.
  opt = getattr(optirs_jax, name)(1e-3, **kw, state_quantization=fmt)
  params = {"w": jnp.zeros((64, 512)), "v": jnp.zeros((32, 1024)), "b": jnp.zeros((7,))}
  state = opt.init(params)
  apply = _compile(lambda p, s, g: optirs_jax.apply(opt, g, s, p), params, state, params)
  assert apply.count(f'custom_call_target="{TRITON}"') == 2
  assert ("f8e4m3fn" in apply) == (fmt == "fp8")
  update = _compile(lambda p, s, g: opt.update(g, s, p), params, state, params)
  assert update.count(f'custom_call_target="{TRITON}"') == 1


@pytest.mark.parametrize("ns_dtype", [None, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_muon_momentum_and_stacks_compile_in_one_kernel_each_for_an_h200(
    h200, ns_dtype, monkeypatch):
  # A stack of three matrices, a tall stack of two and a long one (each ending inside a
  # block; the tall ones written wide in float32): the momentum and each stack in one
  # Triton launch each (in a process of one device: this suite's has 4 CPU devices), no
  # copy of a momentum for the in-place write (jax 0.11's XLA copied a momentum whose
  # tail XLA read) and none of a stack; 7 x 9 alone takes optax's program in float32.
  from optirs_jax.orthogonal import _momentum_stack
  monkeypatch.setattr(_momentum_stack, "one_device", lambda: True)
  opt = optirs_jax.muon(0.02, ns_dtype=ns_dtype)
  params = {"w": [jnp.zeros((64, 100))] * 3, "down": [jnp.zeros((100, 64))] * 2,
            "vocab": jnp.zeros((4225, 64)),
            "b": jnp.zeros(64), "odd": jnp.zeros((7, 9))}

  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  text = _compile(step, params, opt.init(params), params)
  calls = [line for line in text.split("\n") if f'custom_call_target="{TRITON}"' in line]
  assert sum("muon_momentum_stack" in line for line in calls) == (3 if ns_dtype is None
                                                                   else 4), calls
  assert not re.search(r"= f32\[[0-9,]+\]\S* copy\(", text), re.findall(r".* copy\(.*", text)

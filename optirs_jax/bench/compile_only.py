"""Compiling for an H200 on a machine without a GPU.

jax's CUDA plugin (``pip install jax-cuda13-plugin==<jax's version>
jax-cuda13-pjrt==<jax's version>``, no CUDA libraries needed) builds a compile-only
topology from a device description; a step sharded on its mesh compiles through XLA's
whole CUDA pipeline (its Triton, LLVM and the CUDA toolkit's ``ptxas``), which
``jax.export`` stops short of. What it gives: whether the kernels compile, the compile's
time, and the executable (``jax.experimental.serialize_executable``) with its cubins.

Example (on a CPU machine with the plugin and ``ptxas``)::

  import jax, optirs_jax
  from optirs_jax.bench.compile_only import compile_for_h200
  opt = optirs_jax.adam(1e-3)
  params = {"w": jax.numpy.zeros((1000, 64))}
  compiled = compile_for_h200(lambda p, s, g: optirs_jax.apply(opt, g, s, p),
                              params, opt.init(params), params)
  assert "__gpu$xla.gpu.triton" in compiled.as_text()
"""

from __future__ import annotations

import functools
import re

import jax

#: An H200's description as XLA's ``GpuTargetConfig`` (sm_90: 132 SMs, 228 KiB of shared
#: memory per SM, 60 MiB of L2, 141 GB of HBM3e at 4.8 TB/s): the fields of the H200 lent
#: to this project that jax 0.10's parser also reads (its own, recorded on jax 0.11.2 by
#: ``benchmarks/run_h200.sh``'s env step, has fields 0.10 rejects). What a compile reads
#: from it is mostly the compute capability and the per-block limits.
H200_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4814304000000
  l2_cache_size: 62914560
  clock_rate_ghz: 1.98
  device_memory_size: 150109880320
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H200"
"""


def _core_count() -> int:
  return int(re.search(r"core_count: (\d+)", H200_TARGET_CONFIG).group(1))


@functools.cache
def h200_meshes():
  """(a one-device mesh of a compile-only H200, the abstract mesh to trace under: Pallas's
  Triton lowering asks the context for the GPU it lowers for)."""
  from jax.experimental import topologies

  topology = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET_CONFIG,
                                          topology="1x1x1")
  device = topology.devices[0]
  mesh = topologies.make_mesh(topo=topology, mesh_shape=(1,), axis_names=("x",))
  abstract = jax.sharding.AbstractMesh(
    (1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,),
    abstract_device=jax.sharding.AbstractDevice(device_kind=device.device_kind,
                                                num_cores=_core_count(), platform="gpu"))
  return mesh, abstract


def on_h200(args):
  """The shapes and dtypes of ``args`` (arrays or ``ShapeDtypeStruct``s) placed on the
  compile-only H200: what to trace and lower a step on, under the abstract mesh of
  :func:`h200_meshes`."""
  sharding = jax.sharding.NamedSharding(h200_meshes()[0], jax.P())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                      args)


def lower_for_h200(step, *args, donate_argnums=(0, 1)) -> jax.stages.Lowered:
  """``jax.jit(step, donate_argnums=...)`` lowered for the compile-only H200, on the
  shapes and dtypes of ``args`` (arrays or ``ShapeDtypeStruct``s)."""
  with jax.sharding.use_abstract_mesh(h200_meshes()[1]):
    return jax.jit(step, donate_argnums=donate_argnums).lower(*on_h200(args))


def compile_for_h200(step, *args, donate_argnums=(0, 1)) -> jax.stages.Compiled:
  """:func:`lower_for_h200`, compiled."""
  return lower_for_h200(step, *args, donate_argnums=donate_argnums).compile()

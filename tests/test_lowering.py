"""The kernels' GPU and TPU lowerings, proven on a CPU machine.

``backend="auto"`` picks the kernel per platform at lowering time, so the same step exported
for ``cuda`` carries the Triton call and exported for ``tpu`` the Mosaic call (against an
abstract device, no accelerator needed). Where libtpu is installed the TPU step is also
compiled for real (compile-only v5e devices), which catches VMEM overflows export misses.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optirs_jax
from tests import cases

TRITON = "__gpu$xla.gpu.triton"
OPTIMIZERS = cases.NAMES
KWARGS = dict(cases.TYPICAL)


def abstract_target(kind: str, platform: str, cores=None):
  dev = jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform=platform)
  return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev))


@pytest.fixture(autouse=True)
def _optax_schedules_need_standard_promotion(standard_promotion):
  yield


def _step_and_shapes(name, params):
  lr = optax.cosine_decay_schedule(1e-3, 100) if cases.takes_schedule(name) else 1e-3
  opt = getattr(optirs_jax, name)(lr, **KWARGS.get(name, {}))

  def step(params, state, grads):  # donated arguments in the order of the outputs
    # The fused apply: on the optax-contract path XLA gets the leaves of elementwise rules
    # (ExecutorOptions.updates_on_reference; test_update_path_* below).
    return optirs_jax.apply(opt, grads, state, params)

  abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  return step, (abstract(params), abstract(opt.init(params)), abstract(params))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_cuda_export_contains_triton_kernel_in_place(name):
  step, shapes = _step_and_shapes(name, cases.ragged_tree(0))
  with abstract_target("NVIDIA H200", "cuda"):
    exp = jax.export.export(
        jax.jit(step, donate_argnums=(0, 1)), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*shapes)
  text = exp.mlir_module()
  assert text.count(TRITON) >= 1
  assert "tf.aliasing_output" in text  # donated state is updated in place


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_tpu_export_contains_mosaic_kernel(name):
  step, shapes = _step_and_shapes(name, cases.ragged_tree(0))
  with abstract_target("TPU v5 lite", "tpu", 1):
    exp = jax.export.export(jax.jit(step), platforms=["tpu"])(*shapes)
  assert "tpu_custom_call" in exp.mlir_module()


def test_cpu_lowering_has_no_kernel_with_auto():
  step, shapes = _step_and_shapes("adam", cases.ragged_tree(0))
  text = jax.jit(step).trace(*shapes).lower(lowering_platforms=("cpu",)).as_text()
  assert TRITON not in text and "tpu_custom_call" not in text


def _libtpu_devices():
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed (.ci/run installs the version jax pins)")
  from jax.experimental import topologies
  return topologies.get_topology_desc("v5e:2x2", "tpu").devices


@pytest.mark.libtpu
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_tpu_full_compile_through_libtpu(name):
  devices = _libtpu_devices()
  # The mesh carries the target's platform and kind into the trace (lowering_targets) and
  # into Pallas's Mosaic lowering, which asks for the TPU generation (jnp.sign in Lion).
  mesh = jax.sharding.Mesh(devices[:1], ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.P())
  step, shapes = _step_and_shapes(name, cases.ragged_tree(0))
  shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                        shapes)
  with jax.set_mesh(mesh):
    compiled = jax.jit(step, donate_argnums=(0, 1)).trace(*shapes).lower().compile()
  assert "tpu_custom_call" in compiled.as_text()


def cuda_triton_calls(step, *args) -> int:
  """How many Triton kernel calls the cuda export of ``jax.jit(step)(*args)`` holds."""
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
  with abstract_target("NVIDIA H200", "cuda"):
    exp = jax.export.export(
        jax.jit(step), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*shapes)
  return exp.mlir_module().count(TRITON)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_update_path_leaves_large_leaves_to_xla_unless_norms_are_needed(name):
  # "big" is exactly the in-place threshold (64 blocks of 4096); "b" is packed. On the
  # optax-contract path an elementwise rule runs every leaf on the reference, which XLA
  # fuses with apply_updates; the fused apply and LAMB (per-leaf norms) run the kernels.
  # (The packed layout gives each its own launch, so the count shows the routing; the
  # default grouped launches would hold both in one either way.)
  opt = getattr(optirs_jax, name)(1e-3, **KWARGS.get(name, {}),
                                  executor_options=cases.leaf_policy("pack", "in-place"))
  params = {"big": jnp.ones((2048, 128)), "b": jnp.ones((7,))}
  state = opt.init(params)

  def contract(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  fused = lambda p, s, g: optirs_jax.apply(opt, g, s, p)
  # (Adafactor factors "big": its row and column means are XLA's, and so is its step.)
  kernels = 1 if optirs_jax.transforms.REGISTRY[name].spec.factored else 2
  assert cuda_triton_calls(fused, params, state, params) == kernels
  norms = optirs_jax.transforms.REGISTRY[name].norms
  assert cuda_triton_calls(contract, params, state, params) == (kernels if norms else 0)


def test_update_path_routing_can_be_turned_off():
  opt = optirs_jax.adam(1e-3, executor_options=cases.leaf_policy(
      "pack", "in-place", updates_on_reference=False))
  params = {"big": jnp.ones((2048, 128)), "b": jnp.ones((7,))}
  assert cuda_triton_calls(lambda p, s, g: opt.update(g, s, p), params, opt.init(params),
                            params) == 2


def test_reference_traces_the_rule_once_per_leaf_shape_and_matches_optax():
  # 40 leaves of two shapes and 3 of a third dtype: inside a trace the reference calls the
  # rule as one jitted function per leaf, so the step's jaxpr holds one call per leaf and
  # one traced rule per distinct (shapes, dtypes), and its results are optax's bit for bit.
  params = {f"a{i:02d}": jnp.full((3, 5), i / 7, jnp.float32) for i in range(20)}
  params |= {f"b{i:02d}": jnp.full((11,), i / 3, jnp.float32) for i in range(20)}
  params |= {f"c{i}": jnp.full((4,), i + 0.5, jnp.bfloat16) for i in range(3)}
  grads = jax.tree.map(lambda x: jnp.sin(x * 3 + 1).astype(x.dtype), params)
  opt = optirs_jax.adamw(1e-2, weight_decay=0.1, backend="jnp")

  def step(p, s, g):
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s

  state = opt.init(params)
  jaxpr = jax.make_jaxpr(step)(params, state, grads).jaxpr
  calls = [e for e in jaxpr.eqns if e.primitive.name in ("pjit", "jit")
           and e.params["name"] == "_rule_on_leaf"]
  assert len(calls) == 43
  assert len({id(e.params["jaxpr"]) for e in calls}) == 3
  want = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(
      *optax.adamw(1e-2, weight_decay=0.1).update(g, s, p)))(params, optax.adamw(
          1e-2, weight_decay=0.1).init(params), grads)
  got = jax.jit(step)(params, state, grads)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               got[0], want[0])

"""optirs_jax.pallas.lazy_branches: each platform's branch is traced only where it is lowered,
and the result is jax.lax.platform_dependent's under every transformation."""

import collections

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optirs_jax.pallas import lazy_branches

CONST = np.arange(5, dtype=np.float32)  # a constant the traced branch closes over


def counted():
  """(branches by platform, trace counts): cuda adds 1, tpu 2, the default doubles; each
  returns a dict, to check the results' structure is kept."""
  traces = collections.Counter()

  def branch(name, fn):
    def run(args):
      traces[name] += 1
      x, y = args
      return {"out": fn(x) + y}
    return run

  return {"cuda": branch("cuda", lambda x: x + 1.0), "tpu": branch("tpu", lambda x: x + 2.0),
          "default": branch("default", lambda x: 2.0 * x)}, traces


def call(branches, x, y):
  return lazy_branches.platform_dependent(
    (x, y), default=branches["default"], cuda=branches["cuda"], tpu=branches["tpu"])["out"]


# Committed to the CPU (which every machine has), so that jit lowers for a platform other
# than the primary's (cuda) wherever the tests run.
CPU = jax.devices("cpu")[0]
X = jax.device_put(jnp.arange(5, dtype=jnp.float32), CPU)
Y = jax.device_put(jnp.float32(0.5), CPU)


def expected(platform, x, y):
  """What ``counted``'s branches compute on ``platform``."""
  return {"cuda": x + 1.0 + y, "tpu": x + 2.0 + y}.get(platform, 2.0 * x + y)


def default_platform():
  """The platform jit compiles for here: ``cuda`` for an NVIDIA GPU."""
  return jax.devices()[0].platform.replace("gpu", "cuda")


def test_first_branch_traced_with_the_step_others_when_lowered_for():
  branches, traces = counted()
  traced = jax.jit(lambda x, y: call(branches, x, y)).trace(X, Y)
  assert traces == {"cuda": 1}  # the primary only
  lowered = traced.lower()  # for this CPU: the default's branch, traced now
  assert traces == {"cuda": 1, "default": 1}
  np.testing.assert_array_equal(lowered.compile()(X, Y), 2.0 * X + Y)


def test_export_for_one_other_platform_traces_only_its_branch():
  branches, traces = counted()
  exp = jax.export.export(jax.jit(lambda x, y: call(branches, x, y)), platforms=["tpu"])(X, Y)
  assert traces == {"cuda": 1, "tpu": 1}
  assert "stablehlo.add" in exp.mlir_module()


def test_export_for_several_platforms_switches_on_the_platform():
  branches, traces = counted()
  exp = jax.export.export(jax.jit(lambda x, y: call(branches, x, y)),
                          platforms=["cpu", "cuda", "tpu"])(X, Y)
  assert set(traces) == {"cuda", "tpu", "default"}
  np.testing.assert_array_equal(exp.call(X, Y), 2.0 * X + Y)  # run on the CPU: its branch


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_runs_the_branch_of_the_default_device(jit):
  # On a GPU the primary (cuda) branch is lowered inline; elsewhere the default's is traced
  # at lowering. Outside jit the primitive is compiled alone, for its operands' device.
  branches, _ = counted()
  x, y = (jax.device_put(a, jax.devices()[0]) for a in (X, Y))
  f = lambda x, y: call(branches, x, y)
  got = (jax.jit(f) if jit else f)(x, y)
  np.testing.assert_array_equal(got, expected(default_platform(), x, y))


def test_primary_lowered_with_its_constants():
  def fn(args):
    x, = args
    return x * jnp.asarray(CONST) + 1.0  # a constant of the traced jaxpr

  f = jax.jit(lambda x: lazy_branches.platform_dependent((x,), cpu=fn, default=lambda a: a[0]))
  np.testing.assert_array_equal(f(X), X * CONST + 1.0)


@pytest.mark.parametrize("transform", ["vmap", "jvp", "grad", "jit-vmap"])
def test_transformations_match_platform_dependent(transform):
  branches, _ = counted()
  ours = lambda x, y: call(branches, x, y)
  ref = lambda x, y: jax.lax.platform_dependent(
    (x, y), default=branches["default"], cuda=branches["cuda"], tpu=branches["tpu"])["out"]
  xs = jax.device_put(jnp.arange(15, dtype=jnp.float32).reshape(3, 5), CPU)
  run = {
    "vmap": lambda f: jax.vmap(f, in_axes=(0, None))(xs, Y),
    "jit-vmap": lambda f: jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, Y),
    "jvp": lambda f: jax.jvp(f, (X, Y), (jnp.ones_like(X), jnp.float32(1.0))),
    "grad": lambda f: jax.grad(lambda x, y: f(x, y).sum(), argnums=(0, 1))(X, Y),
  }[transform]
  chex.assert_trees_all_equal(run(ours), run(ref))
  # Under jit the CPU's branch (the operands are there); outside jit both pick the default
  # device's platform, as jax.lax.platform_dependent's eager platform index does.
  platform = "cpu" if transform == "jit-vmap" else default_platform()
  chex.assert_trees_all_equal(run(ours), run(lambda x, y: expected(platform, x, y)))


def test_branches_that_disagree_in_structure_fail_when_lowered():
  f = lambda x: lazy_branches.platform_dependent(
    (x,), cuda=lambda a: {"out": a[0]}, default=lambda a: (a[0],))
  with pytest.raises(TypeError, match="platform branches must return alike"):
    jax.jit(f).lower(X)


def test_needs_a_named_branch():
  with pytest.raises(ValueError, match="at least one named platform"):
    lazy_branches.platform_dependent((X,), default=lambda a: a)


def test_branches_that_disagree_in_shape_or_dtype_fail_when_lowered():
  f = lambda x: lazy_branches.platform_dependent(
    (x,), cuda=lambda a: a[0], default=lambda a: a[0].astype(jnp.int32))
  with pytest.raises(TypeError, match=r"the cpu branch returns .*int32.*the cuda branch"):
    jax.jit(f).lower(X)

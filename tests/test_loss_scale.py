"""Loss scales against jmp's published semantics, written out in numpy; policies; helpers."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optirs_jax import mixed_precision as mp


def jmp_dynamic_reference(scale, counter, period, factor, min_scale, finite_pattern):
  """jmp's DynamicLossScale.adjust, step by step, in float32 numpy: the (scale, counter)
  after each step of ``finite_pattern``."""
  out = []
  scale, counter = np.float32(scale), int(counter)
  for finite in finite_pattern:
    if finite:
      if counter == period - 1:
        with np.errstate(over="ignore"):
          grown = np.float32(scale * np.float32(factor))
        scale = grown if np.isfinite(grown) else scale
      counter = (counter + 1) % period
    else:
      scale = max(np.float32(min_scale), np.float32(scale / np.float32(factor)))
      counter = 0
    out.append((float(scale), counter))
  return out


PATTERNS = {
    "grow": [True] * 7,
    "backoff": [False] * 3,
    "floor": [False] * 12,  # 2**10 / 2**12 would be 1/4: held at min_loss_scale
    "mixed": [True, True, False, True, True, True, True, False, False, True, True, True],
    "overflow": [True] * 6,
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_dynamic_loss_scale_follows_jmp(pattern, jit):
  start = 3.0e38 if pattern == "overflow" else 2.0**10
  ls = mp.DynamicLossScale(start, period=3, factor=2, min_loss_scale=0.5 if pattern == "floor"
                           else 1.0)
  adjust = jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
  got = []
  for finite in PATTERNS[pattern]:
    ls = adjust(ls, jnp.asarray(finite))
    got.append((float(ls.loss_scale), int(ls.counter)))
  want = jmp_dynamic_reference(start, 0, 3, 2, ls.min_loss_scale, PATTERNS[pattern])
  assert got == want
  if pattern == "floor":
    assert got[-1][0] == 0.5  # the floor holds under jit too


def test_scale_and_unscale_dtypes():
  ls = mp.DynamicLossScale(1024.0)
  tree = {"h": jnp.ones(3, jnp.float16), "b": jnp.ones(3, jnp.bfloat16),
          "f": jnp.ones(3, jnp.float32), "i": jnp.arange(3)}
  scaled = ls.scale(tree)
  assert scaled["h"].dtype == jnp.float32 and float(scaled["h"][0]) == 1024.0
  unscaled = ls.unscale(tree)
  assert {k: v.dtype for k, v in unscaled.items()} == {
      "h": jnp.float32, "b": jnp.float32, "f": jnp.float32, "i": jnp.int32}
  assert float(unscaled["b"][0]) == 1.0 / 1024
  chex.assert_trees_all_equal(unscaled["i"], tree["i"])  # integer leaves untouched
  noop = mp.NoOpLossScale()
  assert noop.unscale(tree) is tree and noop.scale(tree) is tree
  static = mp.StaticLossScale(8.0)
  assert static.adjust(jnp.array(False)) is static
  assert float(static.unscale(jnp.float32(16.0))) == 2.0


def test_loss_scales_are_pytrees_under_jit():
  ls = mp.DynamicLossScale(4.0, period=5)
  leaves, treedef = jax.tree.flatten(ls)
  assert len(leaves) == 2
  again = jax.jit(lambda s: s)(ls)
  assert isinstance(again, mp.DynamicLossScale) and again.period == 5
  assert float(again.loss_scale) == 4.0


@pytest.mark.parametrize("make, match", [
    (lambda: mp.DynamicLossScale(0.0), "loss_scale=0.0 must be positive"),
    (lambda: mp.DynamicLossScale(-2.0), "loss_scale=-2.0 must be positive"),
    (lambda: mp.DynamicLossScale(1.0, period=0), "period=0 must be a whole number >= 1"),
    (lambda: mp.DynamicLossScale(1.0, period=2.5), "period=2.5 must be a whole number >= 1"),
    (lambda: mp.DynamicLossScale(1.0, factor=0.5), "factor=0.5 must be a number >= 1"),
    (lambda: mp.DynamicLossScale(1.0, min_loss_scale=-1.0), "min_loss_scale=-1.0 must be >= 0"),
    (lambda: mp.StaticLossScale(-1.0), "loss_scale=-1.0 must be >= 0"),
    (lambda: mp.get_policy("params=float32,compute=bf17"), "Unknown dtype 'bf17'.*valid"),
    (lambda: mp.get_policy("q=f32"), "Unknown key 'q'.*valid keys"),
    (lambda: mp.get_policy(""), "must be a non-empty string"),
    (lambda: mp.get_policy("p=f32=f16"), "is not key=dtype"),
])
def test_bad_input_is_a_value_error_naming_the_value(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_with_loss_scaling_rejects_other_scales():
  import optirs_jax
  with pytest.raises(TypeError, match="loss_scale=2.0 must be one of"):
    mp.with_loss_scaling(optirs_jax.adam(1e-3), 2.0)


@pytest.mark.parametrize("text", ["params=float32,compute=bfloat16,output=float32",
                                  "p=f32,c=bf16,o=f32", "P=F32, C=BF16, O=F32"])
def test_policy_strings(text):
  policy = mp.get_policy(text)
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
      jnp.float32, jnp.bfloat16, jnp.float32)
  assert str(policy) == "p=full,c=bf16,o=full"  # jmp's short form, read back as is
  assert mp.get_policy(str(policy)) == policy


def test_policy_defaults_and_casts():
  assert mp.get_policy("half") == mp.Policy(jnp.float16, jnp.float16, jnp.float16)
  p = mp.get_policy("c=bf16")
  assert (p.param_dtype, p.output_dtype) == (jnp.float32, jnp.bfloat16)
  tree = {"w": jnp.ones(2), "n": jnp.arange(2), "m": jnp.array([True, False])}
  assert p.cast_to_compute(tree)["w"].dtype == jnp.bfloat16
  assert p.cast_to_compute(tree)["n"].dtype == jnp.int32  # policies never cast integers
  assert p.cast_to_compute(tree)["m"].dtype == jnp.bool_
  assert p.cast_to_param(p.cast_to_compute(tree))["w"].dtype == jnp.float32
  assert p.with_output_dtype(jnp.float16).output_dtype == jnp.float16


def test_all_finite_and_select_tree():
  assert bool(mp.all_finite({})) and bool(mp.all_finite({"a": jnp.ones(2), "i": jnp.arange(3)}))
  assert not bool(mp.all_finite([jnp.ones(2), jnp.array([jnp.nan])]))
  assert not bool(jax.jit(mp.all_finite)({"x": jnp.array([1.0, -jnp.inf], jnp.float16)}))
  a, b = {"x": jnp.ones(2), "y": jnp.zeros(())}, {"x": jnp.zeros(2), "y": jnp.ones(())}
  chex.assert_trees_all_equal(mp.select_tree(jnp.array(True), a, b), a)
  chex.assert_trees_all_equal(jax.jit(mp.select_tree)(jnp.array(False), a, b), b)
  with pytest.raises(ValueError, match="differ in structure"):
    mp.select_tree(jnp.array(True), a, {"x": jnp.zeros(2)})
  with pytest.raises(ValueError, match=r"leaf \['x'\] is float32\[2\] in one tree and "
                                       r"bfloat16\[2\]"):
    mp.select_tree(jnp.array(True), a, {"x": jnp.zeros(2, jnp.bfloat16), "y": jnp.ones(())})
  with pytest.raises(ValueError, match="expected boolean scalar"):
    mp.select_tree(jnp.ones(2, bool), a, b)
  with pytest.raises(AssertionError, match="expected boolean scalar"):  # what jmp raises
    mp.select_tree(jnp.ones(2, bool), a, b)

"""8-bit state for any optimizer (``state_quantization="dynamic8"`` or ``"fp8"``), against
independent references: optax's own optimizer for the float32 step, and the formats
written out in numpy (tests/test_adam8bit.py's dynamic map, tests/test_fp8_state.py's fp8)
for what is stored.

Each step the optax optimizer gets the same gradients and, in place of its own moments,
the values our quantized state stands for: its updates must equal ours, and our new state
must be the numpy format of its new moments."""

import inspect

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optirs_jax
from optirs_jax import mixed_precision as mp
from optirs_jax.quantization import Quantized8bit, quantize_blockwise, state_nbytes
from optirs_jax.transforms import REGISTRY
from tests.states import assert_quantized_close, whole_block_trees
from tests.test_adam8bit import _np_quantize
from tests.test_fp8_state import _np_fp8

OPTIMIZERS = [("adam", {}), ("adamw", {"weight_decay": 0.1}), ("lamb", {}), ("lion", {}),
              ("sgd", {"momentum": 0.9}), ("rmsprop", {"centered": True, "momentum": 0.5}),
              ("adagrad", {})]
# The rest of the catalogue's stateful optimizers, with their typical arguments.
CATALOGUE = [(name, dict(entry.typical)) for name, entry in REGISTRY.items()
             if name not in dict(OPTIMIZERS) and entry.moments
             and "state_quantization" in inspect.signature(entry.make).parameters]
# Every optimizer and format on the reference and on the kernels (interpret mode here: the
# quantized fields decoded and encoded inside the rule's kernel, but LAMB's, whose per-leaf
# norms take a second pass); the rest of the catalogue on the reference in the dynamic map.
CASES = [(o, fmt, b) for o in OPTIMIZERS for fmt in ("dynamic8", "fp8")
         for b in ("jnp", "pallas")] + [(o, "dynamic8", "jnp") for o in CATALOGUE]
# w, v and e quantized (e: a short last block; w and v share a grouped launch on the kernels)
SHAPES = {"w": (8, 512), "v": (2, 3, 256), "e": (3, 700), "b": (37,)}


def _tree(seed, scale=1.0):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(scale * rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}


def _np_format(x, signed: bool, fmt: str) -> np.ndarray:
  """The values the numpy reference of ``fmt`` stores for ``x`` (blocks of 256)."""
  if fmt == "fp8":
    return _np_fp8(np.asarray(x), 256)[2]
  return _np_quantize(np.asarray(x), signed, 256)[0]


def _field(state, name):
  return getattr(state, name)


@pytest.mark.parametrize("opt, fmt, backend", CASES,
                         ids=[f"{o[0]}-{f}-{b}" for o, f, b in CASES])
def test_steps_are_optax_on_the_stored_values_and_store_the_numpy_format(opt, fmt, backend,
                                                                        standard_promotion):
  name, kw = opt
  entry = REGISTRY[name]
  ours = getattr(optirs_jax, name)(1e-2, **kw, state_quantization=fmt, min_quantized_size=1024,
                                   backend=backend)
  ref = entry.optax(1e-2, **kw)
  signed = {f.name: not f.nonneg for f in entry.spec.fields}
  params = _tree(0)
  s, rs = ours.init(params), ref.init(params)
  per_leaf = {f.name for f in entry.spec.fields if f.per_leaf}  # one scalar a leaf: kept
  for field, _, _ in entry.moments:
    q = _field(s, field)
    if q is None or field in per_leaf:
      assert not isinstance(q, Quantized8bit)
      continue
    assert isinstance(q, Quantized8bit)
    assert isinstance(q.absmax["b"], optax.MaskedNode) and q.codes["b"].dtype == jnp.float32
    assert q.codes["w"].dtype == {"fp8": jnp.float8_e4m3fn, "dynamic8":
                                  jnp.int8 if signed[field] else jnp.uint8}[fmt]
    assert q.absmax["w"].shape == (8, 2) and q.absmax["e"].shape == (3, 3)
  for t in range(3):
    g = _tree(10 + t, 0.1)
    # optax starts this step from what our state stands for.
    rs = list(rs)
    for field, index, theirs in entry.moments:
      if isinstance(_field(s, field), Quantized8bit):
        rs[index] = rs[index]._replace(**{theirs: _field(s, field).dequantize()})
    rs = tuple(rs)
    u, s = jax.jit(ours.update)(g, s, params)
    ru, rs = jax.jit(ref.update)(g, rs, params)
    # To float32 rounding of the update's terms (XLA contracts multiply-adds in one program
    # and not in the other). Centered RMSprop divides by sqrt(nu - mu^2) and optimistic
    # steps subtract two terms: where those nearly cancel, one ulp shows larger.
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(ru))
    chex.assert_trees_all_close(u, ru, rtol=5e-5 if kw.get("centered") else 1e-6,
                                atol=1e-6 * scale)
    for field, index, theirs in entry.moments:
      q = _field(s, field)
      want = getattr(rs[index], theirs)
      if q is None or field in per_leaf:
        chex.assert_trees_all_close(q, want, rtol=1e-6, atol=1e-9)
        continue
      np.testing.assert_allclose(q.codes["b"], want["b"], rtol=1e-6, atol=1e-9)
      values = q.dequantize()
      for k in ("w", "v", "e"):
        ref_values = _np_format(want[k], signed[field], fmt)
        assert np.mean(np.isclose(values[k], ref_values, rtol=1e-5, atol=0)) > 0.999, (field, k)
        np.testing.assert_allclose(values[k], ref_values, rtol=0.15,
                                   atol=1e-3 * float(np.abs(ref_values).max()))
    params = optax.apply_updates(params, u)


@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
@pytest.mark.parametrize("path", ["update", "apply"])
def test_the_kernels_decode_and_encode_the_fields_of_whole_block_leaves(fmt, path):
  """With the kernels, the leaves whose last axes are whole blocks run in one grouped launch
  that reads the codes (named for the format); a leaf with a short last block takes the jnp
  math."""
  tx = optirs_jax.rmsprop(1e-3, momentum=0.9, state_quantization=fmt, min_quantized_size=1024,
                          backend="pallas")
  params = _tree(0)
  state = tx.init(params)
  step = ((lambda g, s, p: optirs_jax.apply(tx, g, s, p)) if path == "apply"
          else (lambda g, s, p: tx.update(g, s, p)))
  jaxpr = str(jax.make_jaxpr(step)(params, state, params))
  assert jaxpr.count("name=rmsprop_") == 1  # "w" and "v"; "e" (3, 700) has a short block
  assert jaxpr.count(f"name=rmsprop_{fmt}_grouped") == 1
  # The kernel's operands are the codes (8 bits) and scales of both fields, not floats.
  code_dtype = {"fp8": "f8_e4m3fn", "dynamic8": "i8"}[fmt]
  assert f"{code_dtype}[4096]" in jaxpr and f"{code_dtype}[1536]" in jaxpr


@pytest.mark.parametrize("name, kw", [("lion", {}), ("rmsprop", {}), ("adam", {})])
@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
def test_large_leaves_take_about_a_quarter_of_the_bytes(name, kw, fmt):
  params = {"a": jnp.zeros((64, 1024)), "b": jnp.zeros((1024, 768))}
  q = getattr(optirs_jax, name)(1e-3, **kw, state_quantization=fmt).init(params)
  f32 = getattr(optirs_jax, name)(1e-3, **kw).init(params)
  assert state_nbytes(q) <= 0.27 * state_nbytes(f32)


@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
def test_fused_apply_equals_update_and_the_state_goes_through_jit_and_donation(fmt):
  tx = optirs_jax.lion(1e-3, state_quantization=fmt, min_quantized_size=1024)
  params, g = _tree(0), _tree(1, 0.1)
  state = tx.init(params)
  u, s_upd = jax.jit(tx.update)(g, state, params)
  step = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p), donate_argnums=(0, 1))
  p_app, s_app = step(jax.tree.map(jnp.copy, params), tx.init(params), g)
  chex.assert_trees_all_close(p_app, optax.apply_updates(params, u), rtol=1e-6, atol=1e-9)
  assert_quantized_close(s_app.mu, s_upd.mu, step_rtol=0.15)


@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_the_grouped_launch_stores_what_a_launch_per_leaf_stores(name, fmt):
  """The whole-block leaves of one format share one grouped launch (leaves of several sizes,
  float32 and bfloat16 gradients: two runs of dtypes), and give the bits of one launch a
  leaf (``large_leaf_policy="in-place"``) on the fused apply, over three steps."""
  params, grads = whole_block_trees()
  got = {}
  for policy in ("group", "in-place"):
    tx = getattr(optirs_jax, name)(
      1e-2, state_quantization=fmt, min_quantized_size=1024, backend="pallas",
      executor_options=optirs_jax.ExecutorOptions(large_leaf_policy=policy))
    step = jax.jit(lambda p, s, g, tx=tx: optirs_jax.apply(tx, g, s, p))
    jaxpr = str(jax.make_jaxpr(step)(params, tx.init(params), grads[0]))
    grouped, every = jaxpr.count(f"name={name}_{fmt}_grouped"), jaxpr.count(f"name={name}_{fmt}")
    # one grouped launch, or launches of one leaf each ("e" has a short last block: jnp)
    assert (grouped, every > grouped) == {"group": (1, False), "in-place": (0, True)}[policy]
    p, s = params, tx.init(params)
    for g in grads:
      p, s = step(p, s, g)
    got[policy] = (p, s)
  chex.assert_trees_all_equal(got["group"], got["in-place"])


@pytest.mark.parametrize("name, kernel", [("lion", "lion_dynamic8"),
                                          ("adamw8bit", "adam8bit")])
def test_a_leaf_past_the_grouped_launchs_indices_takes_a_launch_of_its_own(
    name, kernel, monkeypatch):
  """The grouped launch indexes a leaf's elements in 32 bits: a larger leaf (here the limit
  lowered to 3000 elements) runs in its own launch, the others grouped, the same numbers."""
  from optirs_jax.transforms import _quantized_launch
  params = {"big": jnp.ones((16, 256)), "small": jnp.ones((8, 256)), "s2": jnp.ones((4, 256))}
  grads = jax.tree.map(lambda x: 0.1 * x, params)
  got = {}
  for policy in ("group", "in-place"):
    kw = {"min_8bit_size": 1024} if name == "adamw8bit" else {
      "state_quantization": "dynamic8", "min_quantized_size": 1024}
    tx = getattr(optirs_jax, name)(
      1e-2, backend="pallas", **kw,
      executor_options=optirs_jax.ExecutorOptions(large_leaf_policy=policy))
    step = jax.jit(lambda p, s, g, tx=tx: optirs_jax.apply(tx, g, s, p))
    if policy == "group":
      monkeypatch.setattr(_quantized_launch, "MAX_GROUPED_LEAF_ELEMENTS", 3000)
      jaxpr = str(jax.make_jaxpr(step)(params, tx.init(params), grads))
      grouped = jaxpr.count(f"name={kernel}_grouped")
      assert grouped == 1 and jaxpr.count(f"name={kernel}") > grouped
    got[policy] = step(params, tx.init(params), grads)
  chex.assert_trees_all_equal(got["group"], got["in-place"])


def test_every_leaf_quantized_but_an_empty_one():
  tx = optirs_jax.adamw(1e-3, state_quantization="dynamic8", min_quantized_size=0)
  params = {"w": jnp.ones((3, 5)), "s": jnp.ones(()), "empty": jnp.ones((0, 4))}
  state = tx.init(params)
  assert state.nu.codes["w"].dtype == jnp.uint8 and state.mu.codes["w"].dtype == jnp.int8
  assert all(isinstance(state.mu.absmax[k], optax.MaskedNode) for k in ("s", "empty"))
  u, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  assert u["empty"].shape == (0, 4) and state.mu.codes["empty"].shape == (0, 4)


@pytest.mark.parametrize("path", ["update", "apply"])
def test_a_skipped_loss_scaled_step_leaves_the_quantized_state_as_it_was(path):
  """A non-finite step decodes, keeps and encodes the state again: the same codes."""
  tx = mp.with_loss_scaling(optirs_jax.adamw(1e-2, state_quantization="dynamic8",
                                             min_quantized_size=1024))
  params = _tree(0)
  if path == "apply":
    step = jax.jit(lambda g, s, p: optirs_jax.apply(tx, g, s, p))
  else:
    step = jax.jit(lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(
        *tx.update(g, s, p)))
  params, state = step(_tree(1, 0.1), tx.init(params), params)  # one finite step first
  bad = _tree(2, 0.1)
  bad["w"] = bad["w"].at[3, 17].set(jnp.inf)
  new_params, new_state = step(bad, state, params)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)


def test_inject_hyperparams_keeps_the_format():
  tx = optax.inject_hyperparams(optirs_jax.sgd, static_args=("state_quantization",))(
      learning_rate=0.1, momentum=0.9, state_quantization="fp8", min_quantized_size=1024)
  params = _tree(0)
  s = tx.init(params)
  _, s = jax.jit(tx.update)(_tree(1), s, params)
  assert s.inner_state.trace.codes["w"].dtype == jnp.float8_e4m3fn


@pytest.mark.parametrize("kw, match", [
    ({"state_quantization": "int4"}, r"state_quantization='int4' is not one of \('dynamic8', "
                                     r"'fp8'\)"),
    ({"state_quantization": "fp8", "quantization_block_size": 100},
     r"quantization_block_size=100 must be a power of two"),
    ({"state_quantization": "fp8", "min_quantized_size": -1}, r"min_quantized_size=-1 must be"),
])
def test_bad_arguments_name_the_value(kw, match):
  with pytest.raises(ValueError, match=match):
    optirs_jax.lion(1e-3, **kw)


@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
def test_master_weights_decode_and_encode_inside_the_kernel(fmt):
  """bfloat16 params with float32 masters: the fused apply's kernel reads the bfloat16
  gradient, the codes and the master, and writes the bfloat16 params, the codes and the
  master (no float32 copy of the state around it), with the reference's numbers."""
  kernel = mp.master_weights(optirs_jax.adamw(1e-2, weight_decay=0.1, state_quantization=fmt,
                                              min_quantized_size=1024, backend="pallas"))
  reference = mp.master_weights(optirs_jax.adamw(1e-2, weight_decay=0.1,
                                                 state_quantization=fmt,
                                                 min_quantized_size=1024, backend="jnp"))
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _tree(0))
  step = lambda tx: jax.jit(lambda g, s, p: optirs_jax.apply(tx, g, s, p))
  jaxpr = str(jax.make_jaxpr(lambda g, s, p: optirs_jax.apply(kernel, g, s, p))(
      params, kernel.init(params), params))
  assert jaxpr.count(f"name=adamw_{fmt}") == 1  # "w" ("e" has a short last block)
  code_dtype = {"fp8": "f8_e4m3fn", "dynamic8": "i8"}[fmt]
  assert f"{code_dtype}[8,512]" in jaxpr and "f32[8,512]" in jaxpr  # codes and master
  p1 = p2 = params
  s1, s2 = kernel.init(params), reference.init(params)
  for t in range(3):
    g = jax.tree.map(lambda x, t=t: (0.1 * jnp.cos(x * (t + 1))).astype(x.dtype), p1)
    p1, s1 = step(kernel)(g, s1, p1)
    p2, s2 = step(reference)(g, s2, p2)
  chex.assert_trees_all_equal_dtypes(p1, params)
  chex.assert_trees_all_close(s1.master, s2.master, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(p1, p2, rtol=2**-7, atol=1e-6)
  for name in ("mu", "nu"):
    a, b = getattr(s1.inner_state, name), getattr(s2.inner_state, name)
    for k in ("w", "e"):  # quantized; "b" is kept in float32 (below min_quantized_size)
      assert_quantized_close(Quantized8bit(a.codes[k], a.absmax[k]),
                             Quantized8bit(b.codes[k], b.absmax[k]), step_rtol=0.15)
    np.testing.assert_allclose(a.codes["b"], b.codes["b"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("name, kw", [("adam", {}), ("adagrad", {}),
                                      ("rmsprop", {"initial_scale": 0.5})])
@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
def test_init_stores_the_numpy_format_of_each_fields_starting_value(name, kw, fmt):
  # The fields are encoded from their constant (no float32 copy of the state is made at
  # init); what is stored is the format of the filled leaf, short last block included.
  tx = getattr(optirs_jax, name)(1e-2, **kw, state_quantization=fmt, min_quantized_size=1024)
  state = tx.init(_tree(0))
  jaxpr = str(jax.make_jaxpr(tx.init)(_tree(0)))
  assert "f32[8,512] = " not in jaxpr and "f32[3,700] = " not in jaxpr  # no float32 field
  spec = REGISTRY[name].spec
  for f in spec.fields:
    q = _field(state, f.name)
    if not isinstance(q, Quantized8bit):
      continue
    value = {"initial_accumulator_value": 0.1, "initial_scale": kw.get("initial_scale")}.get(
        f.init, f.init) if isinstance(f.init, str) else f.init
    for k in ("w", "e"):
      full = np.full(SHAPES[k], value, np.float32)
      np.testing.assert_array_equal(q.dequantize()[k], _np_format(full, not f.nonneg, fmt))
      direct = quantize_blockwise(jnp.asarray(full), signed=not f.nonneg, block_size=256,
                                  state_quantization=fmt)
      np.testing.assert_array_equal(np.asarray(q.codes[k]).view(np.uint8),
                                    np.asarray(direct.codes).view(np.uint8))
      np.testing.assert_array_equal(q.absmax[k], direct.absmax)
    np.testing.assert_array_equal(q.codes["b"], np.full(SHAPES["b"], value, np.float32))

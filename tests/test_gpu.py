"""What only a GPU can show: the Triton kernels run and agree with the reference.

The rest of the suite also runs there: its ``pallas`` and ``auto`` cases execute the Triton
kernels instead of interpret mode. These tests add large and ragged trees, the compiled
program's contents and in-place updates.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optirs_jax
from optirs_jax.transforms import REGISTRY
from tests import cases
from tests.states import nearest_codes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a CUDA GPU; on CPU the kernels are "
    "covered by interpret mode and the cuda export tests")]

NAMES = cases.NAMES
KW = dict(cases.TYPICAL)
BIG = {"emb": (50257, 64), "aligned": (1024, 1024), "w": (768, 3072), "b": (768,), "s": ()}
# (small-leaf policy, large-leaf policy): the packed and the grouped executors.
POLICIES = [("pack", "in-place"), ("group", "in-place"), ("group", "group")]


@pytest.fixture(params=POLICIES, ids=["-".join(p) for p in POLICIES])
def leaf_policy(request):
  return cases.leaf_policy(*request.param)


@pytest.mark.parametrize("name", NAMES)
def test_triton_matches_reference_on_large_ragged_tree(name, leaf_policy):
  kw = KW.get(name, {})
  # backend="pallas": the update path too runs every leaf in the kernels ("auto" hands an
  # elementwise rule's leaves to XLA there, ExecutorOptions.updates_on_reference).
  gpu = getattr(optirs_jax, name)(1e-3, **kw, backend="pallas", executor_options=leaf_policy)
  ref = getattr(optirs_jax, name)(1e-3, **kw, backend="jnp")
  params, grads = cases.ragged_tree(0, shapes=BIG), cases.ragged_tree(1, shapes=BIG)
  s, rs = gpu.init(params), ref.init(params)
  for _ in range(5):
    u, s = jax.jit(gpu.update)(grads, s, params)
    ru, rs = jax.jit(ref.update)(grads, rs, params)
  # State a second pass updates from the norms (NovoGrad's, LARS's) inherits their summation
  # order's last bits; near zero, a few steps' sums cancel.
  state_tol = (dict(rtol=1e-5, atol=1e-8) if REGISTRY[name].norms
               and REGISTRY[name].spec.reduction.fields else dict(rtol=1e-6, atol=1e-9))
  chex.assert_trees_all_close(u, ru, rtol=1e-6, atol=1e-9)
  cases.assert_close(s, rs, **state_tol)
  # The fused apply, in place.
  p, s = jax.jit(lambda g, s, p: optirs_jax.apply(gpu, g, s, p))(grads, gpu.init(params), params)
  ru, rs = jax.jit(ref.update)(grads, ref.init(params), params)
  chex.assert_trees_all_close(p, jax.tree.map(lambda a, b: a + b, params, ru), rtol=1e-6,
                              atol=1e-7)
  cases.assert_close(s, rs, **state_tol)


@pytest.mark.parametrize("name", NAMES)
def test_compiled_gpu_step_runs_the_triton_kernel(name):
  opt = getattr(optirs_jax, name)(1e-3, **KW.get(name, {}))
  params = cases.ragged_tree(0)

  def step(p, s):  # the fused apply (the contract path leaves elementwise rules to XLA)
    return optirs_jax.apply(opt, jax.tree.map(jnp.cos, p), s, p)

  text = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt.init(params)).compile().as_text()
  assert "triton" in text.lower()


def test_bf16_on_gpu_matches_optax():
  params, grads = cases.ragged_tree(0, jnp.bfloat16), cases.ragged_tree(1, jnp.bfloat16)
  ours, ref = optirs_jax.adamw(1e-3), optax.adamw(1e-3)
  u, s = jax.jit(ours.update)(grads, ours.init(params), params)
  with jax.numpy_dtype_promotion("standard"):
    ru, rs = jax.jit(ref.update)(grads, ref.init(params), params)
  chex.assert_trees_all_equal_dtypes(u, ru)
  chex.assert_trees_all_close(u, ru, rtol=2 ** -6, atol=1e-6)


def test_donated_step_reuses_the_donated_buffers(leaf_policy):
  """With params and state donated, the fused step allocates no new buffers for them: the
  outputs live in the donated inputs' memory (JAX may pair equal-shaped buffers either way)."""
  opt = optirs_jax.adam(1e-3, executor_options=leaf_policy)
  params = {"w": jnp.ones((1024, 1024))}
  state = opt.init(params)
  big = lambda p, s: [p["w"], s.mu["w"], s.nu["w"]]
  before = {x.unsafe_buffer_pointer() for x in big(params, state)}
  step = jax.jit(lambda p, s, g: optirs_jax.apply(opt, g, s, p), donate_argnums=(0, 1))
  params, state = step(params, state, {"w": jnp.full((1024, 1024), 0.5)})
  assert {x.unsafe_buffer_pointer() for x in big(params, state)} == before
  np.testing.assert_allclose(np.asarray(state.mu["w"]), 0.05, rtol=1e-6)


@pytest.mark.parametrize("name", ["adam", "lamb", "sgd"])
def test_a_step_donated_in_output_order_compiles_without_copies(name, leaf_policy):
  """Donated in the order of the outputs, a fused step on one large leaf holds no copy of
  it: the kernel reads and writes the donated buffers (benchmarks/NOTES.md, run 2). In
  the other order it held five."""
  opt = getattr(optirs_jax, name)(1e-3, executor_options=leaf_policy)
  params = {"w": jnp.ones((1 << 20,))}
  step = jax.jit(lambda p, s, g: optirs_jax.apply(opt, g, s, p), donate_argnums=(0, 1))
  hlo = step.lower(params, opt.init(params), params).compile().as_text()
  assert not re.findall(r"= f32\[1048576\]\{0\} copy\(", hlo)


@pytest.mark.parametrize("name", NAMES)
def test_triton_inside_shard_map_and_on_a_mesh(name):
  """The kernels inside a user's shard_map (outputs declared varying like the inputs) and
  under jit on a one-device mesh (custom_partitioning) give the unsharded numbers."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P
  kw = KW.get(name, {})
  gpu = getattr(optirs_jax, name)(1e-3, **kw)
  params, grads = cases.ragged_tree(0, shapes=BIG), cases.ragged_tree(1, shapes=BIG)
  step = lambda p, s, g: optirs_jax.apply(gpu, g, s, p)
  want = jax.jit(step)(params, gpu.init(params), grads)
  mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = lambda t: jax.tree.map(lambda _: P(), t)
  sspec = spec(gpu.init(params))
  mapped = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec(params), sspec, spec(grads)),
                                 out_specs=(spec(params), sspec)))
  cases.assert_close(mapped(params, gpu.init(params), grads), want, rtol=1e-6, atol=1e-9)
  place = lambda t: jax.device_put(t, NamedSharding(mesh, P()))
  got = jax.jit(step)(place(params), place(gpu.init(params)), place(grads))
  cases.assert_close(got, want, rtol=1e-6, atol=1e-9)
  assert "triton" in jax.jit(step).lower(place(params), place(gpu.init(params)),
                                         place(grads)).compile().as_text().lower()


def _three_steps_on_kernels_and_reference(make):
  """Three fused steps of ``make(backend)``'s optimizer on :data:`BIG` (one seed's params
  and gradients) with ``backend="auto"`` (the Triton kernels here) and ``"jnp"``: the
  ``(params, state)`` of each, and the kernels' compiled step as HLO text."""
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in BIG.items()}
  grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), params)
  out = {}
  for backend in ("auto", "jnp"):
    tx = make(backend)
    step = jax.jit(lambda p, s, g, tx=tx: optirs_jax.apply(tx, g, s, p))
    p, s = params, tx.init(params)
    for _ in range(3):
      p, s = step(p, s, grads)
    out[backend] = (p, s)
    if backend == "auto":
      text = step.lower(params, tx.init(params), grads).compile().as_text()
  return out["auto"], out["jnp"], text


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("name", ["adam8bit", "adamw8bit", "lion"])
def test_8bit_triton_kernel_matches_reference(name, rows):
  """Fused multiply-adds may round a value at a code boundary the other way: codes agree
  almost everywhere, and where not, by one step; with one or four quantization blocks a
  program (8-bit Adam's kernel, and Lion's through the spec builder's)."""
  opts = optirs_jax.ExecutorOptions(quantized_tiling=optirs_jax.Tiling(block_rows=rows))
  kw = {"state_quantization": "dynamic8"} if name == "lion" else {}
  (p_gpu, s_gpu), (p_ref, s_ref), text = _three_steps_on_kernels_and_reference(
      lambda backend: getattr(optirs_jax, name)(1e-3, **kw, backend=backend,
                                                executor_options=opts))
  assert "triton" in text.lower()
  chex.assert_trees_all_close(p_gpu, p_ref, rtol=1e-5, atol=2e-3 if name == "lion" else 1e-6)
  for field in (("mu",) if name == "lion" else ("mu", "nu")):
    a, b = getattr(s_gpu, field), getattr(s_ref, field)  # Quantized8bit trees
    values_a, values_b = a.dequantize(), b.dequantize()
    for k in ("emb", "aligned", "w"):
      same = np.asarray(a.codes[k]) == np.asarray(b.codes[k])
      assert same.mean() > 0.999, (k, field, same.mean())
      np.testing.assert_allclose(np.asarray(values_a[k]), np.asarray(values_b[k]),
                                 rtol=0.15, atol=1e-12)


def _contract(tx):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return jax.jit(step)


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "inf"])
def test_loss_scaled_contract_path_on_the_kernels_equals_the_reference(finite,
                                                                     standard_promotion):
  """with_loss_scaling(master_weights(adamw)) through update + apply_updates: on the GPU the
  kernels unscale and guard (guarded_update); the same numbers as the jnp reference, and a
  non-finite step changes nothing."""
  from optirs_jax import mixed_precision as mp
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), cases.ragged_tree(0, shapes=BIG))
  grads = jax.tree.map(lambda x: (x * 2.0**8).astype(jnp.bfloat16),
                       cases.ragged_tree(1, shapes=BIG))
  if not finite:
    grads["w"] = grads["w"].at[3, 5].set(jnp.inf)
  make = lambda backend: mp.with_loss_scaling(mp.master_weights(
      optirs_jax.adamw(1e-3, backend=backend)), mp.DynamicLossScale(2.0**8))
  gpu, ref = make("pallas"), make("jnp")  # "auto" leaves this path to XLA
  got = _contract(gpu)(params, gpu.init(params), grads)
  want = _contract(ref)(params, ref.init(params), grads)
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
  assert int(mp.skipped_steps_of(got[1])) == (0 if finite else 1)
  if not finite:
    chex.assert_trees_all_equal(got[0], params)


def test_a_clipped_chain_on_the_kernels_equals_the_reference():
  chain = lambda backend: optax.chain(optax.clip_by_global_norm(1.0),
                                      optirs_jax.adamw(1e-3, backend=backend))
  params, grads = cases.ragged_tree(0, shapes=BIG), cases.ragged_tree(1, shapes=BIG)
  gpu, ref = chain("auto"), chain("jnp")
  step = lambda tx: jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))
  got = step(gpu)(params, gpu.init(params), grads)
  want = _contract(ref)(params, ref.init(params), grads)
  # The global norm is summed blockwise on the GPU: a few ulps from optax's.
  chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("coder", ["table", "arithmetic"])
@pytest.mark.parametrize("bits", [7, 8])
def test_the_dynamic_map_encoder_in_a_triton_kernel_picks_the_nearest_code(bits, coder):
  """Compiled by Triton (gathers from the table's ``Ref``), over every 64th float32 in
  [0, 1] and each map value and midpoint with their neighbours: the nearest code."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton

  from optirs_jax.formats.codes import coder_table, encode_magnitude, magnitude_table
  table = np.asarray(magnitude_table(bits))
  mids = ((table[1:].astype(np.float64) + table[:-1]) / 2).astype(np.float32)
  probe = np.concatenate([table, mids] + [np.nextafter(x, d) for x in (table, mids)
                                          for d in (0, 2)]).clip(0, 1)
  grid = np.arange(0, np.float32(1).view(np.uint32) + 1, 64, dtype=np.uint32).view(np.float32)
  a = np.concatenate([grid, probe]).astype(np.float32)
  a = np.concatenate([a, np.zeros(-len(a) % 1024, np.float32)])

  def body(t_ref, a_ref, o_ref):
    o_ref[...] = encode_magnitude(a_ref[...], bits, t_ref, coder)

  block = pl.BlockSpec((1024,), lambda i: (i,))
  codes = pl.pallas_call(
      body, out_shape=jax.ShapeDtypeStruct(a.shape, jnp.int32), grid=(len(a) // 1024,),
      in_specs=[pl.BlockSpec(coder_table(bits).shape, lambda i: (0,)), block],
      out_specs=block, compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
  )(coder_table(bits), jnp.asarray(a))
  np.testing.assert_array_equal(np.asarray(codes), nearest_codes(a, table))


@pytest.mark.parametrize("coder", ["arithmetic-decode", "arithmetic"])
def test_every_coder_gives_the_table_coders_numbers_in_the_triton_kernels(coder):
  """The coders compute what the table holds: the same params and states, bit for bit."""
  make = lambda c: lambda backend: optirs_jax.adamw8bit(
      1e-3, backend=backend, executor_options=optirs_jax.ExecutorOptions(dynamic_map_coder=c))
  (p_table, s_table), _, _ = _three_steps_on_kernels_and_reference(make("table"))
  (p_coder, s_coder), _, text = _three_steps_on_kernels_and_reference(make(coder))
  assert "triton" in text.lower()
  chex.assert_trees_all_equal((p_table, s_table), (p_coder, s_coder))


@pytest.mark.parametrize("name", ["lion", "adamw", "adamw8bit"])
@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
def test_quantized_grouped_launch_stores_what_a_launch_per_leaf_stores(name, fmt):
  """The 8-bit leaves' grouped Triton launch (one program per quantization block of every
  leaf) against one Triton launch per leaf: the same math on the same blocks (the spec
  builder's kernel, and 8-bit AdamW's own)."""
  kernel = {"adamw8bit": {"dynamic8": "adam8bit", "fp8": "adam_fp8"}[fmt]}.get(
    name, f"{name}_{fmt}")
  got = {}
  for policy in ("group", "in-place"):
    opts = optirs_jax.ExecutorOptions(large_leaf_policy=policy)
    got[policy], _, text = _three_steps_on_kernels_and_reference(
        lambda backend, opts=opts: getattr(optirs_jax, name)(
          1e-3, state_quantization=fmt, backend=backend, executor_options=opts))
    assert (f"{kernel}_grouped" in text) == (policy == "group")
  for a, b in zip(jax.tree.leaves(got["group"]), jax.tree.leaves(got["in-place"])):
    same = np.asarray(a) == np.asarray(b)
    assert same.all(), (a.shape, a.dtype, same.mean())


@pytest.mark.parametrize("name, kw", [("lion", {}), ("sgd", {"momentum": 0.9}),
                                      ("rmsprop", {"momentum": 0.9}), ("adamw", {})])
@pytest.mark.parametrize("fmt", ["dynamic8", "fp8"])
def test_quantized_state_triton_kernel_matches_reference(name, kw, fmt):
  """Any optimizer's 8-bit fields through its Triton kernel against the jnp math: codes
  agree almost everywhere (fused multiply-adds may round a value at a code boundary the
  other way), and where not, by one step."""
  (p_gpu, s_gpu), (p_ref, s_ref), text = _three_steps_on_kernels_and_reference(
      lambda backend: getattr(optirs_jax, name)(1e-3, **kw, state_quantization=fmt,
                                                backend=backend))
  assert f"{name}_{fmt}" in text
  # Lion's and SGD's steps are signs and sums: a moment one code apart moves few elements.
  chex.assert_trees_all_close(p_gpu, p_ref, rtol=1e-5, atol=2e-3 if name == "lion" else 1e-5)
  for a, b in zip(jax.tree.leaves(s_gpu), jax.tree.leaves(s_ref)):
    if a.dtype in (jnp.int8, jnp.uint8, jnp.float8_e4m3fn):
      same = np.asarray(a) == np.asarray(b)
      assert same.mean() > 0.999, (a.shape, same.mean())

"""Multi-device cases, run on 8 CPU devices by tests/test_multi_device.py (in a process of
their own: the device count is fixed when jax starts)."""

import math
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optirs_jax
from optirs_jax import multi_device as md
from optirs_jax.transforms import REGISTRY
from tests import cases

pytestmark = pytest.mark.skipif(jax.device_count() != 8,
                                reason="needs 8 devices (tests/test_multi_device.py starts "
                                       "this module with 8 CPU devices)")

NAMES = list(REGISTRY)
KW = {name: dict(entry.typical) for name, entry in REGISTRY.items()}
SHAPES = {"w": (16, 24), "m": (8, 8, 5), "v": (40,), "s": ()}
MESHES = [(1, 8), (2, 4), (8, 1)]


def tree(seed, shapes=SHAPES):
  keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
  return {k: jax.random.normal(key, s) for key, (k, s) in zip(keys, shapes.items())}


def layouts(kind):
  """Per-leaf PartitionSpecs: data parallel (replicated), FSDP (dim 0 over both axes),
  tensor parallel (the last dim over one axis)."""
  return {"dp": {"w": P(), "m": P(), "v": P(), "s": P()},
          "fsdp": {"w": P(("a", "b")), "m": P(("a", "b")), "v": P(("a", "b")), "s": P()},
          "tp": {"w": P("a", "b"), "m": P(None, "a"), "v": P("b"), "s": P()}}[kind]


def opt(name, backend, **kw):
  return getattr(optirs_jax, name)(1e-2, **KW.get(name, {}), **kw, backend=backend)


def place(t, mesh, specs):
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), t, specs)


def state_specs(state, specs, shapes=SHAPES):
  """The state's specs: each params-shaped field like the params, the rest (the count, one
  scalar per leaf, Adafactor's row and column statistics) replicated."""
  return jax.tree.map(lambda x: P(), state) if specs is None else type(state)(**{
      f: ({k: specs[k] if x.shape == shapes[k] else P() for k, x in v.items()}
          if isinstance(v, dict) else None if v is None else P())
      for f, v in state._asdict().items()})


# Auto axes on every mesh and layout; Explicit axes on the 2x4 mesh, sharded layouts.
PLACEMENTS = [(shape, layout, "Auto") for shape in MESHES for layout in ("fsdp", "tp", "dp")]
PLACEMENTS += [((2, 4), layout, "Explicit") for layout in ("fsdp", "tp")]


# Every placement for one optimizer of each executor path; one (FSDP on a 2x4 Explicit mesh)
# for the rest of the registry, on the kernels, and on the reference too where the rule
# reduces across a leaf (norms, factored statistics). An elementwise rule on the reference
# is XLA's elementwise ops, placed by XLA alike for every optimizer.
SHARDED = [(name, backend, *placement) for name in NAMES for backend in ("jnp", "pallas")
           for placement in (PLACEMENTS if name in cases.PLACEMENT_MATRIX else
                             [((2, 4), "fsdp", "Explicit")])
           if backend == "pallas" or name in cases.CORE or REGISTRY[name].norms
           or REGISTRY[name].spec.factored]


@pytest.mark.parametrize("name, backend, shape, layout, axis_type", SHARDED,
                         ids=[f"{n}-{b}-{s[0]}x{s[1]}-{lay}-{t}" for n, b, s, lay, t in SHARDED])
def test_sharded_step_equals_unsharded_and_keeps_shardings(name, backend, shape, layout,
                                                           axis_type):
  mesh = jax.make_mesh(shape, ("a", "b"), axis_types=(getattr(AxisType, axis_type),) * 2)
  specs = layouts(layout)
  params, grads = tree(0), jax.tree.map(lambda x: 0.5 * x + 0.1, tree(1))
  tx = opt(name, backend)
  fused = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))

  def contract(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  contract = jax.jit(contract)
  want_f = fused(params, tx.init(params), grads)
  want_c = contract(params, tx.init(params), grads)
  with jax.set_mesh(mesh):
    p, g = place(params, mesh, specs), place(grads, mesh, specs)
    s = place(tx.init(params), mesh, state_specs(tx.init(params), specs))
    for step, want in ((fused, want_f), (contract, want_c)):
      got = step(p, s, g)
      cases.assert_close(got, want, rtol=1e-6, atol=1e-7)  # (noisy_sgd's key by its data)
      for x, spec in zip(jax.tree.leaves(got[0]), jax.tree.leaves(
          specs, is_leaf=lambda z: isinstance(z, P))):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (x.sharding,
                                                                                spec)
      hlo = step.lower(p, s, g).compile().as_text()
      # Nothing is gathered; only LAMB's per-leaf norms cross devices (scalars).
      assert "all-gather" not in hlo
      reduced = re.findall(r"= (\([^)]*\)|\S+) all-reduce\(", hlo)
      types = [x.strip() for t in reduced
               for x in re.sub(r"/\*.*?\*/", "", t).strip("()").split(",")]
      if REGISTRY[name].spec.factored and layout != "dp":
        # Adafactor's column means of a leaf whose rows are sharded: vectors of statistics
        # (at most 40 elements here), never a leaf (320 and more).
        sizes = [math.prod(int(n) for n in dims.split(",") if n)
                 for t in reduced for dims in re.findall(r"\w+\[([\d,]*)\]", t)]
        assert sizes and max(sizes) <= 40, reduced
      elif REGISTRY[name].norms and layout != "dp":  # scalars: per leaf, the sums of squares
        assert types and set(types) == {"f32[]"}, reduced
      else:
        assert not reduced, reduced


@pytest.mark.parametrize("backend", ["auto", "jnp", "pallas"])
@pytest.mark.parametrize("name", [n for n in NAMES if not REGISTRY[n].spec.factored])
def test_inside_shard_map_every_backend_runs_on_the_local_shards(name, backend):
  """FSDP inside a user's shard_map: the same numbers as the unsharded step; LAMB told the
  axis computes whole-leaf norms, and per local array without it."""
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  specs = {"w": P("d"), "m": P("d"), "v": P("d"), "s": P()}
  params, grads = tree(0), jax.tree.map(lambda x: 0.5 * x + 0.1, tree(1))
  kw = {"axis_name": "d"} if REGISTRY[name].norms else {}
  tx = opt(name, backend, **kw)
  want = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))(params, tx.init(params), grads)
  sspec = state_specs(tx.init(params), specs)
  step = jax.jit(jax.shard_map(lambda p, s, g: optirs_jax.apply(tx, g, s, p), mesh=mesh,
                               in_specs=(specs, sspec, specs), out_specs=(specs, sspec)))
  if name in cases.NOISY:
    # Each device draws noise for its own shards from the one key, as optax's add_noise
    # does inside a shard_map (not the unsharded leaf's noise): optax's numbers there.
    ref = getattr(optax, name)(1e-2, **KW[name])

    def contract(p, s, g):
      u, s = ref.update(g, s, p)
      return optax.apply_updates(p, u), s

    rspec = jax.tree.map(lambda x: P(), ref.init(params))
    rstep = jax.jit(jax.shard_map(contract, mesh=mesh, in_specs=(specs, rspec, specs),
                                  out_specs=(specs, rspec)))
    with jax.set_mesh(mesh), jax.numpy_dtype_promotion("standard"):  # (optax's arithmetic)
      want = (rstep(place(params, mesh, specs), ref.init(params), place(grads, mesh, specs))[0],
              None)
  with jax.set_mesh(mesh):
    got = step(place(params, mesh, specs), place(tx.init(params), mesh, sspec),
               place(grads, mesh, specs))
  if name in cases.NOISY:
    got, want = got[0], want[0]
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
  if REGISTRY[name].norms:  # without the axis, the trust ratio is per local shard: different
    # (Only the params come out: state made from local norms, as NovoGrad's per-leaf second
    # moment, differs between the devices.)
    local = opt(name, backend)
    step = jax.jit(jax.shard_map(lambda p, s, g: optirs_jax.apply(local, g, s, p)[0],
                                 mesh=mesh, in_specs=(specs, sspec, specs), out_specs=specs))
    with jax.set_mesh(mesh):
      other = step(place(params, mesh, specs), place(tx.init(params), mesh, sspec),
                   place(grads, mesh, specs))
    assert not np.allclose(np.asarray(other["w"]), np.asarray(want[0]["w"]), rtol=1e-6)


def in_shard_map(fn, *args, specs, out_specs, axes=("d",), n=8):
  mesh = jax.make_mesh((n,), axes, axis_types=(AxisType.Auto,))
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out_specs))(*args)


def test_sync_gradients_mean_and_sum():
  g = jnp.arange(16.0).reshape(8, 2)
  mean = in_shard_map(lambda x: md.sync_gradients({"g": x}, "d")["g"], g, specs=P("d"),
                      out_specs=P())
  total = in_shard_map(lambda x: md.sync_gradients({"g": x}, "d", op="sum")["g"], g,
                       specs=P("d"), out_specs=P())
  np.testing.assert_allclose(mean, g.mean(0, keepdims=True))
  np.testing.assert_allclose(total, g.sum(0, keepdims=True))
  tx = md.sync_gradients_transform("d")
  u = in_shard_map(lambda x: tx.update({"g": x}, tx.init({"g": x}))[0]["g"], g, specs=P("d"),
                   out_specs=P())
  np.testing.assert_allclose(u, mean)


def test_sync_errors_name_the_axis_and_the_op():
  with pytest.raises(ValueError, match=r"axis_name 'data' is not an axis of the surrounding "
                                       r"shard_map or pmap \(its axes: \('d',\)\)"):
    in_shard_map(lambda x: md.sync_gradients(x, "data"), jnp.ones(8), specs=P("d"),
                 out_specs=P())
  with pytest.raises(ValueError, match=r"op='max' is not one of \('mean', 'sum'\)"):
    md.sync_gradients(jnp.ones(2), "d", op="max")
  with pytest.raises(ValueError, match="axis_name 'd' is not an axis"):
    md.sync_gradients(jnp.ones(2), "d")  # outside any shard_map


@pytest.mark.parametrize("bad, match", [
    (lambda: md.top_k_compression(0.0, axis_name="d"), r"ratio=0.0 must be in \(0, 1\]"),
    (lambda: md.top_k_compression(1.5, axis_name="d"), r"ratio=1.5 must be in \(0, 1\]"),
    (lambda: md.top_k_compression(0.1, axis_name="d", warmup_steps=-1), "warmup_steps=-1"),
    (lambda: md.powersgd(0, axis_name="d"), "rank=0 must be an int >= 1"),
    (lambda: optirs_jax.lamb(1e-3, axis_name=3), "axis_name=3 must be None"),
])
def test_bad_compression_arguments(bad, match):
  with pytest.raises(ValueError, match=match):
    bad()


def run_compressor(tx, grads_per_device, state=None, axis=8):
  """One update of ``tx`` inside shard_map over ``axis`` devices: (update, state)."""
  g = {"w": grads_per_device}
  init = lambda x: tx.init({"w": x[0]})
  mesh = jax.make_mesh((axis,), ("d",), axis_types=(AxisType.Auto,))
  sm = lambda f, i, o: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o))
  if state is None:
    probe = tx.init({"w": grads_per_device[0]})
    specs = md.state_partition_specs(probe, "d")
    state = sm(init, P("d"), specs)(grads_per_device)
  specs = md.state_partition_specs(state, "d")
  return sm(lambda g, s: tx.update({"w": g["w"][0]}, s), ({"w": P("d")}, specs),
            ({"w": P()}, specs))(g, state)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_top_k_sends_exactly_what_it_drops_from_the_residual(momentum):
  tx = md.top_k_compression(0.1, axis_name="d", momentum=momentum)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  grads = [jax.random.normal(k, (1, 30, 7)) for k in keys]
  state = None
  for g in grads:  # one device: the update is what it sent
    old = state
    update, state = run_compressor(tx, g, state, axis=1)
    old_v = old.residual["w"][0] if old else jnp.zeros((30, 7))
    old_u = old.velocity["w"][0] if old and momentum else jnp.zeros((30, 7))
    added = momentum * old_u + g[0] if momentum else g[0]
    if momentum:  # the velocity's multiply-add may contract into an FMA in the step
      np.testing.assert_allclose(update["w"] + state.residual["w"][0], old_v + added,
                                 rtol=1e-6, atol=1e-6)
    else:  # sent + new residual == old residual + gradient, exactly
      np.testing.assert_array_equal(update["w"] + state.residual["w"][0], old_v + added)
    assert int(jnp.sum(update["w"] != 0)) == 21  # ceil(0.1 * 210)
  stats = md.compression_stats(state)
  assert float(stats["bytes_sent"]) == 21 * 8 and float(stats["dense_bytes"]) == 210 * 4
  assert float(stats["compression_ratio"]) == pytest.approx(5.0)


def test_top_k_update_is_the_mean_of_what_every_device_sent():
  tx = md.top_k_compression(0.05, axis_name="d", momentum=0.0)
  g = jax.random.normal(jax.random.PRNGKey(1), (8, 64))
  update, state = run_compressor(tx, g)
  sent = g - state.residual["w"]  # per device: v = g at the first step
  np.testing.assert_allclose(update["w"], jnp.mean(sent, 0), rtol=1e-6, atol=1e-7)
  assert all(int(jnp.sum(s != 0)) == 4 for s in sent)


def test_top_k_warm_up_raises_the_sparsity_in_four_stages():
  tx = md.top_k_compression(1 / 16, axis_name="d", momentum=0.0, warmup_steps=8)
  assert md._compression.densities(1 / 16, 8) == (0.5, 0.25, 0.125, 0.0625)
  state, sent = None, []
  for _ in range(10):
    _, state = run_compressor(tx, jnp.ones((1, 64)), state, axis=1)
    sent.append(float(md.compression_stats(state)["bytes_sent"]) / 8)
  assert sent == [32, 32, 16, 16, 8, 8, 4, 4, 4, 4]


def test_powersgd_is_exact_on_low_rank_gradients_and_keeps_its_error():
  tx = md.powersgd(rank=2, axis_name="d")
  u, v = jax.random.normal(jax.random.PRNGKey(2), (2, 40, 2))
  g = jnp.stack([(u @ v.T) * (1 + 0.1 * i) for i in range(8)])  # rank 2 on every device
  update, state = run_compressor(tx, g)
  np.testing.assert_allclose(update["w"], jnp.mean(g, 0), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(state.error["w"], g - update["w"][None], rtol=1e-4, atol=1e-4)
  stats = md.compression_stats(state)
  assert float(stats["bytes_sent"]) == 4 * (40 + 40) * 2
  assert float(stats["compression_ratio"]) == pytest.approx(1600 / 160)


def test_powersgd_sends_vectors_whole_and_waits_for_start_step():
  tx = md.powersgd(rank=1, axis_name="d", start_step=1)
  g = jax.random.normal(jax.random.PRNGKey(3), (8, 16, 8))
  update, state = run_compressor(tx, g)  # step 0 < start_step: plain mean
  np.testing.assert_allclose(update["w"], jnp.mean(g, 0), rtol=1e-6)
  assert float(md.compression_stats(state)["compression_ratio"]) == 1.0
  vec = jax.random.normal(jax.random.PRNGKey(4), (8, 5))
  update, state = run_compressor(md.powersgd(axis_name="d"), vec)
  np.testing.assert_allclose(update["w"], jnp.mean(vec, 0), rtol=1e-6)


def train_data_parallel(tx, steps=300):
  """A small MLP regressing a noisy target, trained data-parallel over 8 devices (64
  examples each): the final full-batch loss, which the label noise floors at about 0.01."""
  kx, kw, kn = jax.random.split(jax.random.PRNGKey(5), 3)
  x = jax.random.normal(kx, (512, 16))
  y = jnp.tanh(x @ jax.random.normal(kw, (16, 1)) / 4) + 0.1 * jax.random.normal(kn, (512, 1))
  k1, k2 = jax.random.split(jax.random.PRNGKey(6))
  params = {"w1": jax.random.normal(k1, (16, 64)) / 4, "b1": jnp.zeros(64),
            "w2": jax.random.normal(k2, (64, 1)) / 8, "b2": jnp.zeros(1)}
  loss = lambda p, x, y: jnp.mean(
      (jnp.tanh(x @ p["w1"] + p["b1"][None]) @ p["w2"] + p["b2"][None] - y) ** 2)
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  probe = jax.eval_shape(tx.init, params)
  specs = md.state_partition_specs(probe, "d")
  pspec = jax.tree.map(lambda _: P(), params)
  init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=(pspec,), out_specs=specs))

  def local_step(p, s, x, y):
    # Per-device gradients: differentiate at a varying copy of the replicated params (at
    # the params themselves JAX would already sum the gradients over the devices).
    varying = jax.tree.map(lambda v: jax.lax.pcast(v, ("d",), to="varying"), p)
    g = jax.grad(loss)(varying, x, y)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(jax.shard_map(local_step, mesh=mesh, in_specs=(pspec, specs, P("d"), P("d")),
                               out_specs=(pspec, specs)))
  state = init(params)
  for _ in range(steps):
    # One step at a time: CPU collectives of queued steps can starve a 2-core machine.
    params, state = jax.block_until_ready(step(params, state, x, y))
  return float(loss(params, x, y))


def test_compressed_training_converges_like_uncompressed():
  """Error-feedback top-k (10% of the entries) against the same SGD uncompressed, and
  PowerSGD (rank 4) against the same momentum SGD: final losses within 2%. (With DGC's
  momentum correction and masking the optimizer is a different one: it ends near plain
  SGD, not momentum SGD, on this model.)"""
  steps = 1000
  sgd = train_data_parallel(optax.chain(md.sync_gradients_transform("d"), optirs_jax.sgd(0.1)),
                            steps)
  top_k = train_data_parallel(optax.chain(
      md.top_k_compression(0.1, axis_name="d", momentum=0.0), optirs_jax.sgd(0.1)), steps)
  momentum = train_data_parallel(optax.chain(md.sync_gradients_transform("d"),
                                             optirs_jax.sgd(0.1, momentum=0.9)), steps)
  power = train_data_parallel(optax.chain(md.powersgd(rank=4, axis_name="d"),
                                          optirs_jax.sgd(0.1, momentum=0.9)), steps)
  assert momentum < sgd < 0.02, (momentum, sgd)
  assert abs(top_k - sgd) <= 0.02 * sgd, (sgd, top_k)
  assert abs(power - momentum) <= 0.02 * momentum, (momentum, power)


# 8-bit state: every leaf's last axis a whole number of 256-element blocks on each shard.
SHAPES_8BIT = {"w": (64, 512), "e": (16, 2048), "b": (2048,), "small": (40,)}
LAYOUTS_8BIT = {
    "fsdp": {"w": P(("a", "b")), "e": P("a"), "b": P(("a", "b")), "small": P()},
    "tp": {"w": P("a", "b"), "e": P(None, ("a", "b")), "b": P("b"), "small": P()},
}


# adam8bit on every mesh, layout and axis type; adamw8bit (its decay reads the params) on
# the 4x2 Explicit mesh.
EIGHT_BIT = [(make, backend, layout, mesh, axis) for make in (optirs_jax.adam8bit,
                                                              optirs_jax.adamw8bit)
             for backend in ("jnp", "pallas") for layout in ("fsdp", "tp")
             for mesh in ((8, 1), (4, 2)) for axis in ("Auto", "Explicit")
             if make is optirs_jax.adam8bit or (mesh, axis) == ((4, 2), "Explicit")]


@pytest.mark.parametrize("make, backend, layout, mesh_shape, axis_type", EIGHT_BIT,
                         ids=[f"{m.__name__}-{b}-{lay}-{s[0]}x{s[1]}-{t}"
                              for m, b, lay, s, t in EIGHT_BIT])
def test_8bit_state_is_sharded_as_the_params_and_nothing_is_gathered(make, backend, layout,
                                                                     mesh_shape, axis_type):
  mesh = jax.make_mesh(mesh_shape, ("a", "b"), axis_types=(getattr(AxisType, axis_type),) * 2)
  specs = LAYOUTS_8BIT[layout]
  params, grads = tree(0, SHAPES_8BIT), jax.tree.map(lambda x: 0.5 * x + 0.1, tree(1, SHAPES_8BIT))
  tx = make(1e-2, min_8bit_size=1024, backend=backend)
  fused = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))

  def contract(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  contract = jax.jit(contract)
  state = tx.init(params)
  want = {step: step(params, step(params, state, grads)[1], grads) for step in (fused, contract)}
  with jax.set_mesh(mesh):
    p, g = place(params, mesh, specs), place(grads, mesh, specs)
    s = tx.init(p)  # a plain init of sharded params: the state follows them
    for moment in (s.mu, s.nu):
      for k, spec in specs.items():
        for x in (moment.codes[k], moment.absmax[k]):
          if not isinstance(x, optax.MaskedNode):
            assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (k, spec)
    for step in (fused, contract):
      got = step(p, step(p, s, g)[1], g)
      chex.assert_trees_all_close(got, want[step], rtol=1e-6, atol=1e-7)
      for k, spec in specs.items():
        for x in (got[0][k], got[1].mu.codes[k], got[1].nu.codes[k]):
          assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (k, spec)
      hlo = step.lower(p, s, g).compile().as_text()
      assert "all-gather" not in hlo and "all-to-all" not in hlo
      assert not re.findall(r"all-reduce\(", hlo)


@pytest.mark.parametrize("backend", ["jnp", "pallas"])
def test_8bit_adam_with_links_folded_in_is_sharded_as_the_params(backend):
  """chain(clip_by_global_norm, add_decayed_weights, adamw8bit) through apply: the links run
  in the 8-bit kernel on each shard; the norm's partial sums are the one collective."""
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
  specs = LAYOUTS_8BIT["tp"]
  params, grads = tree(0, SHAPES_8BIT), jax.tree.map(lambda x: 0.5 * x + 0.1, tree(1, SHAPES_8BIT))
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.add_decayed_weights(1e-3),
                   optirs_jax.adamw8bit(1e-2, min_8bit_size=1024, backend=backend))
  step = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))
  want = step(params, step(params, tx.init(params), grads)[1], grads)
  with jax.set_mesh(mesh):
    p, g = place(params, mesh, specs), place(grads, mesh, specs)
    s = tx.init(p)
    got = step(p, step(p, s, g)[1], g)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
    for k, spec in specs.items():
      for x in (got[0][k], got[1][-1].mu.codes[k], got[1][-1].nu.codes[k]):
        assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (k, spec)
    hlo = step.lower(p, s, g).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo


# state_quantization on the other optimizers (their float32 step between a decode and an
# encode): Lion (one signed field) and AdamW (a non-negative one too), both formats, FSDP on
# an Auto mesh and tensor parallel on an Explicit one (sampled: CI's time).
QUANTIZED_STATE = [(name, fmt, layout, axis) for name in ("lion", "adamw")
                   for fmt in ("dynamic8", "fp8")
                   for layout, axis in (("fsdp", "Auto"), ("tp", "Explicit"))]


@pytest.mark.parametrize("name, fmt, layout, axis_type", QUANTIZED_STATE,
                         ids=["-".join(c) for c in QUANTIZED_STATE])
def test_quantized_state_is_sharded_as_the_params_and_nothing_is_gathered(name, fmt, layout,
                                                                          axis_type):
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(getattr(AxisType, axis_type),) * 2)
  specs = LAYOUTS_8BIT[layout]
  params, grads = tree(0, SHAPES_8BIT), jax.tree.map(lambda x: 0.5 * x + 0.1, tree(1, SHAPES_8BIT))
  # fp8 on the kernels (Pallas' interpreter here: the fields decoded and encoded inside the
  # rule's kernel on each device's shard), the dynamic map on the reference.
  tx = getattr(optirs_jax, name)(1e-2, state_quantization=fmt, min_quantized_size=1024,
                                 backend="pallas" if fmt == "fp8" else "auto")
  fused = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))
  want = fused(params, tx.init(params), grads)
  with jax.set_mesh(mesh):
    p, g = place(params, mesh, specs), place(grads, mesh, specs)
    s = tx.init(p)
    got = fused(p, s, g)
    hlo = fused.lower(p, s, g).compile().as_text()
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)
  for k, spec in specs.items():
    for x in (got[0][k], got[1].mu.codes[k]):
      assert x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim), (k, spec)
  assert "all-gather" not in hlo and "all-to-all" not in hlo
  assert not re.findall(r"all-reduce\(", hlo)


@pytest.mark.parametrize("backend", ["jnp", "pallas"])
def test_8bit_inside_shard_map_runs_on_the_local_shards(backend):
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  specs = {"w": P("d"), "e": P("d"), "b": P("d"), "small": P()}
  params, grads = tree(0, SHAPES_8BIT), jax.tree.map(lambda x: 0.5 * x + 0.1, tree(1, SHAPES_8BIT))
  tx = optirs_jax.adamw8bit(1e-2, min_8bit_size=1024, backend=backend)
  want = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))(params, tx.init(params), grads)
  sspec = optirs_jax.quantization.Adam8bitState(
      P(), *[optirs_jax.quantization.Quantized8bit(
          specs, {k: (v if k != "small" else optax.MaskedNode()) for k, v in specs.items()})
          for _ in range(2)])
  step = jax.jit(jax.shard_map(lambda p, s, g: optirs_jax.apply(tx, g, s, p), mesh=mesh,
                               in_specs=(specs, sspec, specs), out_specs=(specs, sspec)))
  with jax.set_mesh(mesh):
    got = step(place(params, mesh, specs), tx.init(place(params, mesh, specs)),
               place(grads, mesh, specs))
  chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-7)


def test_sync_rejects_a_gradient_jax_already_summed_and_names_the_leaf():
  """At the replicated params themselves JAX's gradient is already summed over the devices
  (invariant): averaging it again would give 8x the mean. With a pcast copy it is right."""
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  params, x = {"w": jnp.ones(4)}, jnp.arange(32.0).reshape(8, 4)
  loss = lambda p, x: jnp.sum(p["w"][None] * x)

  def run(fn, pcast):
    def local(p, x):
      at = jax.tree.map(lambda v: jax.lax.pcast(v, ("d",), to="varying"), p) if pcast else p
      return fn(jax.grad(loss)(at, x))
    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P()))(
        params, x)

  mean = run(lambda g: md.sync_gradients(g, "d"), pcast=True)
  np.testing.assert_allclose(mean["w"], x.mean(0))
  for fn in (lambda g: md.sync_gradients(g, "d"),
             lambda g: md.top_k_compression(0.5, axis_name="d").update(
                 g, md.top_k_compression(0.5, axis_name="d").init(g))[0],
             lambda g: md.powersgd(axis_name="d").update(
                 g, md.powersgd(axis_name="d").init(g))[0]):
    with pytest.raises(ValueError, match=r"gradient leaf \['w'\] is already the same on every "
                                         r"device along \('d',\).*8 times the gradient"):
      run(fn, pcast=False)


def test_powersgd_waits_for_start_step_with_a_replicated_initial_error():
  """The error residual starts replicated (zeros from a plain init) and becomes per-device:
  both branches of the start_step conditional vary alike (jax 0.10.2 rejected the cond)."""
  mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
  tx = md.powersgd(1, axis_name="x", start_step=1)
  g = jax.random.normal(jax.random.PRNGKey(0), (8, 16, 8))
  state = tx.init({"w": g[0]})
  replicated = jax.tree.map(lambda _: P(), state)
  per_device = md.state_partition_specs(state, "x")
  f = jax.jit(jax.shard_map(lambda g, s: tx.update({"w": g[0]}, s), mesh=mesh,
                            in_specs=(P("x"), replicated), out_specs=({"w": P()}, per_device)))
  update, state = f(g, state)
  np.testing.assert_allclose(update["w"], jnp.mean(g, 0), rtol=1e-6)  # step 0: plain mean
  assert state.error["w"].shape == (8, 16, 8)


def test_compression_stats_count_bytes_by_dtype():
  tx = md.top_k_compression(0.1, axis_name="d", momentum=0.0)
  g = jax.random.normal(jax.random.PRNGKey(7), (1, 30, 7)).astype(jnp.bfloat16)
  _, state = run_compressor(tx, g, axis=1)
  stats = md.compression_stats(state)
  assert float(stats["dense_bytes"]) == 210 * 2  # bfloat16: 2 bytes an element
  assert float(stats["bytes_sent"]) == 21 * (2 + 4)  # values in bfloat16, int32 indices


# Muon: the stacked matrices spread over the devices, whole, before Newton-Schulz.
MUON_SHAPES = {**{f"w{i}": (64, 128) for i in range(3)}, "up": (128, 64), "b": (128,)}


def _muon_inputs(mesh):
  params = {k: jax.random.normal(jax.random.PRNGKey(i), s)
            for i, (k, s) in enumerate(MUON_SHAPES.items())}
  specs = {k: P("d") if len(s) == 2 else P() for k, s in MUON_SHAPES.items()}
  return params, place(params, mesh, specs)


def _muon_step(tx):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s
  return jax.jit(step)


def _assert_placed_and_equal(new, params, ref):
  """Each new leaf sharded as its param, and the unsharded step's numbers."""
  for k, s in MUON_SHAPES.items():
    assert new[k].sharding.is_equivalent_to(params[k].sharding, len(s)), k
    np.testing.assert_allclose(new[k], ref[k], rtol=1e-5, atol=1e-6)


def _collectives(hlo: str) -> dict:
  return {c: hlo.count(f"{c}(") for c in ("all-reduce", "all-gather", "all-to-all")}


def test_muon_fsdp_iterates_without_collectives_and_keeps_the_numbers():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  plain, params = _muon_inputs(mesh)
  counts = {}
  for steps in (3, 6):
    tx = optirs_jax.muon(0.02, ns_steps=steps)
    state = tx.init(params)
    with jax.set_mesh(mesh):
      step = _muon_step(tx)
      counts[steps] = _collectives(step.lower(params, state, params).compile().as_text())
      new, _ = step(params, state, params)
  # Reshards in and out of the one stack (w0-2 and up's transpose), as many for 6 steps
  # as for 3: none inside the iteration; nothing sums or gathers a matrix.
  assert counts[3] == counts[6], counts
  assert counts[6]["all-reduce"] == 0 and counts[6]["all-gather"] == 0, counts
  assert counts[6]["all-to-all"] > 0, counts
  # Left to GSPMD, the same step gathers (what optax's does): the check can fail.
  with jax.set_mesh(mesh):
    spread_off = optirs_jax.muon(0.02, ns_steps=6, ns_axes=None)
    theirs = _collectives(_muon_step(spread_off).lower(params, state, params).compile()
                          .as_text())
  assert theirs["all-gather"] + theirs["all-reduce"] > 0, theirs
  ref, _ = _muon_step(tx)(plain, tx.init(plain), plain)
  _assert_placed_and_equal(new, params, ref)


def test_muon_on_explicit_axes_spreads_without_a_context_mesh():
  # optax.contrib.muon cannot trace here (its Gram product of a row-sharded matrix is
  # illegally sharded); ours reshards each stack, then each result back.
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  plain, params = _muon_inputs(mesh)
  tx = optirs_jax.muon(0.02)
  new, _ = _muon_step(tx)(params, tx.init(params), params)
  ref, _ = _muon_step(tx)(plain, tx.init(plain), plain)
  _assert_placed_and_equal(new, params, ref)


def test_muon_inside_shard_map_with_replicated_params():
  # Data parallel inside a user's shard_map: every device holds whole matrices; the manual
  # axis is not spread over, and the numbers are the single device's.
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  params, _ = _muon_inputs(mesh)  # the unplaced ones
  tx = optirs_jax.muon(0.02)
  state = tx.init(params)
  local = jax.shard_map(lambda p, s, g: _muon_step(tx)(p, s, g)[0], mesh=mesh,
                        in_specs=P(), out_specs=P())
  got = jax.jit(local)(params, state, params)
  ref, _ = _muon_step(tx)(params, state, params)
  chex.assert_trees_all_close(got, ref, rtol=1e-6, atol=1e-7)


def test_muon_names_unknown_spread_axes():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
  _, params = _muon_inputs(mesh)
  tx = optirs_jax.muon(0.02, ns_axes="model")
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="ns_axes='model' names"):
    tx.update(params, tx.init(params), params)


@pytest.mark.parametrize("backend", ["auto", "jnp", "pallas"])
@pytest.mark.parametrize("name", [n for n in NAMES if REGISTRY[n].spec.factored])
def test_factored_inside_shard_map_is_optax_on_the_local_shards(name, backend):
  """Adafactor inside a user's shard_map: the factored leaves whole on every device (their
  column means are over all rows: a device holding some rows would keep statistics of its
  own, which a replicated state cannot hold, in optax alike), the others sharded, with
  their block RMS of the local shard: optax's adafactor in the same shard_map."""
  mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,))
  specs = {"w": P(), "m": P(), "v": P("d"), "s": P()}
  params, grads = tree(0), jax.tree.map(lambda x: 0.5 * x + 0.1, tree(1))
  tx, ref = opt(name, backend), getattr(optax, name)(1e-2, **KW[name])

  def contract(p, s, g):
    u, s = ref.update(g, s, p)
    return optax.apply_updates(p, u), s

  sspec = state_specs(tx.init(params), specs)
  step = jax.jit(jax.shard_map(lambda p, s, g: optirs_jax.apply(tx, g, s, p), mesh=mesh,
                               in_specs=(specs, sspec, specs), out_specs=(specs, sspec)))
  rspec = tuple(state_specs(part, specs) for part in ref.init(params))  # (optax's chain)
  rstep = jax.jit(jax.shard_map(contract, mesh=mesh, in_specs=(specs, rspec, specs),
                                out_specs=(specs, rspec)))
  with jax.set_mesh(mesh):
    p, g = place(params, mesh, specs), place(grads, mesh, specs)
    got = step(p, place(tx.init(params), mesh, sspec), g)
    with jax.numpy_dtype_promotion("standard"):
      want = rstep(p, place(ref.init(params), mesh, rspec), g)
  chex.assert_trees_all_close(got[0], want[0], rtol=1e-6, atol=1e-7)
  for field, theirs in (("v_row", "v_row"), ("v_col", "v_col"), ("v", "v")):
    chex.assert_trees_all_close(getattr(got[1], field), getattr(want[1][0], theirs),
                                rtol=1e-6, atol=0)
  # The sharded leaf's block RMS is its local shard's: not the unsharded step's.
  whole = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p))(params, tx.init(params), grads)
  assert not np.allclose(np.asarray(got[0]["v"]), np.asarray(whole[0]["v"]), rtol=1e-6)

"""Loss scaling and master weights around the optimizers: the plain optimizer's numbers on
finite steps, bit-identical state on skipped ones, exact rounding of the master, and a
float16 model that trains only with scaling."""

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optirs_jax
from optirs_jax import mixed_precision as mp
from optirs_jax.pallas.dispatch import lowering_targets
from tests import cases

BACKENDS = ["jnp", "pallas"]


def grads_like(params, seed, scale=1.0):
  return jax.tree.map(lambda x: (scale * x).astype(x.dtype), cases.ragged_tree(seed, shapes={
      k: v.shape for k, v in params.items()}))


def fused(tx):
  return jax.jit(lambda g, s, p: optirs_jax.apply(tx, g, s, p))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["adam", "lamb", "sgd", "novograd"])
def test_finite_steps_equal_the_plain_optimizer_on_unscaled_gradients(name, backend):
  kw = {"momentum": 0.9} if name == "sgd" else {}
  inner = getattr(optirs_jax, name)(1e-2, **kw, backend=backend)
  tx = mp.with_loss_scaling(inner, mp.DynamicLossScale(2.0**12, period=2))
  params = cases.ragged_tree(0)
  s, rs = tx.init(params), inner.init(params)
  p, rp = params, params
  for i in range(4):
    g = grads_like(params, i + 1)
    scale = mp.loss_scale_of(s).loss_scale
    u, s = jax.jit(tx.update)(mp.loss_scale_of(s).scale(g), s, p)
    ru, rs = jax.jit(inner.update)(g, rs, rp)
    # The scale is a power of two, so the unscaled gradients are exactly the plain ones;
    # XLA fuses the unscale into the update's expression, where a multiply-add may contract
    # differently: a few ulps of the values added (SGD's trace adds terms of size ~5 that
    # cancel to ~1e-2, so 1e-6 absolute).
    chex.assert_trees_all_close(u, ru, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(s.inner_state, rs, rtol=1e-6, atol=1e-6)
    p, rp = optax.apply_updates(p, u), optax.apply_updates(rp, ru)
  assert float(mp.loss_scale_of(s).loss_scale) == 2.0**14 and float(scale) == 2.0**13
  assert int(mp.skipped_steps_of(s)) == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("path", ["update", "apply"])
def test_a_non_finite_step_changes_nothing_but_the_scale(backend, path):
  tx = mp.with_loss_scaling(optirs_jax.adamw(1e-2, backend=backend))
  params = cases.ragged_tree(0)
  state = tx.init(params)
  step = fused(tx) if path == "apply" else jax.jit(
      lambda g, s, p: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)))
  params, state = step(grads_like(params, 1), state, params)  # one finite step first
  bad = grads_like(params, 2)
  bad["thousand"] = bad["thousand"].at[17].set(jnp.inf)
  new_params, new_state = step(bad, state, params)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert int(mp.skipped_steps_of(new_state)) == 1
  assert float(mp.loss_scale_of(new_state).loss_scale) == 2.0**14
  nan = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), params)
  again, nan_state = step(nan, new_state, new_params)
  chex.assert_trees_all_equal(again, params)
  assert int(nan_state.inner_state.count) == int(state.inner_state.count)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["adam", "lamb", "lion"])
def test_fused_apply_equals_update_then_apply_updates(name, backend):
  tx = mp.with_loss_scaling(getattr(optirs_jax, name)(1e-2, backend=backend))
  params = cases.ragged_tree(0)
  s1 = s2 = tx.init(params)
  p1 = p2 = params
  for i in range(3):
    g = mp.loss_scale_of(s1).scale(grads_like(params, i + 1))
    p1, s1 = fused(tx)(g, s1, p1)
    u, s2 = jax.jit(tx.update)(g, s2, p2)
    p2 = optax.apply_updates(p2, u)
  chex.assert_trees_all_close(p1, p2, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(s1, s2, rtol=1e-6, atol=1e-9)


def _grad_sized_multiplies_escape(jaxpr, sizes) -> list[str]:
  """Multiplies outside any kernel whose output has a gradient's size and reaches a kernel
  or an output (an unscaled copy); the finiteness check's read-only products do not."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      continue
    for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
      found += _grad_sized_multiplies_escape(sub, sizes)
    for value in eqn.params.values():
      for sub in (value if isinstance(value, (tuple, list)) else [value]):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          found += _grad_sized_multiplies_escape(sub.jaxpr, sizes)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          found += _grad_sized_multiplies_escape(sub, sizes)
    if eqn.primitive.name == "mul" and eqn.outvars[0].aval.size in sizes:
      out = eqn.outvars[0]
      readers = [e.primitive.name for e in jaxpr.eqns if out in e.invars]
      if out in jaxpr.outvars or "pallas_call" in readers:
        found.append(f"mul -> {readers}")
  return found


def test_the_kernel_unscales_the_gradients_it_reads():
  """On the fused apply the gradients go into the kernel as they are; multiplies of
  gradient-sized arrays outside it only feed the finiteness check (read-only: on the CPU
  the jnp reference of the check, which XLA fuses into its reduction)."""
  tx = mp.with_loss_scaling(optirs_jax.adam(1e-2, backend="pallas"))
  params = {"a": jnp.ones((37, 5)), "b": jnp.ones(1000)}
  jaxpr = jax.make_jaxpr(lambda g, s, p: optirs_jax.apply(tx, g, s, p))(
      params, tx.init(params), params)
  assert not _grad_sized_multiplies_escape(jaxpr.jaxpr, {185, 1000})
  assert "pallas_call" in str(jaxpr)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inside_chain_and_around_multi_steps(backend, standard_promotion):
  inner = optirs_jax.adam(1e-2, backend=backend)
  params = cases.ragged_tree(0)
  chained = optax.chain(optax.clip_by_global_norm(1.0), mp.with_loss_scaling(inner))
  s = chained.init(params)
  u, s = jax.jit(chained.update)(mp.loss_scale_of(s).scale(grads_like(params, 1, 1e-3)), s,
                                 params)
  assert int(mp.skipped_steps_of(s)) == 0 and mp.loss_scale_of(s).loss_scale > 0
  # Gradient accumulation: MultiSteps inside the scaling.
  tx = mp.with_loss_scaling(optax.MultiSteps(inner, every_k_schedule=2), mp.StaticLossScale(4.0))
  ref = optax.MultiSteps(inner, every_k_schedule=2)
  s, rs = tx.init(params), ref.init(params)
  for i in range(4):
    g = grads_like(params, i + 1)
    u, s = jax.jit(tx.update)(mp.loss_scale_of(s).scale(g), s, params)
    ru, rs = jax.jit(ref.update)(g, rs, params)
    chex.assert_trees_all_equal(u, ru)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_master_weights_params_are_exactly_the_rounded_master(dtype, standard_promotion):
  tx = mp.master_weights(optirs_jax.sgd(0.7, momentum=0.9))
  params = cases.ragged_tree(0, dtype)
  state = tx.init(params)
  assert all(m.dtype == jnp.float32 for m in jax.tree.leaves(state.master))
  for i in range(6):  # large steps: values cross zero and change binade
    updates, state = jax.jit(tx.update)(grads_like(params, i + 1), state, params)
    params = optax.apply_updates(params, updates)
    chex.assert_trees_all_equal(params, jax.tree.map(lambda m: m.astype(dtype), state.master))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["adamw", "lamb", "adamw-master", "fromage", "lars-master"])
def test_the_guard_inside_the_step_keeps_or_takes_it(name, backend, standard_promotion):
  # The fused step's own guard (what with_loss_scaling uses where kernels can run): with
  # finite=False params and state come back bit for bit, the count too; with finite=True
  # the step is the unguarded one.
  inner = getattr(optirs_jax, name.split("-")[0])(1e-2, backend=backend)
  tx = mp.master_weights(inner) if name.endswith("master") else inner
  params = cases.ragged_tree(0, jnp.bfloat16 if name.endswith("master") else jnp.float32)
  state = tx.init(params)
  grads = jax.tree.map(lambda x: (3.0 * x).astype(x.dtype), grads_like(params, 1))
  inv = jnp.float32(1 / 3)
  run = jax.jit(lambda g, s, p, f: tx.update.fused_apply(g, s, p, inv_scale=inv, finite=f))
  plain = jax.jit(lambda g, s, p: tx.update.fused_apply(g, s, p, inv_scale=inv))
  kept_p, kept_s = run(grads, state, params, jnp.bool_(False))
  chex.assert_trees_all_equal((kept_p, kept_s), (params, state))
  took = run(grads, state, params, jnp.bool_(True))
  chex.assert_trees_all_equal(took, plain(grads, state, params))
  assert int(took[1].count) == 1


def test_a_cpu_step_skips_with_a_conditional(standard_promotion):
  # Where only the reference can run, with_loss_scaling skips a non-finite step with a
  # conditional: XLA:CPU compiled the in-kernel guard (a select on the tree-wide flag in
  # every leaf) in 54 s on GPT-2's 148 leaves, the step with the conditional in 2.5 s.
  tx = mp.with_loss_scaling(mp.master_weights(optirs_jax.adamw(1e-3)))
  params = {f"w{i}": jnp.ones((i % 5 + 1, 130 + i), jnp.bfloat16) for i in range(30)}
  text = jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p)).lower(
      params, tx.init(params), params).as_text()
  if lowering_targets():  # a GPU or TPU here: the kernels guard, and nothing else branches
    assert "stablehlo.case" not in text
  else:
    assert "stablehlo.case" in text


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["adamw", "lamb", "lars"])
def test_master_weights_fused_equals_update_path(name, backend, standard_promotion):
  """One kernel pass reads the bfloat16 gradient and the float32 master and writes the
  master, the state and the bfloat16 params: the update path's numbers."""
  tx = mp.master_weights(getattr(optirs_jax, name)(1e-2, backend=backend))
  params = cases.ragged_tree(0, jnp.bfloat16) | {"f32": jnp.linspace(-1.0, 1.0, 300)}
  s1 = s2 = tx.init(params)
  p1 = p2 = params
  for i in range(3):
    g = jax.tree.map(lambda x, k=i + 1: jnp.cos(x * k).astype(x.dtype), p1)
    p1, s1 = fused(tx)(g, s1, p1)
    u, s2 = jax.jit(tx.update)(g, s2, p2)
    p2 = optax.apply_updates(p2, u)
  chex.assert_trees_all_close(s1.master, s2.master, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(p1, p2, rtol=2**-7, atol=1e-6)
  chex.assert_trees_all_equal_dtypes(p1, params)


def test_master_weights_and_loss_scaling_are_three_launches_on_the_gpu(standard_promotion):
  # The finiteness check reads the gradients in one grouped launch and adds its per-block
  # sums per leaf in another; the update is one launch. No XLA reduction per gradient.
  from tests.test_lowering import TRITON, abstract_target
  tx = mp.with_loss_scaling(mp.master_weights(optirs_jax.adamw(1e-3)))
  params = {f"w{i}": jnp.ones((i % 5 + 1, 130 + i), jnp.bfloat16) for i in range(30)}
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        (params, tx.init(params), params))
  with abstract_target("NVIDIA H200", "cuda"):
    exp = jax.export.export(
        jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p)), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*shapes)
  text = exp.mlir_module()
  assert text.count(TRITON) == 3
  # One reduction: the AND of the 30 per-leaf flags (not one per gradient).
  assert text.count("stablehlo.reduce(") == 1 and "stablehlo.scatter" not in text


def _np_all_finite(leaves, inv):
  with np.errstate(over="ignore", invalid="ignore"):
    return all(np.all(np.isfinite(np.asarray(x, np.float32) * np.float32(inv)))
               for x in leaves)


@pytest.mark.parametrize("backend", ["jnp", "pallas"])
def test_unscaled_all_finite_matches_numpy(backend, standard_promotion):
  # Ragged leaves of three dtypes; one bad element at a time, in a leaf's first element,
  # its last (a masked block's tail on the kernel) or the middle of a large leaf. The
  # product is in float32: a float16 gradient of 6e4 times 2 is finite.
  from optirs_jax.mixed_precision._finite import unscaled_all_finite
  rng = np.random.default_rng(0)
  shapes = [(7,), (3, 1000), (5000,), (2, 3, 129)]
  dtypes = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float32]
  leaves = [jnp.asarray(rng.standard_normal(s), d) for s, d in zip(shapes, dtypes)]
  check = jax.jit(lambda xs, inv: unscaled_all_finite(xs, inv, backend=backend))
  assert bool(check(leaves, jnp.float32(0.5)))
  cases_ = [(k, pos, bad) for k in range(len(leaves)) for pos in (0, -1, "mid")
            for bad in (np.inf, -np.inf, np.nan)]
  for k, pos, bad in cases_:
    flat = np.asarray(leaves[k], np.float32).reshape(-1).copy()
    flat[flat.size // 2 if pos == "mid" else pos] = bad
    xs = list(leaves)
    xs[k] = jnp.asarray(flat.reshape(shapes[k]), dtypes[k])
    assert bool(check(xs, jnp.float32(0.5))) == _np_all_finite(xs, 0.5) is False, (k, pos)
  big = [jnp.full((300,), 6e4, jnp.float16), leaves[0]]
  assert bool(check(big, jnp.float32(2.0))) == _np_all_finite(big, 2.0) is True
  huge = [jnp.full((300,), 3e38, jnp.float32)]
  assert bool(check(huge, jnp.float32(2.0))) == _np_all_finite(huge, 2.0) is False
  assert bool(unscaled_all_finite([jnp.arange(3)], None))  # no inexact leaf


@pytest.mark.parametrize("name, field, kw", [
    ("adam", "nu", {"nu_dtype": jnp.bfloat16}), ("adam", "mu", {"mu_dtype": jnp.bfloat16}),
    ("adamw", "nu", {"nu_dtype": jnp.bfloat16}), ("lamb", "nu", {"nu_dtype": jnp.bfloat16}),
    ("lamb", "mu", {"mu_dtype": jnp.bfloat16}), ("rmsprop", "nu", {"nu_dtype": jnp.bfloat16}),
    ("sgd", "trace", {"momentum": 0.9, "accumulator_dtype": jnp.bfloat16})])
def test_low_precision_state_halves_its_bytes(name, field, kw, standard_promotion):
  params = cases.ragged_tree(0)
  full = getattr(optirs_jax, name)(1e-2, **{k: v for k, v in kw.items() if "dtype" not in k})
  half = getattr(optirs_jax, name)(1e-2, **kw)
  nbytes = lambda t: sum(x.nbytes for x in jax.tree.leaves(t))
  s_full, s_half = full.init(params), half.init(params)
  assert nbytes(getattr(s_half, field)) * 2 == nbytes(getattr(s_full, field))
  for backend in BACKENDS:  # and it stays half precision through steps
    tx = getattr(optirs_jax, name)(1e-2, **kw, backend=backend)
    s = tx.init(params)
    for _ in range(2):
      _, s = jax.jit(tx.update)(grads_like(params, 1), s, params)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(getattr(s, field)))


def test_float16_model_trains_with_scaling_and_underflows_without():
  """float16 compute, float32 params: the gradients of a small loss underflow to zero in the
  float16 backward pass unless the loss is scaled."""
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      for width in (64, 64):
        x = nn.tanh(nn.Dense(width, dtype=jnp.float16, param_dtype=jnp.float32)(x))
      return nn.Dense(1, dtype=jnp.float16, param_dtype=jnp.float32)(x)

  x = jax.random.normal(jax.random.PRNGKey(0), (256, 16))
  y = 0.5 * jnp.sin(x[:, :1])
  model = MLP()
  params0 = model.init(jax.random.PRNGKey(1), x)
  loss_fn = lambda p: 1e-4 * jnp.mean((model.apply(p, x).astype(jnp.float32) - y) ** 2)

  def train(scaled: bool, steps=200):
    inner = optirs_jax.adam(1e-2)
    tx = mp.with_loss_scaling(inner) if scaled else inner
    p, s = params0, tx.init(params0)

    @jax.jit
    def step(p, s):
      ls = mp.loss_scale_of(s) if scaled else mp.NoOpLossScale()
      g = jax.grad(lambda p: ls.scale(loss_fn(p)))(p)
      zeros = sum(jnp.sum(v == 0) for v in jax.tree.leaves(g)) / sum(
          v.size for v in jax.tree.leaves(g))
      p, s = optirs_jax.apply(tx, g, s, p)
      return p, s, zeros

    zeros = []
    for _ in range(steps):
      p, s, z = step(p, s)
      zeros.append(float(z))
    return float(loss_fn(p)), zeros

  start = float(loss_fn(params0))
  loss_plain, zeros_plain = train(False)
  loss_scaled, zeros_scaled = train(True)
  # Without scaling a sixth of the gradient entries are exactly zero from the first step
  # and almost all of them by the end; with scaling almost none. The loss shows it.
  first, last = lambda z: float(np.mean(z[:10])), lambda z: float(np.mean(z[-10:]))
  assert first(zeros_plain) > 0.15 and last(zeros_plain) > 0.9, zeros_plain
  assert first(zeros_scaled) < 0.01 and last(zeros_scaled) < 0.1, zeros_scaled
  assert loss_scaled < 1e-3 * start and loss_scaled < 0.01 * loss_plain, (
      start, loss_plain, loss_scaled)


def test_the_kernel_guard_of_a_master_step_reads_and_writes_what_the_plain_step_does(
    standard_promotion):
  # Where every output is in place, the kernel runs the step only when the flag is set (a
  # skipped step leaves the buffers as they were): it reads no old bfloat16 params to keep
  # and selects nothing, so the guarded step moves the bytes of the plain one.
  tx = mp.master_weights(optirs_jax.adamw(1e-2, backend="pallas"))
  params = cases.ragged_tree(0, jnp.bfloat16)
  state = tx.init(params)
  inv = jnp.float32(0.5)
  guarded = jax.make_jaxpr(lambda g, s, p, f: tx.update.fused_apply(
      g, s, p, inv_scale=inv, finite=f))(params, state, params, jnp.bool_(True))
  plain = jax.make_jaxpr(lambda g, s, p: tx.update.fused_apply(g, s, p, inv_scale=inv))(
      params, state, params)
  counts = cases.kernel_memory(guarded)
  assert counts == cases.kernel_memory(plain)
  # g, mu, nu and the master read; the params, mu, nu and the master written, per leaf.
  assert counts and all(loads == stores > 0 for loads, stores in counts)

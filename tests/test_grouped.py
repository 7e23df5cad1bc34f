"""The grouped kernel: many leaves per launch, each in its own buffers.

With the default :class:`optirs_jax.ExecutorOptions` (small and large leaves grouped) every
leaf of a kernel dtype goes through :mod:`optirs_jax.pallas.grouped`, so the parity, apply
and dtype tests on ``backend="pallas"`` run it in interpret mode (the masked loads and
stores the Triton kernel uses). Here: its planner, mixed dtypes in one launch, and the cuda
export (launch counts and in-place aliasing).
"""

import functools
import itertools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import optirs_jax
from optirs_jax.pallas import grouped
from optirs_jax.pallas.grouped import SEGMENT_ROWS, segment_totals
from optirs_jax.planning.layout import (
  MAX_POINTERS_PER_CALL,
  GroupedCall,
  plan_grouped_calls,
  repeating_stretch,
)
from tests import cases
from tests.test_lowering import TRITON, abstract_target, cuda_triton_calls


def test_plan_splits_at_the_pointer_budget_and_skips_empty_leaves():
  calls = plan_grouped_calls([5, 0, 2048, 1025] * 30, block_elems=1024, operands_per_leaf=7,
                             repeat=False)
  per_call = MAX_POINTERS_PER_CALL // 7
  assert [len(c.leaves) for c in calls] == [per_call, 90 - per_call]
  assert [i for c in calls for i in c.leaves] == [i for i in range(120) if i % 4 != 1]
  first = calls[0]
  assert first.sizes[:3] == (5, 2048, 1025) and first.starts[:4] == (0, 1, 3, 5)
  np.testing.assert_array_equal(first.block_owner()[:5], [0, 1, 1, 2, 2])
  assert first.num_blocks == len(first.block_owner())


def test_segment_totals_add_each_leafs_blocks_of_every_launch():
  # Two launches' block sums in one segment launch: leaves of 1 block, of more blocks than
  # one program adds (three programs, the last one partial), a few blocks; the second
  # launch's leaves come after the first's.
  plans = [[1, 2 * SEGMENT_ROWS + 37, 5, 1], [3, 1, SEGMENT_ROWS]]
  calls = []
  for counts in plans:
    starts = tuple(int(s) for s in np.cumsum([0] + counts))
    calls.append(GroupedCall(tuple(range(len(counts))), tuple(c * 1024 for c in counts),
                             starts, 1024))
  rng = np.random.default_rng(1)
  sums = [[rng.random(c.num_blocks).astype(np.float32) for _ in range(2)] for c in calls]
  totals = jax.jit(lambda ps: segment_totals(ps, calls, platform="interpret"))(
      [[jnp.asarray(x) for x in per_call] for per_call in sums])
  assert len(totals) == 2
  for src, t in enumerate(totals):
    want = [np.sum(s[src][a:b], dtype=np.float64)
            for c, s in zip(calls, sums) for a, b in itertools.pairwise(c.starts)]
    assert t.shape == (7,)
    np.testing.assert_allclose(np.asarray(t), want, rtol=1e-6)
  assert segment_totals([[], []], calls, platform="interpret") == []
  with pytest.raises(ValueError, match="need 2 partial sums for each of 2 launches"):
    segment_totals([sums[0], sums[1][:1]], calls, platform="interpret")


# Launches of at most 384 buffers (the 4 KB kernel parameters of every CUDA version): several
# launches of a few dozen leaves.
SMALL_LAUNCHES = optirs_jax.ExecutorOptions(grouped_max_buffers=MAX_POINTERS_PER_CALL)


def test_lamb_holds_no_reduction_or_scatter_on_the_gpu():
  # LAMB's fused apply on 60 leaves: the first pass, the per-leaf totals of its norms and
  # the second pass are grouped launches; no XLA reduction per leaf, no scatter.
  params = {f"w{i:02d}": jnp.zeros((i % 7 + 1, 1000 + i)) for i in range(60)}
  opt = optirs_jax.lamb(1e-3, weight_decay=0.01, executor_options=SMALL_LAUNCHES)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        (params, opt.init(params), params))
  with abstract_target("NVIDIA H200", "cuda"):
    exp = jax.export.export(
        jax.jit(lambda p, s, g: optirs_jax.apply(opt, g, s, p), donate_argnums=(0, 1)),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*shapes)
  text = exp.mlir_module()
  # 60 leaves x 7 buffers in launches of at most 384 buffers is two first-pass launches,
  # then one launch of totals for both;
  # the second pass reads and writes 3 buffers a leaf: one launch.
  assert text.count(TRITON) == 4
  assert "stablehlo.reduce" not in text and "stablehlo.scatter" not in text


def test_plan_splits_at_the_grid_bound():
  calls = plan_grouped_calls([300] * 5, block_elems=128, operands_per_leaf=2, max_blocks=7)
  assert [c.leaves for c in calls] == [(0, 1), (2, 3), (4,)]
  assert all(c.num_blocks <= 7 for c in calls)


def test_plan_closes_a_launch_with_enough_buffers_and_work():
  # 7 buffers a leaf: a launch closes after 16 leaves (112 buffers) once those hold 8192
  # blocks; leaves of few blocks fill the 384-buffer budget (54 leaves) instead.
  plan = functools.partial(plan_grouped_calls, block_elems=1024, operands_per_leaf=7,
                           repeat=False)
  big = plan([1024 * 1024] * 40)
  assert [len(c.leaves) for c in big] == [16, 16, 8]
  small = plan([16 * 1024] * 60)
  assert [len(c.leaves) for c in small] == [54, 6]
  # Work enough only from the 20th leaf on: the launch closes there.
  mixed = plan([1024] * 19 + [8192 * 1024] * 3)
  assert [len(c.leaves) for c in mixed] == [20, 2]
  assert len(plan_grouped_calls([1024 * 1024] * 40, block_elems=1024, operands_per_leaf=7,
                                split_pointers=384)) == 1


@pytest.mark.parametrize("block_elems", [128, 256, 512, 2048])
def test_plan_closes_after_the_same_elements_whatever_the_block(block_elems):
  # The work that closes a launch is 8M elements (8192 blocks of 1024), not a block count:
  # with 256-element blocks, 2000 leaves of 16K stay 10 equal launches of 200 leaves (7
  # buffers a leaf, at most 1512 a launch), not 16 of at most 128.
  plan = functools.partial(plan_grouped_calls, operands_per_leaf=7, max_pointers=1512)
  for sizes in ([16 * 1024] * 2000, [1024 * 1024] * 40, [1000, 3 * 2**20 + 5] * 30):
    want = [c.leaves for c in plan(sizes, block_elems=1024)]
    assert [c.leaves for c in plan(sizes, block_elems=block_elems)] == want
  assert [len(c.leaves) for c in plan([16 * 1024] * 2000, block_elems=block_elems)] == [200] * 10


def _longest_repeat_brute_force(sizes):
  """Every (a, b, period) with at least two periods, checked element by element: the
  longest, then the smallest period, then the first."""
  best = None
  for period in range(1, len(sizes) // 2 + 1):
    for a in range(len(sizes)):
      for b in range(a + 2 * period, len(sizes) + 1, period):
        repeats = all(sizes[i] == sizes[i + period] for i in range(a, b - period))
        if repeats and (best is None or b - a > best[1] - best[0]):
          best = (a, b, period)
  return best


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 3), max_size=14))
def test_repeating_stretch_is_the_longest_repeat(sizes):
  found = repeating_stretch(sizes)
  want = _longest_repeat_brute_force(sizes)
  if want is None:
    assert found is None
    return
  a, b, period = found
  assert b - a == want[1] - want[0] and period <= want[2]
  assert (b - a) % period == 0 and b - a >= 2 * period
  assert sizes[a:b] == sizes[a:a + period] * ((b - a) // period)


# GPT-2's leaves in the tree's order: 12 layers of 12 leaves, then ln_f's two and the
# embeddings.
LAYER = [2304, 1769472, 3072, 2359296, 768, 768, 768, 768, 768, 2359296, 768, 589824]
GPT2_SIZES = LAYER * 12 + [768, 768, 786432, 38597376]


def _check_plan(calls, sizes, operands_per_leaf, max_pointers=MAX_POINTERS_PER_CALL,
                max_blocks=2**31 - 1):
  assert [i for c in calls for i in c.leaves] == [i for i, n in enumerate(sizes) if n]
  for c in calls:
    assert len(c.leaves) * operands_per_leaf <= max_pointers and c.num_blocks <= max_blocks
    assert c.sizes == tuple(sizes[i] for i in c.leaves)


def test_plan_cuts_every_layer_alike():
  # Two layers a launch (168 buffers, 13.8K blocks: past the 112 and 8192 that close one):
  # six equal launches, then the last four leaves. Planned without the repeat, the cuts
  # drift through the layers: seven distinct launches of ten.
  calls = plan_grouped_calls(GPT2_SIZES, block_elems=1024, operands_per_leaf=7)
  _check_plan(calls, GPT2_SIZES, 7)
  assert [len(c.leaves) for c in calls] == [24] * 6 + [4]
  assert len({c.sizes for c in calls}) == 2
  greedy = plan_grouped_calls(GPT2_SIZES, block_elems=1024, operands_per_leaf=7, repeat=False)
  assert (len(greedy), len({c.sizes for c in greedy})) == (10, 7)
  # One buffer a leaf: ten layers would close a launch; the twelve are spread over two.
  calls = plan_grouped_calls(GPT2_SIZES, block_elems=1024, operands_per_leaf=1)
  assert [len(c.leaves) for c in calls] == [72, 72, 4]


def test_plan_splits_a_layer_too_large_for_a_launch_alike_in_every_layer():
  # 20 leaves of 7 buffers do not fit 56 (8 leaves): every layer is cut after its 8th and
  # 16th leaf, with a leaf before the layers and an odd one after.
  sizes = [9] + list(range(100, 120)) * 3 + [5]
  calls = plan_grouped_calls(sizes, block_elems=128, operands_per_leaf=7, max_pointers=56)
  _check_plan(calls, sizes, 7, 56)
  assert [len(c.leaves) for c in calls] == [1] + [8, 8, 4] * 3 + [1]
  assert len({c.sizes for c in calls[1:-1]}) == 3


def test_plan_keeps_the_greedy_cuts_where_nothing_repeats_twice():
  # Equal leaves that fill one launch: no launch would repeat, so the run joins its
  # neighbours as before.
  mixed = plan_grouped_calls([1024] * 19 + [8192 * 1024] * 3, block_elems=1024,
                             operands_per_leaf=7)
  assert [len(c.leaves) for c in mixed] == [20, 2]


@settings(max_examples=100, deadline=None)
@given(prefix=st.lists(st.integers(0, 5000), max_size=5),
       layer=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
       layers=st.integers(1, 9), suffix=st.lists(st.integers(0, 5000), max_size=5),
       operands=st.integers(1, 7), max_pointers=st.sampled_from([7, 28, 64, 384]),
       max_blocks=st.integers(40, 400))
def test_plan_properties(prefix, layer, layers, suffix, operands, max_pointers, max_blocks):
  sizes = prefix + layer * layers + suffix
  kwargs = dict(block_elems=128, operands_per_leaf=operands, max_pointers=max_pointers,
                max_blocks=max_blocks, split_pointers=14, split_blocks=50)
  for repeat in (True, False):
    _check_plan(plan_grouped_calls(sizes, repeat=repeat, **kwargs), sizes, operands,
                max_pointers, max_blocks)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_elems": 0, "operands_per_leaf": 7}, "block_elems=0 must be positive"),
    ({"block_elems": 128, "operands_per_leaf": 400}, "operands_per_leaf=400 must be between"),
    ({"block_elems": 128, "operands_per_leaf": 7, "max_blocks": 1}, "needs 3 blocks"),
])
def test_plan_bad_input(kwargs, match):
  with pytest.raises(ValueError, match=match):
    plan_grouped_calls([300], **kwargs)


def test_plan_refuses_a_leaf_its_32_bit_indices_cannot_reach():
  with pytest.raises(ValueError, match="leaf 1 has 2147483648 elements"):
    plan_grouped_calls([10, 2**31], block_elems=1024, operands_per_leaf=7)


def test_a_leaf_too_large_for_the_grouped_kernel_runs_in_place():
  # 2**31 + 128 elements: past the grouped kernel's 32-bit element indices. The executor
  # sends it to the in-place kernel (its own launch) and groups the small one.
  params = {"big": jax.ShapeDtypeStruct((2**31 + 128,), jnp.float32),
            "small": jax.ShapeDtypeStruct((7,), jnp.float32)}
  opt = optirs_jax.adam(1e-3)
  step = lambda p, s, g: optirs_jax.apply(opt, g, s, p)
  assert cuda_triton_calls(step, params, jax.eval_shape(opt.init, params), params) == 2


@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_leaves_of_different_dtypes_share_a_launch(name):
  # Half-precision leaves compute in float32 and round once, so they are compared with the
  # packed kernel (the same math), not with the half-precision reference: equal in float32
  # to 1e-6. On a GPU the two kernels' float32 results may differ in the last bits, which
  # can move a half-precision rounding: one ulp of a value, or (LAMB writes its updates in
  # the params' dtype before the second pass) one ulp of an update of ~1e-3, about 8e-6.
  params = {"f32": cases.ragged_tree(2)["rows"], "bf16": cases.ragged_tree(3)["thousand"]
            .astype(jnp.bfloat16), "f16": cases.ragged_tree(4)["cube"].astype(jnp.float16)}
  grads = jax.tree.map(lambda x: x * 0.5, params)
  opt = getattr(optirs_jax, name)(1e-3, backend="pallas")
  packed_opt = getattr(optirs_jax, name)(1e-3, backend="pallas",
                                         executor_options=cases.leaf_policy("pack", "in-place"))
  step = lambda p, s, g: optirs_jax.apply(opt, g, s, p)
  packed = jax.jit(lambda p, s, g: optirs_jax.apply(packed_opt, g, s, p))(
      params, opt.init(params), grads)
  ours = jax.jit(step)(params, opt.init(params), grads)
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(packed)):
    rtol = {jnp.dtype(jnp.bfloat16): 2**-7, jnp.dtype(jnp.float16): 2**-10}.get(a.dtype, 1e-6)
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=rtol, atol=1e-9 if rtol == 1e-6 else 1e-5)
  # LAMB: the first pass, the per-leaf totals of its norms, the second pass.
  assert cuda_triton_calls(step, params, opt.init(params), grads) == (3 if name == "lamb" else 1)


def test_one_launch_per_pointer_budget_and_state_in_place():
  # Adam's fused apply reads g, p, mu, nu and writes p, mu, nu: 7 buffers a leaf.
  per_call = optirs_jax.ExecutorOptions().grouped_max_buffers // 7
  params = {f"w{i:03d}": jnp.full((i % 9 + 1, 130), 0.1) for i in range(per_call + 5)}
  opt = optirs_jax.adam(1e-3)

  def step(p, s, g):
    return optirs_jax.apply(opt, g, s, p)

  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        (params, opt.init(params), params))
  with abstract_target("NVIDIA H200", "cuda"):
    exp = jax.export.export(
        jax.jit(step, donate_argnums=(0, 1)), platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*shapes)
  text = exp.mlir_module()
  assert text.count(TRITON) == 2
  # every donated param, mu and nu is aliased to its output (3 per leaf), and the count
  assert text.count("tf.aliasing_output") == 3 * len(params) + 1


def _scaled(h, x, *, compute_dtype=None):
  del compute_dtype
  return (x * jnp.asarray(h.s, x.dtype) + jnp.asarray(h.t, x.dtype),)


def test_per_leaf_scalars_reach_their_leaves():
  # An op reading two per-leaf scalars: y = x * s_i + t_i, leaf by leaf, against numpy.
  # A complex leaf in the middle runs on the reference, so the grouped launch's leaves
  # are not a contiguous run of the rows; 200 leaves of 2 buffers span two launches of at
  # most 384 buffers.
  from optirs_jax.pallas.dispatch import execute
  from optirs_jax.pallas.op import ElementwiseOp
  op = ElementwiseOp(_scaled, ("t0",), (0.0,), name="scaled", leaf_hyper=("s", "t"))
  rng = np.random.default_rng(2)
  xs = [rng.standard_normal((i % 5 + 1, 3 + 97 * (i % 3))).astype(np.float32) for i in range(200)]
  xs[7] = (xs[7] + 1j * xs[7]).astype(np.complex64)
  values = rng.standard_normal((200, 2)).astype(np.float32)
  # The values as one [leaves, 2] array, or as a row of scalars per leaf.
  as_rows = lambda v: [(v[i, 0], v[i, 1]) for i in range(len(v))]
  for backend, form in itertools.product(("jnp", "pallas"), (lambda v: v, as_rows)):
    outs, norms = jax.jit(lambda xs, v, backend=backend, form=form: execute(
        op, {"t0": 0.0}, [(x,) for x in xs], backend=backend, leaf_values=form(v),
        options=SMALL_LAUNCHES))(
        [jnp.asarray(x) for x in xs], jnp.asarray(values))
    assert norms is None
    for x, (s, t), (y,) in zip(xs, values, outs):
      np.testing.assert_allclose(np.asarray(y), x * s + t, rtol=1e-6, atol=1e-6)
  # Called eagerly with NumPy values (scalars of the rows, not constants of the step).
  outs, _ = execute(op, {"t0": 0.0}, [(jnp.asarray(x),) for x in xs[:3]], backend="jnp",
                    leaf_values=values[:3])
  for x, (s, t), (y,) in zip(xs, values, outs):
    np.testing.assert_allclose(np.asarray(y), x * s + t, rtol=1e-6, atol=1e-6)


def test_per_leaf_scalars_of_the_wrong_shape_are_an_error():
  from optirs_jax.pallas.dispatch import execute
  from optirs_jax.pallas.op import ElementwiseOp
  op = ElementwiseOp(_scaled, ("t0",), (0.0,), name="scaled", leaf_hyper=("s", "t"))
  leaves = [(jnp.ones(3),), (jnp.ones(4),)]
  with pytest.raises(ValueError, match=r"must have shape \(2, 2\).*got \(2, 1\)"):
    execute(op, {"t0": 0.0}, leaves, backend="jnp", leaf_values=jnp.ones((2, 1)))
  with pytest.raises(ValueError, match=r"must have shape \(2, 2\).*got None"):
    execute(op, {"t0": 0.0}, leaves, backend="pallas")
  with pytest.raises(ValueError, match=r"must have shape \(2, 2\).*got 2 rows of lengths \[1, 2\]"):
    execute(op, {"t0": 0.0}, leaves, backend="jnp",
            leaf_values=[(jnp.ones(()),), (jnp.ones(()), jnp.ones(()))])


def test_repeated_launches_are_traced_and_compiled_once():
  # 200 equal leaves, launches of at most 384 buffers: LAMB's first pass is 4 launches (at
  # most 54 leaves of 7 buffers
  # each: 50 each), its totals one, its second pass 2 (at most 128 leaves of 3 buffers: 100
  # each); equal plans share one jitted launch, so the module holds one Triton program per
  # distinct plan (one for each pass, and the totals): 3, not 7.
  params = {f"w{i:03d}": jax.ShapeDtypeStruct((4096,), jnp.float32) for i in range(200)}
  opt = optirs_jax.lamb(1e-3, executor_options=SMALL_LAUNCHES)
  shapes = (params, jax.eval_shape(opt.init, params), params)
  with abstract_target("NVIDIA H200", "cuda"):
    exp = jax.export.export(
        jax.jit(lambda p, s, g: optirs_jax.apply(opt, g, s, p), donate_argnums=(0, 1)),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*shapes)
  assert exp.mlir_module().count(TRITON) == 3


@pytest.mark.parametrize("pointer_select", [True, False])
@pytest.mark.parametrize("dtypes", [("float32",), ("float32", "bfloat16")])
def test_a_launch_traces_the_rule_once_per_run_of_same_dtype_leaves(dtypes, pointer_select,
                                                                     monkeypatch):
  # The rule (Adam's one square root per element) is traced once for each run of leaves of
  # the same dtypes in a launch. Through the leaf table, so are the loads and stores (one
  # table load and one table store per run); with a branch per leaf, only the loads and
  # stores name a leaf's buffers.
  monkeypatch.setattr(grouped, "POINTER_SELECT", pointer_select)
  grouped._launch.cache_clear()
  tx = optirs_jax.adam(1e-3, backend="pallas")
  params = {f"w{i:02d}": jnp.ones((100 + i,), dtypes[i * len(dtypes) // 12]) for i in range(12)}
  state = tx.init(params)
  closed = jax.make_jaxpr(lambda g, s, p: optirs_jax.apply(tx, g, s, p))(params, state, params)
  grouped._launch.cache_clear()
  kernels = cases.kernel_primitives(closed)
  assert kernels
  for counts in kernels:
    assert counts["sqrt"] == len(dtypes)
    if pointer_select:
      assert counts["optirs_leaf_load"] == counts["optirs_leaf_store"] == len(dtypes)
      assert counts["masked_load"] == counts["masked_swap"] == 0
    else:
      assert counts["optirs_leaf_load"] == counts["optirs_leaf_store"] == 0
      assert counts["masked_load"] == 4 * len(params)  # g, mu, nu and p of every leaf
      assert counts["masked_swap"] == 3 * len(params)  # p, mu and nu written in place


def _passes(tx, n=6) -> set:
  """The (buffers read, buffers written) of each kernel of ``tx``'s fused step on ``n``
  leaves (on a GPU the Triton and the interpret branches alike)."""
  params = {f"w{i:02d}": jnp.ones((100 + i,), jnp.float32) for i in range(n)}
  closed = jax.make_jaxpr(lambda g, s, p: optirs_jax.apply(tx, g, s, p))(params, tx.init(params),
                                                                         params)
  return set(cases.kernel_memory(closed))


@pytest.mark.parametrize("name, kw, first_reads, sources, second_reads, writes", [
    # Fromage reads g and p twice (the norms, then the step) and writes only the new params.
    ("fromage", {}, 2, 2, 2, 1),
    # LARS reads g and p for the norm of g + wd * p, then g, its trace and p; writes two.
    ("lars", {"weight_decay": 1e-2}, 2, 2, 3, 2),
    # NovoGrad's first pass needs only the gradient's norm.
    ("novograd", {"weight_decay": 1e-2}, 1, 1, 3, 2),
])
def test_a_reduction_without_first_pass_state_only_measures_there(name, kw, first_reads,
                                                                  sources, second_reads, writes):
  # Its first pass reads what the norms need and writes nothing but the block sums; the
  # second reruns the rule on the gradient (no update buffer written and read back). The
  # launch between them reads each norm source's block sums.
  tx = getattr(optirs_jax, name)(1e-3, backend="pallas", **kw)
  assert _passes(tx) == {(first_reads * 6, 0), (sources, 0), (second_reads * 6, writes * 6)}


def test_a_reduction_with_first_pass_state_writes_it_there():
  # LAMB's first pass keeps its moments (and the update the trust ratio scales): g, mu, nu
  # and p read, mu, nu and u written; then u and p read, p written.
  tx = optirs_jax.lamb(1e-3, backend="pallas")
  assert _passes(tx) == {(4 * 6, 3 * 6), (2, 0), (2 * 6, 6)}

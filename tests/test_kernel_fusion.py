"""Kernel fusion planner: rules, byte counts, and planned == unfused on random graphs."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from optirs_jax.planning.kernel_fusion import Graph, adam_update_graph, evaluate, plan_fusion


def test_adam_is_one_kernel_at_28_bytes_per_param():
  n = 4096
  plan = plan_fusion(adam_update_graph((n,)))
  assert len(plan.kernels) == 1
  assert plan.fused_bytes == 28 * n  # read p, g, m, v; write p, m, v
  assert plan.unfused_bytes > 4 * plan.fused_bytes


def test_adam_graph_computes_adam():
  g = adam_update_graph((5,), lr=0.1, bc1=0.1, bc2=0.001)
  x = {k: jnp.linspace(0.1, 0.5, 5) * (i + 1) for i, k in enumerate("pgmv")}
  out = evaluate(g, x, plan_fusion(g))
  m = 0.9 * x["m"] + 0.1 * x["g"]
  v = 0.999 * x["v"] + 0.001 * x["g"] ** 2
  want = x["p"] - 0.1 * (m / 0.1) / (jnp.sqrt(v / 0.001) + 1e-8)
  np.testing.assert_allclose(out["p_new"], want, rtol=1e-6)


def test_reduction_ends_a_kernel_and_broadcast_starts_one():
  g = Graph()
  x = g.input("x", (8, 16))
  sq = g.elementwise("sq", "square", x)
  s = g.reduce_sum("s", sq, axis=1)           # fuses with sq as the kernel's root
  inv = g.elementwise("inv", "scale", s, const=0.5)  # after a reduction: a new kernel
  b = g.broadcast("b", inv, (16, 8))          # (8,) -> (16, 8): starts a kernel
  y = g.elementwise("y", "mul", b, g.broadcast("xt", g.reduce_sum("cs", x, axis=1), (16, 8)))
  g.mark_output(y)
  plan = plan_fusion(g)
  assert ("sq", "s") in plan.kernels
  assert all(not ({"s", "inv"} <= set(k)) for k in plan.kernels)
  out, ref = evaluate(g, {"x": jnp.ones((8, 16))}, plan), evaluate(g, {"x": jnp.ones((8, 16))})
  np.testing.assert_allclose(out["y"], ref["y"])


def test_no_cycle_between_kernels():
  # a -> r (reduction) -> b; a -> c; c and b meet in d. Merging a's kernel with d's would
  # need r's kernel both after and before it.
  g = Graph()
  x = g.input("x", (4,))
  a = g.elementwise("a", "neg", x)
  r = g.reduce_sum("r", a)
  b = g.broadcast("b", r, (4,))
  c = g.elementwise("c", "sqrt", a)
  d = g.elementwise("d", "add", b, c)
  g.mark_output(d)
  plan = plan_fusion(g)
  where = {n: i for i, k in enumerate(plan.kernels) for n in k}
  for op in g.ops.values():  # every producer's kernel runs no later than its consumer's
    for i in op.inputs:
      if i in where and op.name in where:
        assert where[i] <= where[op.name]
  np.testing.assert_allclose(evaluate(g, {"x": jnp.arange(4.0)}, plan)["d"],
                             evaluate(g, {"x": jnp.arange(4.0)})["d"])


def test_bad_graphs():
  g = Graph()
  x = g.input("x", (3,))
  with pytest.raises(ValueError, match="not defined before"):
    g.elementwise("y", "neg", "nope")
  with pytest.raises(ValueError, match="unknown elementwise fn 'exp2'"):
    g.elementwise("y", "exp2", x)
  with pytest.raises(ValueError, match="needs equal shapes"):
    g.elementwise("y", "add", x, g.input("z", (4,)))
  with pytest.raises(ValueError, match="already used"):
    g.input("x", (3,))


@st.composite
def graphs(draw):
  g = Graph()
  names = [g.input("in0", (3, 6)), g.input("in1", (3, 6)), g.input("in2", (6,))]
  for k in range(draw(st.integers(1, 14))):
    kind = draw(st.sampled_from(["unary", "binary", "reduce", "broadcast"]))
    src = draw(st.sampled_from(names))
    shape = g.ops[src].shape
    name = f"op{k}"
    if kind == "unary":
      names.append(g.elementwise(name, draw(st.sampled_from(["neg", "tanh", "square", "abs"])),
                                 src))
    elif kind == "binary":
      same = [n for n in names if g.ops[n].shape == shape]
      names.append(g.elementwise(name, draw(st.sampled_from(["add", "mul", "sub"])), src,
                                 draw(st.sampled_from(same))))
    elif kind == "reduce" and shape == (3, 6):
      names.append(g.reduce_sum(name, src, axis=0))
    elif kind == "broadcast" and shape == (6,):
      names.append(g.broadcast(name, src, (3, 6)))
  g.mark_output(*draw(st.lists(st.sampled_from(names[3:] or names), min_size=1, max_size=3,
                               unique=True)))
  return g


@settings(max_examples=60, deadline=None)
@given(graph=graphs(), seed=st.integers(0, 1000))
def test_planned_equals_unfused_and_saves_bytes(graph, seed):
  plan = plan_fusion(graph)
  planned = [n for k in plan.kernels for n in k]
  assert sorted(planned) == sorted(n for n, op in graph.ops.items() if op.kind != "input")
  assert plan.fused_bytes <= plan.unfused_bytes
  key = jax.random.PRNGKey(seed)
  inputs = {n: jax.random.normal(jax.random.fold_in(key, i), op.shape)
            for i, (n, op) in enumerate(graph.ops.items()) if op.kind == "input"}
  got, want = evaluate(graph, inputs, plan), evaluate(graph, inputs)
  for n in graph.outputs:
    np.testing.assert_allclose(got[n], want[n], rtol=1e-5, atol=1e-5)

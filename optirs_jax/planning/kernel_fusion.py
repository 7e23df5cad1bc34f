"""Kernel fusion planning over a DAG of elementwise, broadcast and reduction ops.

A :class:`Graph` holds named ops on shaped float32 arrays, added in topological order. The
planner groups them into kernels by the usual rules (those of XLA's producer-consumer
fusion, simplified):

* an elementwise op joins the kernel of its producers when they have its shape; producers
  in several kernels are merged into one, unless the merge would create a cycle between
  kernels (a path that leaves one of them and comes back);
* a broadcast starts a kernel of its output shape (its small input is read from memory);
* a reduction may end a kernel as its root (it joins its producer's kernel), but nothing
  joins a kernel after its reduction: a reduction's consumers start a new kernel.

Memory traffic is counted as each kernel reading its inputs once and writing the values
used outside it (or marked as graph outputs); unfused, every op reads its operands and
writes its result. :func:`evaluate` runs a graph op by op or kernel by kernel (each kernel
one ``jax.jit``) with ``jnp``; both give the same numbers.

Limits: float32 only, no transposes or reshapes, reductions over one axis or all axes, and
no cost model beyond bytes moved (no register pressure or launch cost).

>>> g = adam_update_graph((1000,))
>>> plan = plan_fusion(g)
>>> len(plan.kernels), plan.fused_bytes // 1000
(1, 28)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

ELEMENTWISE = {
    "add": (2, jnp.add), "sub": (2, jnp.subtract), "mul": (2, jnp.multiply),
    "div": (2, jnp.divide), "neg": (1, jnp.negative), "sqrt": (1, jnp.sqrt),
    "square": (1, jnp.square), "abs": (1, jnp.abs), "tanh": (1, jnp.tanh),
}
KINDS = ("input", "elementwise", "broadcast", "reduction")


@dataclasses.dataclass(frozen=True)
class Op:
  name: str
  kind: str  # one of KINDS
  inputs: tuple[str, ...]
  shape: tuple[int, ...]
  fn: str | None = None  # elementwise: a key of ELEMENTWISE; "scale"/"shift" use ``const``
  const: float = 0.0
  axis: int | None = None  # reduction axis (None: all)

  @property
  def nbytes(self) -> int:
    return 4 * math.prod(self.shape)


class Graph:
  """Ops in topological order; ``outputs`` are the values the caller keeps."""

  def __init__(self):
    self.ops: dict[str, Op] = {}
    self.outputs: list[str] = []

  def _add(self, op: Op) -> str:
    if op.name in self.ops:
      raise ValueError(f"op name {op.name!r} is already used")
    for i in op.inputs:
      if i not in self.ops:
        raise ValueError(f"op {op.name!r} reads {i!r}, which is not defined before it")
    self.ops[op.name] = op
    return op.name

  def input(self, name: str, shape) -> str:
    return self._add(Op(name, "input", (), tuple(shape)))

  def elementwise(self, name: str, fn: str, *inputs: str, const: float = 0.0) -> str:
    if fn in ("scale", "shift"):
      arity = 1
    elif fn in ELEMENTWISE:
      arity = ELEMENTWISE[fn][0]
    else:
      raise ValueError(f"unknown elementwise fn {fn!r}; valid: "
                       f"{sorted(ELEMENTWISE) + ['scale', 'shift']}")
    if len(inputs) != arity:
      raise ValueError(f"{fn!r} takes {arity} inputs, got {len(inputs)}")
    shapes = {self.ops[i].shape for i in inputs if i in self.ops}
    if len(shapes) > 1:
      raise ValueError(f"elementwise {name!r} needs equal shapes, got {sorted(shapes)}; "
                       "broadcast first")
    return self._add(Op(name, "elementwise", tuple(inputs), shapes.pop() if shapes else (),
                        fn=fn, const=const))

  def broadcast(self, name: str, x: str, shape) -> str:
    src = self.ops[x].shape
    np.broadcast_shapes(src, tuple(shape))  # raises on incompatible shapes
    return self._add(Op(name, "broadcast", (x,), tuple(shape)))

  def reduce_sum(self, name: str, x: str, axis: int | None = None) -> str:
    src = self.ops[x].shape
    shape = () if axis is None else src[:axis] + src[axis + 1:]
    return self._add(Op(name, "reduction", (x,), shape, axis=axis))

  def mark_output(self, *names: str) -> None:
    for n in names:
      if n not in self.ops:
        raise ValueError(f"{n!r} is not an op")
      self.outputs.append(n)

  def consumers(self) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {n: [] for n in self.ops}
    for op in self.ops.values():
      for i in op.inputs:
        out[i].append(op.name)
    return out


@dataclasses.dataclass(frozen=True)
class FusionPlan:
  kernels: tuple[tuple[str, ...], ...]  # op names per kernel, in execution order
  unfused_bytes: int
  fused_bytes: int

  @property
  def saving(self) -> float:
    return 1.0 - self.fused_bytes / self.unfused_bytes if self.unfused_bytes else 0.0


def _reaches(edges: Mapping[int, set[int]], src: int, dst: int, skip: set[int]) -> bool:
  """Whether a path src -> ... -> dst passes through a group outside ``skip``."""
  stack, seen = [n for n in edges.get(src, ()) if n not in skip], set()
  while stack:
    n = stack.pop()
    if n == dst:
      return True
    if n in seen:
      continue
    seen.add(n)
    stack.extend(m for m in edges.get(n, ()) if m not in skip or m == dst)
  return False


def plan_fusion(graph: Graph) -> FusionPlan:
  """Groups the graph's ops into kernels and counts the bytes moved before and after."""
  group: dict[str, int] = {}
  members: dict[int, list[str]] = {}
  closed: set[int] = set()  # groups ended by a reduction
  shape_of: dict[int, tuple[int, ...]] = {}

  def edges() -> dict[int, set[int]]:
    e: dict[int, set[int]] = {}
    for op in graph.ops.values():
      if op.name not in group:  # inputs, and ops not planned yet
        continue
      for i in op.inputs:
        if i in group and group[i] != group[op.name]:
          e.setdefault(group[i], set()).add(group[op.name])
    return e

  next_id = 0
  for op in graph.ops.values():
    if op.kind == "input":
      continue
    candidates = []
    if op.kind in ("elementwise", "reduction"):
      src_shape = graph.ops[op.inputs[0]].shape if op.kind == "reduction" else op.shape
      candidates = sorted({group[i] for i in op.inputs if i in group
                           and group[i] not in closed and shape_of[group[i]] == src_shape})
    gid = next_id
    next_id += 1
    group[op.name], members[gid], shape_of[gid] = gid, [op.name], (
        graph.ops[op.inputs[0]].shape if op.kind == "reduction" else op.shape)
    for cand in candidates:  # merge producer groups into this op's group, cycle-free only
      merged = {gid, cand}
      e = edges()
      if _reaches(e, cand, gid, merged) or _reaches(e, gid, cand, merged):
        continue
      for name in members.pop(cand):
        group[name] = gid
        members[gid].append(name)
      closed.discard(cand)
    if op.kind == "reduction":
      closed.add(gid)

  order = {n: k for k, n in enumerate(graph.ops)}
  kernels = _topological([tuple(sorted(m, key=order.get)) for m in members.values()], graph,
                         order)
  return FusionPlan(tuple(kernels), _unfused_bytes(graph), _fused_bytes(graph, kernels))


def _topological(kernels, graph: Graph, order) -> list[tuple[str, ...]]:
  """Kernels in an order where every kernel runs after those it reads from (ties: the
  kernel whose first op comes first)."""
  where = {n: i for i, k in enumerate(kernels) for n in k}
  deps = [{where[i] for n in k for i in graph.ops[n].inputs if i in where} - {j}
          for j, k in enumerate(kernels)]
  done, out = set(), []
  while len(out) < len(kernels):
    ready = [j for j in range(len(kernels)) if j not in done and deps[j] <= done]
    j = min(ready, key=lambda j: order[kernels[j][0]])
    done.add(j)
    out.append(kernels[j])
  return out


def _unfused_bytes(graph: Graph) -> int:
  return sum(sum(graph.ops[i].nbytes for i in op.inputs) + op.nbytes
             for op in graph.ops.values() if op.kind != "input")


def _fused_bytes(graph: Graph, kernels) -> int:
  consumers = graph.consumers()
  outputs = set(graph.outputs)
  total = 0
  for kernel in kernels:
    inside = set(kernel)
    reads = {i for n in kernel for i in graph.ops[n].inputs if i not in inside}
    writes = {n for n in kernel if n in outputs or any(c not in inside for c in consumers[n])}
    total += sum(graph.ops[i].nbytes for i in reads) + sum(graph.ops[n].nbytes for n in writes)
  return total


def _apply(op: Op, args):
  if op.kind == "broadcast":
    return jnp.broadcast_to(args[0], op.shape)
  if op.kind == "reduction":
    return jnp.sum(args[0], axis=op.axis)
  if op.fn == "scale":
    return args[0] * jnp.float32(op.const)
  if op.fn == "shift":
    return args[0] + jnp.float32(op.const)
  return ELEMENTWISE[op.fn][1](*args)


def evaluate(graph: Graph, inputs: Mapping[str, jax.Array], plan: FusionPlan | None = None):
  """The graph's outputs, op by op (``plan=None``) or one jitted function per kernel."""
  values = {n: jnp.asarray(inputs[n], jnp.float32) for n, op in graph.ops.items()
            if op.kind == "input"}
  if plan is None:
    for op in graph.ops.values():
      if op.kind != "input":
        values[op.name] = _apply(op, [values[i] for i in op.inputs])
    return {n: values[n] for n in graph.outputs}
  consumers = graph.consumers()
  for kernel in plan.kernels:
    inside = set(kernel)
    reads = sorted({i for n in kernel for i in graph.ops[n].inputs if i not in inside})
    keep = [n for n in kernel if n in graph.outputs or any(c not in inside for c in consumers[n])]

    def run(*args, kernel=kernel, reads=reads, keep=keep):
      local = dict(zip(reads, args))
      for n in kernel:
        local[n] = _apply(graph.ops[n], [local[i] for i in graph.ops[n].inputs])
      return [local[n] for n in keep]

    values.update(zip(keep, jax.jit(run)(*[values[r] for r in reads])))
  return {n: values[n] for n in graph.outputs}


def adam_update_graph(shape, b1=0.9, b2=0.999, eps=1e-8, lr=1e-3, bc1=0.1, bc2=0.001) -> Graph:
  """Adam's update with the apply, as the benchmark counts it: reads p, g, m, v and writes
  p, m, v (28 B per float32 parameter when fused)."""
  gr = Graph()
  p, g, m, v = (gr.input(n, shape) for n in ("p", "g", "m", "v"))
  e = gr.elementwise
  m_new = e("m_new", "add", e("m_decay", "scale", m, const=b1), e("g_part", "scale", g,
                                                                   const=1 - b1))
  v_new = e("v_new", "add", e("v_decay", "scale", v, const=b2),
            e("g2_part", "scale", e("g2", "square", g), const=1 - b2))
  m_hat = e("m_hat", "scale", m_new, const=1 / bc1)
  denom = e("denom", "shift", e("sqrt_v", "sqrt", e("v_hat", "scale", v_new, const=1 / bc2)),
            const=eps)
  step = e("step", "scale", e("u", "div", m_hat, denom), const=-lr)
  p_new = e("p_new", "add", p, step)
  gr.mark_output(p_new, m_new, v_new)
  return gr

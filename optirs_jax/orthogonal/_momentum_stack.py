r"""Muon's momentum and its Newton–Schulz stack in one pass over the gradients.

Written by XLA, the momentum of each matrix and the stack of one shape are two passes:
one fusion per leaf writes :math:`m_t = \beta m_{t-1} + (1-\beta) g_t`, and the stack's
concatenation reads :math:`g` and :math:`m_{t-1}` again to compute the corrected momentum
:math:`\hat m` inside it (XLA recomputes the momentum there rather than reading it back).
:func:`momentum_stack` is one Pallas kernel that reads each gradient and momentum once
and writes both the new momentum (in place) and :math:`\hat m` of every leaf into the
stack, cast to the chain's dtype: 14 bytes a parameter with a bfloat16 stack, against
22 (float32: 16 against 24).

It runs on float32 gradients and momenta (``mu_dtype`` None or float32), on a process of
one device (a ``pallas_call`` is opaque to XLA's partitioner: sharded leaves would be
gathered); anywhere else the caller keeps XLA's two passes (:func:`fusable`). A program
takes 4096 elements of one leaf, its loads and stores masked past the leaf's end, so no
part of a leaf is left to XLA: XLA's CUDA compile of jax 0.11 copied a momentum written
in place whose tail XLA had read (two copies of GPT-2's embedding a step, 0.21 ms).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from optirs_jax.pallas import lazy_branches
from optirs_jax.pallas.dispatch import lowering_targets

#: Elements a program reads of each leaf (the elementwise kernels' 32 x 128 block); a
#: leaf's last block is masked past its end.
BLOCK = 4096


def momentum(g, m, h, nesterov: bool):
  r"""``(m_t, \hat m_t)`` from ``h = (1 - beta, beta, 1 - beta^t, 1 - beta^{t+1})``: the
  arithmetic of :func:`~optirs_jax.orthogonal.scale_by_muon`, in the kernel and on the
  reference alike."""
  one_minus, beta, c_now, c_next = h
  new = one_minus * g + beta * m
  if nesterov:
    return new, beta * (new / c_next) + one_minus * (g / c_now)
  return new, new / c_now


def one_device() -> bool:
  """Whether this process computes on one device (its leaves then unsharded)."""
  return len(jax.devices()) == 1


def fusable(gs: Sequence[jax.Array], ms: Sequence[jax.Array]) -> bool:
  """Whether :func:`momentum_stack` can take these leaves (the matrices of one shape)."""
  f32 = jnp.dtype(jnp.float32)
  return (one_device() and len(gs) == len(ms) > 0
          and all(jnp.dtype(x.dtype) == f32 for x in (*gs, *ms))
          and all(m.shape == g.shape for g, m in zip(gs, ms))
          and sum(g.size for g in gs) < 2**31)


def _body(h_ref, *refs, bounds, sizes, offsets, nesterov):
  n = len(sizes)
  g_refs, m_refs, new_refs, stack_ref = refs[:n], refs[n:2 * n], refs[2 * n:3 * n], refs[-1]
  h = tuple(h_ref[j] for j in range(4))
  i = pl.program_id(0)
  lane = jnp.arange(BLOCK, dtype=jnp.int32)
  for k in range(n):  # the leaf whose blocks this program's index falls in
    @pl.when((i >= bounds[k]) & (i < bounds[k + 1]))
    def _(k=k):
      idx = (i - bounds[k]) * BLOCK + lane
      mask = idx < sizes[k]
      load = lambda r: pltriton.load(r.at[idx], mask=mask, other=jnp.float32(0))
      new, hat = momentum(load(g_refs[k]), load(m_refs[k]), h, nesterov)
      pltriton.store(new_refs[k].at[idx], new, mask=mask)
      pltriton.store(stack_ref.at[offsets[k] + idx], hat.astype(stack_ref.dtype), mask=mask)


def _kernel(h, gs, ms, *, nesterov, stack_dtype, interpret):
  sizes = tuple(g.size for g in gs)
  bounds = tuple(itertools.accumulate([-(-s // BLOCK) for s in sizes], initial=0))
  offsets = tuple(itertools.accumulate(sizes[:-1], initial=0))
  n = len(gs)
  whole = pl.BlockSpec()
  out_shape = ([jax.ShapeDtypeStruct((s,), jnp.float32) for s in sizes]
               + [jax.ShapeDtypeStruct((sum(sizes),), stack_dtype)])
  outs = pl.pallas_call(
      functools.partial(_body, bounds=bounds, sizes=sizes, offsets=offsets,
                        nesterov=nesterov),
      out_shape=tuple(out_shape),
      grid=(bounds[-1],),
      in_specs=[pl.BlockSpec((4,), lambda i: (0,))] + [whole] * (2 * n),
      out_specs=tuple([whole] * (n + 1)),
      input_output_aliases={1 + n + k: k for k in range(n)},  # each momentum in place
      interpret=interpret,
      compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4,
                                                                      num_stages=1),
      name="muon_momentum_stack",
  )(h, *[g.reshape(-1) for g in gs], *[m.reshape(-1) for m in ms])
  return list(outs[:n]), outs[n]


def _reference(h, gs, ms, *, nesterov, stack_dtype):
  pairs = [momentum(g.reshape(-1), m.reshape(-1), h, nesterov) for g, m in zip(gs, ms)]
  stack = jnp.concatenate([hat.astype(stack_dtype) for _, hat in pairs])
  return [new for new, _ in pairs], stack


def momentum_stack(gs: Sequence[jax.Array], ms: Sequence[jax.Array], h: jax.Array, *,
                   nesterov: bool, stack_dtype, backend: str = "auto"):
  r"""Each leaf's new momentum and the stack of their corrected momenta, in one pass.

  .. math::
    m_t = \beta m_{t-1} + (1-\beta) g_t,\qquad
    \hat m_t = \beta\,\frac{m_t}{1-\beta^{t+1}} + (1-\beta)\,\frac{g_t}{1-\beta^t}
    \ (\text{Nesterov; else } m_t / (1-\beta^t))

  Args:
    gs, ms: the gradients and momenta, float32, of leaves whose matrices share a shape
      (:func:`fusable`).
    h: ``f32[4]``: ``1 - beta``, ``beta``, ``1 - beta^t``, ``1 - beta^{t+1}``.
    nesterov: Nesterov's correction.
    stack_dtype: the stack's dtype (the Newton–Schulz chain's).
    backend: ``"auto"`` (the kernel on a GPU, XLA's fusions elsewhere), ``"pallas"``
      (interpret mode off a GPU) or ``"jnp"``.

  Returns:
    ``(new momenta, stack)``: the momenta shaped as ``ms``; the stack flat, the leaves'
    corrected momenta one after another (reshape it to the matrices).

  >>> import jax.numpy as jnp
  >>> gs, ms = [jnp.ones((64, 80))] * 2, [jnp.zeros((64, 80))] * 2
  >>> h = jnp.array([0.1, 0.9, 0.1, 0.19])
  >>> new, stack = momentum_stack(gs, ms, h, nesterov=False, stack_dtype=jnp.bfloat16)
  >>> float(new[0][0, 0]), stack.shape, float(stack[-1])
  (0.10000000149011612, (10240,), 1.0)
  """
  shapes = [m.shape for m in ms]
  args = (h, list(gs), list(ms))
  ref = lambda a: _reference(*a, nesterov=nesterov, stack_dtype=stack_dtype)
  kernel = lambda interpret: lambda a: _kernel(*a, nesterov=nesterov,
                                               stack_dtype=stack_dtype, interpret=interpret)
  other = ref if backend == "auto" else kernel(True)  # off a GPU: XLA, or interpret mode
  if backend == "jnp":
    news, stack = ref(args)
  elif "cuda" in lowering_targets([tuple(gs)]):
    news, stack = lazy_branches.platform_dependent(args, cuda=kernel(False), default=other)
  else:
    news, stack = other(args)
  return [x.reshape(s) for x, s in zip(news, shapes)], stack

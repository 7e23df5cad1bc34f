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

A stack of tall matrices in float32 is written wide (``wide``): each matrix transposed,
a program a 64 x 64 tile, so that the chain's TF32 Gram products contract the contiguous
axis (contracting the strided one, an H100 ran them at about half the speed). A 16-bit
stack of matrices whose long side the chain pads is written padded (``transpose=False``).
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
          and sum(g.size for g in gs) < 2**30)  # int32 offsets, with a wide stack's padding


def _body(h_ref, *refs, bounds, sizes, offsets, nesterov):
  """A program: 4096 elements of one leaf, its stack's part at the same offset."""
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


def _wide_body(h_ref, *refs, bounds, firsts, wide, tile, nesterov, transpose):
  """A program: one ``tile`` (rows x columns) of one matrix, read row-major and written
  into the stack transposed (``transpose``) or as it is (rows past the matrix's: zeros up
  to the stack's width)."""
  n = len(firsts)
  g_refs, m_refs, new_refs, stack_ref = refs[:n], refs[n:2 * n], refs[2 * n:3 * n], refs[-1]
  h = tuple(h_ref[j] for j in range(4))
  rows, cols, width = wide
  (tr, tc), i = tile, pl.program_id(0)
  across = -(-cols // tc)  # tiles across a matrix's columns
  per = -(-width // tr) * across  # tiles a matrix
  r, c = jnp.arange(tr, dtype=jnp.int32)[:, None], jnp.arange(tc, dtype=jnp.int32)[None, :]
  for k in range(n):
    @pl.when((i >= bounds[k]) & (i < bounds[k + 1]))
    def _(k=k):
      j = i - bounds[k]
      mat, r0, c0 = j // per, (j % per // across) * tr, (j % across) * tc
      src = (pl.ds(mat * rows + r0, tr), pl.ds(c0, tc))
      inside = (r0 + r < rows) & (c0 + c < cols)
      load = lambda ref: pltriton.load(ref.at[src], mask=inside, other=jnp.float32(0))
      new, hat = momentum(load(g_refs[k]), load(m_refs[k]), h, nesterov)
      pltriton.store(new_refs[k].at[src], new, mask=inside)
      within = (r0 + r < width) & (c0 + c < cols)
      if transpose:
        dst = (pl.ds((firsts[k] + mat) * cols + c0, tc), pl.ds(r0, tr))
        pltriton.store(stack_ref.at[dst], hat.T.astype(stack_ref.dtype), mask=within.T)
      else:
        dst = (pl.ds((firsts[k] + mat) * width + r0, tr), pl.ds(c0, tc))
        pltriton.store(stack_ref.at[dst], hat.astype(stack_ref.dtype), mask=within)


def _kernel(h, gs, ms, *, nesterov, stack_dtype, wide, transpose, interpret):
  sizes = tuple(g.size for g in gs)
  n = len(gs)
  if wide is None:  # flat: 4096 elements a program
    blocks = [-(-s // BLOCK) for s in sizes]
    body = functools.partial(_body, sizes=sizes, nesterov=nesterov,
                             offsets=tuple(itertools.accumulate(sizes[:-1], initial=0)))
    stack_shape, flat = (sum(sizes),), lambda x: x.reshape(-1)
  else:  # wide: a tile of 4096 a program, its columns' tile the columns' power of 2 to 64
    rows, cols, width = wide
    tc = min(64, pl.next_power_of_2(cols))
    tile = (BLOCK // tc, tc)
    mats = [s // (rows * cols) for s in sizes]
    blocks = [b * -(-width // tile[0]) * -(-cols // tc) for b in mats]
    body = functools.partial(_wide_body, wide=wide, tile=tile, nesterov=nesterov,
                             transpose=transpose,
                             firsts=tuple(itertools.accumulate(mats[:-1], initial=0)))
    stack_shape = (sum(mats) * cols, width) if transpose else (sum(mats) * width, cols)
    flat = lambda x: x.reshape(-1, cols)
  bounds = tuple(itertools.accumulate(blocks, initial=0))
  whole = pl.BlockSpec()
  out_shape = ([jax.ShapeDtypeStruct(flat(g).shape, jnp.float32) for g in gs]
               + [jax.ShapeDtypeStruct(stack_shape, stack_dtype)])
  outs = pl.pallas_call(
      functools.partial(body, bounds=bounds),
      out_shape=tuple(out_shape),
      grid=(bounds[-1],),
      in_specs=[pl.BlockSpec((4,), lambda i: (0,))] + [whole] * (2 * n),
      out_specs=tuple([whole] * (n + 1)),
      input_output_aliases={1 + n + k: k for k in range(n)},  # each momentum in place
      interpret=interpret,
      compiler_params=None if interpret else pltriton.CompilerParams(num_warps=4,
                                                                      num_stages=1),
      name="muon_momentum_stack",
  )(h, *[flat(g) for g in gs], *[flat(m) for m in ms])
  return list(outs[:n]), outs[n].reshape(-1)


def _reference(h, gs, ms, *, nesterov, stack_dtype, wide, transpose):
  pairs = [momentum(g, m, h, nesterov) for g, m in zip(gs, ms)]
  if wide is None:
    hats = [hat.astype(stack_dtype).reshape(-1) for _, hat in pairs]
  else:
    rows, cols, width = wide
    mats = lambda hat: hat.astype(stack_dtype).reshape(-1, rows, cols)
    pad = (0, 0), (0, width - rows), (0, 0)
    hats = [(jnp.pad(mats(hat).swapaxes(1, 2), (pad[0], pad[2], pad[1])) if transpose
             else jnp.pad(mats(hat), pad)).reshape(-1) for _, hat in pairs]
  return [new for new, _ in pairs], jnp.concatenate(hats)


def momentum_stack(gs: Sequence[jax.Array], ms: Sequence[jax.Array], h: jax.Array, *,
                   nesterov: bool, stack_dtype, wide=None, transpose: bool = True,
                   backend: str = "auto"):
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
    wide: ``None`` (the stack holds the leaves one after another, each row-major), or
      ``(rows, cols, width)``: the leaves are matrices ``rows x cols`` (row-major, rows >
      cols) and the stack holds each one transposed, ``cols x width``, zero past its rows
      (a tall float32 stack iterated wide: :func:`~optirs_jax.orthogonal.orthogonalize_stack`'s
      ``transposed``); a program then transposes a tile of 4096 elements.
    transpose: with ``wide``, False keeps each matrix tall, ``width x cols``, zero past its
      rows (a 16-bit stack padded for the chain, as
      :func:`~optirs_jax.orthogonal.orthogonalize_stack` pads a long side: no pass of
      its own).
    backend: ``"auto"`` (the kernel on a GPU, XLA's fusions elsewhere), ``"pallas"``
      (interpret mode off a GPU) or ``"jnp"``.

  Returns:
    ``(new momenta, stack)``: the momenta shaped as ``ms``; the stack flat, the leaves'
    corrected momenta one after another (reshape it to the matrices, or with ``wide``
    to ``[-1, cols, width]``; ``transpose=False``: ``[-1, width, cols]``).

  >>> import jax.numpy as jnp
  >>> gs, ms = [jnp.ones((64, 80))] * 2, [jnp.zeros((64, 80))] * 2
  >>> h = jnp.array([0.1, 0.9, 0.1, 0.19])
  >>> new, stack = momentum_stack(gs, ms, h, nesterov=False, stack_dtype=jnp.bfloat16)
  >>> float(new[0][0, 0]), stack.shape, float(stack[-1])
  (0.10000000149011612, (10240,), 1.0)
  """
  if wide is not None and not (wide[0] > wide[1] and wide[2] >= wide[0] and all(
      g.size % (wide[0] * wide[1]) == 0 for g in gs)):
    raise ValueError(f"wide={wide} is not (rows, cols, width) with rows > cols, width >= "
                     f"rows, of matrices of these leaves: {[g.shape for g in gs]}")
  shapes = [m.shape for m in ms]
  args = (h, list(gs), list(ms))
  kw = dict(nesterov=nesterov, stack_dtype=stack_dtype, wide=wide, transpose=transpose)
  ref = lambda a: _reference(*a, **kw)
  kernel = lambda interpret: lambda a: _kernel(*a, interpret=interpret, **kw)
  other = ref if backend == "auto" else kernel(True)  # off a GPU: XLA, or interpret mode
  if backend == "jnp":
    news, stack = ref(args)
  elif "cuda" in lowering_targets([tuple(gs)]):
    news, stack = lazy_branches.platform_dependent(args, cuda=kernel(False), default=other)
  else:
    news, stack = other(args)
  return [x.reshape(s) for x, s in zip(news, shapes)], stack

"""Adam and AdamW with 8-bit block-wise quantized moments."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from optirs_jax.formats.blockwise import (
  FP8,
  Quantized8bit,
  check_block_size,
  check_format,
  format_of,
  num_blocks,
)
from optirs_jax.fusion import NotFused
from optirs_jax.pallas import lazy_branches, sharding
from optirs_jax.pallas.dispatch import lowering_targets
from optirs_jax.pallas.op import hyper_vector, read_hyper
from optirs_jax.pallas.options import ExecutorOptions
from optirs_jax.quantization import _kernel8
from optirs_jax.spec import prologue_scalars
from optirs_jax.transforms._checks import (
  as_float,
  check_backend,
  check_executor_options,
  check_number,
  check_number_or_schedule,
  check_unit_interval,
  flatten,
  learning_rate,
  match,
  structural_int,
  structure_mismatch,
  weight_decay_value,
)
from optirs_jax.transforms.adam import AdamState
from optirs_jax.transforms.adam import adam as _adam32
from optirs_jax.transforms.adam import adamw as _adamw32


class Adam8bitState(NamedTuple):
  """State of :func:`adam8bit` and :func:`adamw8bit`.

  Each moment is a :class:`Quantized8bit` of two trees shaped like the params: ``codes``
  (``int8`` for ``mu``, ``uint8`` for ``nu``, each leaf shaped like its param; a float32
  moment for a leaf smaller than ``min_8bit_size``) and ``absmax`` (float32, one scale per
  block of a row; ``optax.MaskedNode()`` where the leaf keeps float32). Every leaf is a
  plain array, so the state goes wherever optax's does (Flax NNX, orbax, pickle).
  """

  count: jax.Array  # shape=(), dtype=jnp.int32; saturates at the int32 maximum.
  mu: Quantized8bit
  nu: Quantized8bit


BLOCK_SIZE = 256  # elements per quantization block along a leaf's last axis
MIN_8BIT_SIZE = 4096  # smaller leaves keep float32 moments


def _min_8bit_size(fn: str, value) -> int:
  """``min_8bit_size`` as an int (``None``: the default); a traced one is an error here, at
  init, where it shapes the state."""
  v = MIN_8BIT_SIZE if value is None else structural_int(fn, "min_8bit_size", value, 0)
  if v is None:
    raise ValueError(f"{fn}: min_8bit_size must be concrete at init (under "
                     "optax.inject_hyperparams pass static_args=('min_8bit_size',))")
  return v


def _quantized(x, min_8bit_size: int) -> bool:
  return x.ndim > 0 and x.size >= max(min_8bit_size, 1)


def _code_dtypes(fmt: str):
  """The codes' dtypes of ``(mu, nu)`` in ``fmt``."""
  return (FP8, FP8) if fmt == "fp8" else (jnp.int8, jnp.uint8)


def _init_leaf(x, block_size: int, min_8bit_size: int, fmt: str):
  """``(mu codes, mu scales, nu codes, nu scales)`` of one leaf. Separate buffers for every
  field: a step that donates the state may not see one twice."""
  if not _quantized(x, min_8bit_size):
    return (jnp.zeros_like(x, jnp.float32), optax.MaskedNode(),
            jnp.zeros_like(x, jnp.float32), optax.MaskedNode())
  scales = lambda: _scales_like(x, block_size)
  mu_dt, nu_dt = _code_dtypes(fmt)
  return jnp.zeros_like(x, mu_dt), scales(), jnp.zeros_like(x, nu_dt), scales()


def _scales_like(x, block_size: int) -> jax.Array:
  """Zero scales for ``x``'s blocks, sharded as ``x`` where its sharding is known (a placed
  array, or a traced one on an Explicit mesh): the same spec, the last axis partitioned
  where its blocks divide evenly among the shards."""
  shape = (*x.shape[:-1], num_blocks(x.shape[-1], block_size))
  placed = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.core.Tracer) else (
      getattr(x, "sharding", None))
  if not isinstance(placed, NamedSharding) or placed.mesh.empty:
    return jnp.zeros(shape, jnp.float32)
  entries = list(placed.spec) + [None] * (len(shape) - len(placed.spec))
  if entries[-1] is not None:
    names = entries[-1] if isinstance(entries[-1], tuple) else (entries[-1],)
    if shape[-1] % math.prod(placed.mesh.shape[n] for n in names):
      entries[-1] = None  # the blocks straddle shards: kept whole on each device
  return jnp.zeros(shape, jnp.float32, device=NamedSharding(placed.mesh, P(*entries)))


# 8-bit leaves in run_local: (p, g, mu codes, mu scales, nu codes, nu scales) in, (out, mu
# codes, mu scales, nu codes, nu scales) out; the scales have a block per row element.
_SCALES_IN, _SCALES_OUT = (3, 5), (2, 4)


def _step_leaves(hvec, leaves, *, platform, l2, decoupled, fused, tiling, prologue=(),
                 coder="table", grouped=False, max_buffers=0):
  """Every leaf's ``(updates or new params, new mu, new nu)``: float32 moments by the jnp
  math; 8-bit ones on each device's shards (:func:`~._kernel8.local_step`)."""
  results: list = [None] * len(leaves)
  q_idx = []
  h = read_hyper(hvec, _kernel8.hyper_names(prologue))
  for i, (p, g, mu, nu) in enumerate(leaves):
    if isinstance(mu, Quantized8bit):
      q_idx.append(i)
      continue
    p32 = p.astype(jnp.float32)
    u, m, v = _kernel8.adam_math(h, p32, g, mu, nu, l2=l2, decoupled=decoupled,
                                 prologue=prologue)
    results[i] = (((p32 + u) if fused else u).astype(p.dtype if fused else g.dtype), m, v)
  if not q_idx:
    return results
  # Leaves of one block size and format share a call (in practice all of them).
  kinds = lambda i: (leaves[i][2].block_size, format_of(leaves[i][2].codes))
  for bs, fmt in sorted({kinds(i) for i in q_idx}):
    idx = [i for i in q_idx if kinds(i) == (bs, fmt)]
    operands = [(leaves[i][0], leaves[i][1], *leaves[i][2], *leaves[i][3]) for i in idx]
    mu_dt, nu_dt = _code_dtypes(fmt)
    out_dtypes = [((p.dtype if fused else g.dtype), mu_dt, jnp.float32, nu_dt, jnp.float32)
                  for p, g, *_ in operands]
    local = functools.partial(_kernel8.local_step, block_size=bs, platform=platform,
                              l2=l2, decoupled=decoupled, fused=fused, tiling=tiling,
                              out_dtypes=out_dtypes, fmt=fmt, prologue=prologue, coder=coder,
                              grouped=grouped, max_buffers=max_buffers)
    outs, _ = sharding.run_local(local, hvec, operands, out_dtypes, 0,
                                 blocked=sharding.Blocked(bs, _SCALES_IN, _SCALES_OUT))
    for i, (out, mc, ma, nc, na) in zip(idx, outs):
      results[i] = (out, Quantized8bit(mc, ma), Quantized8bit(nc, na))
  return results


def _is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def _moments(fn: str, field: str, q, treedef, gl, paths) -> list:
  """Per leaf the moment of ``field``: a :class:`Quantized8bit` of one leaf, or a float32
  array; checked against the updates (errors name the leaf's key path)."""
  if not isinstance(q, Quantized8bit):
    raise TypeError(f"{fn}: state.{field} is {type(q).__name__}, not a Quantized8bit of "
                    "codes and scales (was the state made by another optimizer's init()?)")
  codes, tdef = jax.tree.flatten(q.codes)
  if tdef != treedef:
    raise ValueError(structure_mismatch(fn, f"state.{field}.codes", q.codes, paths, "updates",
                                        treedef))
  scales, sdef = jax.tree.flatten(q.absmax, is_leaf=_is_masked)
  if sdef != treedef:
    raise ValueError(structure_mismatch(fn, f"state.{field}.absmax", q.absmax, paths,
                                        "updates", treedef, is_leaf=_is_masked))
  out = []
  for c, a, g, path in zip(codes, scales, gl, paths):
    if tuple(c.shape) != tuple(g.shape):
      raise ValueError(f"{fn}: state leaf {path} has shape {tuple(c.shape)} but the updates "
                       f"leaf has shape {g.shape}")
    out.append(c if _is_masked(a) else Quantized8bit(c, a))
  return out


def _as_trees(treedef, moments) -> Quantized8bit:
  """A :class:`Quantized8bit` of two trees from per-leaf moments."""
  codes = [m.codes if isinstance(m, Quantized8bit) else m for m in moments]
  scales = [m.absmax if isinstance(m, Quantized8bit) else optax.MaskedNode() for m in moments]
  return Quantized8bit(jax.tree.unflatten(treedef, codes), jax.tree.unflatten(treedef, scales))


def _make(fn: str, learning_rate_, b1, b2, eps, weight_decay, block_size, min_8bit_size,
          backend, executor_options, *, decoupled: bool, fmt: str = "dynamic8"
          ) -> optax.GradientTransformationExtraArgs:
  check_number_or_schedule(fn, "learning_rate", learning_rate_)
  check_unit_interval(fn, "b1", b1)
  check_unit_interval(fn, "b2", b2)
  check_number(fn, "eps", eps)
  check_number_or_schedule(fn, "weight_decay", weight_decay)
  backend = check_backend(fn, backend)
  fmt = check_format(fn, fmt)
  options = check_executor_options(fn, executor_options)
  tiling, coder = options.quantized_tiling, options.dynamic_map_coder
  # Structural: checked when concrete. The step reads the layout from the state, so a
  # value optax.inject_hyperparams traces there is never needed.
  concrete = lambda v: v is None or not isinstance(v, jax.core.Tracer)
  if concrete(block_size):
    check_block_size(fn, BLOCK_SIZE if block_size is None else block_size)
  if concrete(min_8bit_size):
    _min_8bit_size(fn, min_8bit_size)

  # Leaves kept in float32 are float32 Adam(W) with the same arguments: they run through its
  # executor, so on a GPU they share its grouped launches instead of one XLA kernel each.
  # (Adam with L2 decay, g + wd * p, is not optax's adam: those stay on the 8-bit step's math.)
  small = (_adamw32(learning_rate_, b1, b2, eps, weight_decay=weight_decay, backend=backend,
                    executor_options=executor_options) if decoupled else
           _adam32(learning_rate_, b1, b2, eps, backend=backend,
                   executor_options=executor_options))

  def init_fn(params):
    leaves, _, treedef = flatten(fn, "params", params)
    bs = check_block_size(fn, BLOCK_SIZE if block_size is None else block_size)
    min_size = _min_8bit_size(fn, min_8bit_size)
    parts = list(zip(*(_init_leaf(x, bs, min_size, fmt) for x in leaves))) or [()] * 4
    tree = lambda k: jax.tree.unflatten(treedef, list(parts[k]))
    return Adam8bitState(jnp.zeros([], jnp.int32), Quantized8bit(tree(0), tree(1)),
                         Quantized8bit(tree(2), tree(3)))

  def step(grads, state, params, fused: bool, prologue=()):
    gl, paths, treedef = flatten(fn, "updates", grads)
    wd, has_wd = weight_decay_value(weight_decay, state.count)
    if params is None:
      if has_wd or fused:
        raise ValueError(f"{fn}: params are required ({'weight_decay' if has_wd else 'apply'})")
      pl_ = [jnp.zeros_like(g) for g in gl]  # read by neither the math nor the output
    else:
      pl_ = match(fn, "params", params, treedef, gl, paths)
    mus = _moments(fn, "mu", state.mu, treedef, gl, paths)
    nus = _moments(fn, "nu", state.nu, treedef, gl, paths)
    count = state.count
    t = as_float(optax.safe_increment(count))
    neg_lr, _ = learning_rate(learning_rate_, count)
    kinds, links = prologue_scalars(prologue)  # chain links folded in (optirs_jax.fusion)
    hvec = _kernel8.with_tables(hyper_vector(
        dict(b1=b1, c1=1 - b1, b2=b2, c2=1 - b2, eps=eps, bc1=1 - b1**t, bc2=1 - b2**t, wd=wd,
             neg_lr=neg_lr, **links), _kernel8.hyper_names(kinds)))
    kw = dict(l2=has_wd and not decoupled, decoupled=has_wd and decoupled, fused=fused,
              tiling=tiling, prologue=kinds, coder=coder,
              grouped=options.large_leaf_policy == "group",
              max_buffers=options.grouped_max_buffers)

    def run(platform):  # a branch of the arrays it is given (it may run at lowering time)
      def go(args):
        hvec, pl_, gl, mus, nus = args
        outs = _step_leaves(hvec, list(zip(pl_, gl, mus, nus)), platform=platform, **kw)
        return tuple(zip(*outs)) if outs else ((), (), ())
      return go

    n = len(gl)
    f32 = ([i for i in range(n) if not isinstance(mus[i], Quantized8bit)]
           if decoupled or not has_wd else [])
    rest = sorted(set(range(n)) - set(f32))
    first, new_mu, new_nu = [None] * n, [None] * n, [None] * n
    if f32:
      take = lambda xs: [xs[i] for i in f32]
      s32 = AdamState(count, take(mus), take(nus))
      if fused:
        out, s32 = small.update.fused_apply(take(gl), s32, take(pl_), prologue=prologue)
      else:
        out, s32 = small.update(take(gl), s32, None if params is None else take(pl_))
      for j, i in enumerate(f32):
        first[i], new_mu[i], new_nu[i] = out[j], s32.mu[j], s32.nu[j]
    if rest:
      take = lambda xs: [xs[i] for i in rest]
      args = (hvec, take(pl_), take(gl), take(mus), take(nus))
      targets = lowering_targets([(gl[rest[0]],)])
      other = "jnp" if backend in ("jnp", "auto") else "interpret"
      if backend == "jnp" or "cuda" not in targets:
        outs = run(other)(args)
      else:  # the kernel's branch traced now, the other when lowered for another platform
        outs = lazy_branches.platform_dependent(args, cuda=run("cuda"), default=run(other))
      for j, i in enumerate(rest):
        first[i], new_mu[i], new_nu[i] = outs[0][j], outs[1][j], outs[2][j]
    new_state = Adam8bitState(optax.safe_increment(count), _as_trees(treedef, new_mu),
                              _as_trees(treedef, new_nu))
    return jax.tree.unflatten(treedef, first), new_state

  def update_fn(updates, state, params=None, **extra_args):
    del extra_args
    return step(updates, state, params, fused=False)

  def fused_apply(grads, state, params, *, master=None, inv_scale=None, finite=None,
                  prologue=(), **unused):
    del unused  # a param_seed: 8-bit Adam rounds to nearest
    if master is not None or inv_scale is not None or finite is not None:
      # Not yet in the 8-bit kernel: optirs_jax.apply runs update + apply_updates.
      raise NotFused(f"{fn} does not fold master weights or loss scaling in")
    return step(grads, state, params, fused=True, prologue=prologue)

  update_fn.fused_apply = fused_apply
  update_fn.optirs_name = fn
  update_fn.folds_wrappers = False  # (loss scaling, master weights: fusion.why_not_wrapped)
  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adam8bit(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
             b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
             weight_decay: optax.ScalarOrSchedule = 0.0, *, block_size: int | None = None,
             min_8bit_size: int | None = None, state_quantization: str = "dynamic8",
             backend: str = "auto", executor_options: ExecutorOptions | None = None
             ) -> optax.GradientTransformationExtraArgs:
  r"""Adam whose moments are stored in 8 bits, block-wise quantized (Dettmers et al., 2022).

  Each step dequantizes the moments, runs Adam in float32 and requantizes:

  .. math::
    g &\leftarrow g + \lambda p \quad (\text{L2, when } \lambda \ne 0)\\
    m &\leftarrow \beta_1 m + (1-\beta_1) g,\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2\\
    u &= -\eta\,\frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

  then each block of ``block_size`` elements of ``m`` (of ``v``) is divided by its absolute
  maximum, kept as one float32 per block, and each element stored as the nearest code of
  the signed (``int8``) or unsigned (``uint8``) dynamic map (:func:`code_map`). Leaves with
  fewer than ``min_8bit_size`` elements keep float32 moments (and then equal ``optax.adam``
  to float32 rounding). For large leaves the state takes about 1.02 bytes per element and
  moment instead of 4.

  The blocks run along the leaf's last axis (:class:`Quantized8bit`): the codes have the
  leaf's shape, and the state shards as the params do (a block never straddles a shard
  where each shard's part of the last axis is a whole number of blocks), with no gather in
  the step.

  On GPU (``backend="auto"`` or ``"pallas"``) one Pallas kernel pass per 8-bit leaf
  dequantizes, updates, requantizes and writes the updates, or with
  :func:`optirs_jax.apply` the new params (in place when donated), for leaves whose last
  axis is a whole number of blocks (on each device its own shard); other leaves, and other
  platforms, run the same jnp math.

  Args:
    learning_rate: a number or an optax schedule.
    b1, b2, eps: Adam's decay rates (in [0, 1)) and epsilon.
    weight_decay: L2 penalty added to the gradient (``torch.optim.Adam``'s); see
      :func:`adamw8bit` for decoupled decay.
    block_size: elements per quantization block along the last axis (a power of two;
      ``None``: 256). It shapes the state, so ``optax.inject_hyperparams`` leaves the
      default alone.
    min_8bit_size: leaves with fewer elements keep float32 moments (``None``: 4096).
    state_quantization: the codes' format: ``"dynamic8"`` (the dynamic maps above) or
      ``"fp8"`` (``float8_e4m3fn`` of 448 times the element over its block's absmax, one
      hardware conversion each way on GPUs of compute capability 8.9 or newer; both
      moments signed, 3 mantissa bits: coarser than the dynamic map near a block's
      absmax, finer far below it).
    backend: ``"auto"``, ``"jnp"`` or ``"pallas"``.
    executor_options: the kernel's geometry (``ExecutorOptions.quantized_tiling``).

  Example:
    >>> import jax, jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adam8bit(1e-3, min_8bit_size=0)
    >>> params = {"w": jnp.ones((4, 256))}
    >>> state = tx.init(params)
    >>> state.mu.codes["w"].dtype, state.nu.codes["w"].dtype
    (dtype('int8'), dtype('uint8'))
    >>> params, state = optirs_jax.apply(tx, {"w": jnp.full((4, 256), 0.5)}, state, params)
    >>> float(params["w"][0, 0])
    0.9990000128746033
  """
  return _make("adam8bit", learning_rate, b1, b2, eps, weight_decay, block_size,
               min_8bit_size, backend, executor_options, decoupled=False,
               fmt=state_quantization)


def adamw8bit(learning_rate: optax.ScalarOrSchedule, b1: jax.typing.ArrayLike = 0.9,
              b2: jax.typing.ArrayLike = 0.999, eps: jax.typing.ArrayLike = 1e-8,
              weight_decay: optax.ScalarOrSchedule = 1e-4, *, block_size: int | None = None,
              min_8bit_size: int | None = None, state_quantization: str = "dynamic8",
              backend: str = "auto", executor_options: ExecutorOptions | None = None
              ) -> optax.GradientTransformationExtraArgs:
  r""":func:`adam8bit` with decoupled weight decay (as ``optax.adamw``):
  :math:`u = -\eta\,(\hat m / (\sqrt{\hat v} + \epsilon) + \lambda p)`.

  ``weight_decay`` defaults to ``optax.adamw``'s 1e-4 (bitsandbytes' and PyTorch's AdamW
  default to 1e-2): switching from ``optax.adamw`` to 8-bit state changes nothing else.

  Example:
    >>> import jax.numpy as jnp, optirs_jax
    >>> tx = optirs_jax.adamw8bit(1e-3)
    >>> params = {"w": jnp.ones((64, 256))}
    >>> state = tx.init(params)
    >>> state.mu.nbytes / (params["w"].size * 4)  # 8-bit codes + one scale per block
    0.25390625
  """
  return _make("adamw8bit", learning_rate, b1, b2, eps, weight_decay, block_size,
               min_8bit_size, backend, executor_options, decoupled=True,
               fmt=state_quantization)


def state_nbytes(state) -> int:
  """Bytes held by the arrays of an optimizer state (8-bit codes and scales included)."""
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))

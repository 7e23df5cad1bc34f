"""An optimizer as data: its rule, its state fields, its per-leaf reductions.

One :class:`OptimizerSpec` per optimizer (``optirs_jax/transforms/<name>.py``); the builder
(:func:`optirs_jax.transforms.build`) makes from it the optax transformation, the jnp
reference, the Pallas kernels (grouped, packed, in place) and the fused apply. The wiring
is fixed by convention, so a spec only declares what differs between optimizers:

* the rule's inputs are ``(g, *state fields, [p])`` and its outputs ``(u, *state fields)``;
  each state field's output updates its input in place, and on the fused apply the new
  params take the params' buffer;
* a state field exists when its ``when`` option is set, starts at ``init`` (a number or
  the option holding it) in ``dtype`` (the option holding it, or the params' dtype), and
  holds ``pad`` in a kernel's padded lanes;
* ``weight_decay=True`` gives the optimizer optax's ``weight_decay`` and ``mask`` options:
  the rule gets a static ``decay`` flag per leaf and reads ``p`` where it is set;
* a :class:`Reduction` asks the executor for per-leaf norms of named inputs and outputs and
  applies a second elementwise pass with them (LAMB's trust ratio).

>>> from optirs_jax.transforms.adagrad import ADAGRAD as spec
>>> spec.name, [f.name for f in spec.fields], spec.hyper
('adagrad', ['sum_of_squares'], ('eps', 'neg_lr'))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optirs_jax import rules
from optirs_jax.dtypes import common, widened
from optirs_jax.rounding import round_with_key


@dataclasses.dataclass(frozen=True)
class Field:
  """One per-leaf state field (a tree shaped like the params).

  Attributes:
    name: its attribute in the state NamedTuple and its keyword in the rule.
    init: its initial value, or the name of the option holding it.
    dtype: the name of the option holding its dtype (``None`` there, or here: the params').
    pad: what a kernel's padded or masked-out lanes hold; chosen so that they compute a
      finite, zero update.
    when: the name of an option that must be set (not ``None`` or ``False``) for the field
      to exist; ``None``: always. An absent field is ``None`` in the state.
    per_leaf: one scalar per leaf (shape ``()``, in the leaf's dtype unless ``dtype`` says)
      instead of a tree shaped like the params: a :class:`Reduction`'s ``between`` updates
      it from the leaf's norms (NovoGrad's second moment).
    nonneg: never negative (a second moment, an accumulator of squares): stored in 8 bits
      on the unsigned dynamic map, which spends the sign bit on resolution.
  """

  name: str
  init: float | str = 0.0
  dtype: str | None = None
  pad: float = 0.0
  when: str | None = None
  per_leaf: bool = False
  nonneg: bool = False

  def exists(self, options: Mapping[str, Any]) -> bool:
    if self.when is None:
      return True
    value = options[self.when]  # a flag, or a number (maybe traced) that may be None
    return bool(value) if isinstance(value, (bool, np.bool_)) else value is not None


@dataclasses.dataclass(frozen=True)
class Reduction:
  """Per-leaf L2 norms the rule's executor returns, and the second pass that uses them.

  Where the rule keeps no state of its own (every field is the second pass's or per leaf)
  and only ``u`` is measured, the first pass only measures: it reads what the rule reads
  and writes the norms' block sums, and the second pass reruns the rule on the gradient
  before ``finish`` (Fromage, LARS, NovoGrad: 4 bytes a parameter less than writing ``u``
  and reading it back).

  Attributes:
    inputs: names among the rule's inputs (``"g"``, a field, ``"p"``) to take norms of.
    outputs: names among its outputs (``"u"``, a field) to take norms of.
    finish: ``finish(h, u, p, *norms, cast_lr=..., <fields>, [masked=]) -> update`` (or
      ``(update, *new fields)`` with ``fields``), elementwise on one leaf.
    fields: state fields the second pass updates (the first one never sees them: LARS's
      momentum comes after its trust ratio).
    mask: the name of an option holding an optax-style mask (a tree of bools, a prefix of
      one, or a callable): the finish gets a static ``masked=`` per leaf, True where it
      applies (LARS's ``trust_ratio_mask``).
    between: ``between(h, *norms, <per-leaf fields>) -> (values, new per-leaf fields)``,
      scalar math on one leaf between the passes: the finish gets ``values`` in place of
      the norms, and the spec's ``per_leaf`` fields (keywords here) become the new ones
      (NovoGrad: its second moment is an average of the gradient's squared norm). ``None``:
      the finish gets the norms.
    means: in place of each norm, the mean of the squares ``sum(|x|^2) / x.size``, as
      ``jnp.mean(abs_sq(x))`` computes it (Adafactor's block RMS clipping and parameter
      scale read root means, which a rounded norm cannot give back exactly).
    static: ``static(options) -> {keyword: value}``: the finish's static keywords.
  """

  inputs: tuple[str, ...]
  outputs: tuple[str, ...]
  finish: Callable
  fields: tuple[str, ...] = ()
  mask: str | None = None
  between: Callable | None = None
  means: bool = False
  static: Callable[[Mapping[str, Any]], dict] = lambda options: {}


@dataclasses.dataclass(frozen=True)
class Factored:
  r"""Second moments kept factored: for a leaf with two large axes, the row and column means
  of :math:`g^2` instead of one value per element (Adafactor, Shazeer and Stern 2018).

  A factored leaf's first pass is :attr:`precondition`, in jnp: XLA's row and column
  reductions, which no elementwise kernel can express; its norms and the reduction's
  second pass follow as for the other leaves (on the reference, where XLA fuses the
  preconditioned gradient into them). Leaves that are not factored run the spec's rule,
  whose ``full`` field holds their statistics, through the kernels.

  Attributes:
    dims: ``dims(options, shape) -> (d1, d0) | None``: the two axes to factor over (the
      row statistics drop ``d0``, the column ones ``d1``), or None for an unfactored leaf.
    precondition: ``precondition(h, g, *, row, col, dims) -> (r, new row, new col)``: the
      preconditioned gradient and the new statistics, in optax's order of operations.
    row, col, full: the state fields holding the row statistics, the column statistics
      and the unfactored leaves' per-element statistics (``full`` is one of the spec's
      fields); each holds ``zeros((1,))`` on the leaves that do not use it, as optax's.
  """

  dims: Callable[[Mapping[str, Any], tuple[int, ...]], tuple[int, int] | None]
  precondition: Callable
  row: str = "v_row"
  col: str = "v_col"
  full: str = "v"


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """Everything the builder needs to make an optimizer.

  Attributes:
    name: the optimizer's name (its kernels are named after it).
    arguments: ``(name, kind)`` of each argument of the public function besides
      ``backend`` and ``executor_options``, checked by kind: ``"schedule"`` (a number, a
      scalar array or a callable of the count), ``"optional schedule"`` (or ``None``),
      ``"number"``, ``"decay rate"`` (a number in [0, 1); a traced one passes),
      ``"optional number"``,
      ``"flag"``, ``"dtype"`` (``None`` or a floating dtype), ``"mask"``, ``"seed"`` (a
      non-negative 32-bit int) or ``"axes"`` (``None`` or mesh axis names; an
      ``axis_name`` argument sums a reduction's norms over them inside ``shard_map``).
    state: the state NamedTuple: ``count`` and one attribute per field.
    fields: the per-leaf state fields, in the rule's input order.
    rule: ``rule(h, g, *, p, <fields>, cast_lr, <static>) -> (u, *fields)`` in jnp, in
      optax's order of operations; ``p`` is ``None`` where the leaf's params are not read.
    hyper: the names of the scalars of ``h`` the rule reads (``neg_lr`` and ``wd`` are the
      builder's: the learning rate and the decay at this step).
    scalars: ``scalars(options, count) -> {name: value}``: this step's values of the other
      names, computed as optax computes them (Python floats stay Python floats).
    static: ``static(options) -> {keyword: value}``: the rule's static keywords.
    weight_decay: the optimizer has optax's ``weight_decay`` and ``mask`` options.
    reads_params: the rule reads ``p`` on every leaf.
    reduction: per-leaf norms and a second pass, or ``None``.
    noise: the optimizer has optax's ``add_noise`` options ``eta``, ``gamma`` and ``key``:
      its state holds an ``rng_key``, and each step first adds Gaussian noise of standard
      deviation ``sqrt(eta / (t + 1) ** gamma)`` to the gradients, drawn as optax draws
      it (XLA's counter-based generator, one key per leaf), then runs the rule.
    factored: second moments factored into row and column statistics (:class:`Factored`;
      needs a ``reduction``), or ``None``.
    validate: ``validate(fn, options)``: checks beyond the kinds (a ValueError naming the
      value), or ``None``.
  """

  name: str
  arguments: tuple[tuple[str, str], ...]
  state: type
  fields: tuple[Field, ...]
  rule: Callable
  hyper: tuple[str, ...]
  scalars: Callable[[Mapping[str, Any], Any], dict]
  static: Callable[[Mapping[str, Any]], dict] = lambda options: {}
  weight_decay: bool = False
  reads_params: bool = False
  reduction: Reduction | None = None
  noise: bool = False
  factored: Factored | None = None
  validate: Callable[[str, Mapping[str, Any]], None] | None = None


class NotFused(Exception):
  """A transformation (or, known only at run time, its inner one) that has no fused step
  (:mod:`optirs_jax.fusion` falls back to ``update`` + ``apply_updates``)."""


# What an optax link before the optimizer does to each gradient element, folded into the
# optimizer's pass (:mod:`optirs_jax.fusion`): the scalars it reads (``h.pro<k>_<name>``, the
# k-th link's), whether it reads the params, and the element function, in optax's own order
# of operations.
PROLOGUE_SCALARS = {
    "clip_by_global_norm": ("norm", "max"),  # select(norm < max, g, (g / norm) * max)
    "clip": ("max",),  # clip(g, -max, max)
    "scale": ("step",),  # step * g
    "scale_by_schedule": ("step",),  # step (in g's dtype) * g
    "add_decayed_weights": ("wd",),  # g + wd * p
}


def prologue_names(kinds: tuple[str, ...]) -> tuple[str, ...]:
  """The hyper-parameter names of a prologue's links, in order."""
  return tuple(f"pro{k}_{name}" for k, kind in enumerate(kinds)
               for name in PROLOGUE_SCALARS[kind])


def prologue_scalars(prologue) -> tuple[tuple[str, ...], dict]:
  """``(kinds, {hyper-parameter name: value})`` of a prologue given as ``(kind, {name:
  value})`` per link (what :mod:`optirs_jax.fusion` hands a fused step)."""
  return (tuple(kind for kind, _ in prologue),
          {f"pro{k}_{name}": v for k, (_, values) in enumerate(prologue)
           for name, v in values.items()})


def apply_prologue(kinds: tuple[str, ...], h, g, p):
  """The links ``kinds`` applied to the gradient ``g`` (``p``: the params, read by
  ``add_decayed_weights``), each as optax computes it."""
  for k, kind in enumerate(kinds):
    a = lambda name, k=k: h[f"pro{k}_{name}"]
    if kind == "clip_by_global_norm":
      norm, top = a("norm"), a("max")
      g = rules.where_scalar(norm < top, g, (g / jnp.asarray(norm).astype(g.dtype)) * top)
    elif kind == "clip":
      g = jnp.clip(g, -a("max"), a("max"))
    elif kind == "scale":
      g = a("step") * g
    elif kind == "scale_by_schedule":
      g = jnp.asarray(a("step")).astype(g.dtype) * g
    elif kind == "add_decayed_weights":
      g = g + a("wd") * p
    else:
      raise ValueError(f"unknown prologue link {kind!r}; valid: {sorted(PROLOGUE_SCALARS)}")
  return g


@dataclasses.dataclass(frozen=True)
class BoundRule:
  """A spec's rule with its wiring and static options bound: ``(h, *inputs) -> outputs``.

  Inputs are ``(g, *fields, [p], [p_low])``, outputs ``(u, *fields, [master])``. Hashable
  (it keys the kernel caches). Around the rule:

  * inputs of mixed dtypes promote op by op as under JAX's standard promotion (as in
    optax), whatever ``jax_numpy_dtype_promotion`` says (the executors run such leaves on
    the reference, where Python-float hyper-parameters stay weakly typed as in optax);
    inputs of one dtype are widened by a kernel to at least its ``compute_dtype`` (float32:
    half-precision leaves computed in float32 and rounded once), and with
    ``widens_mixed`` every input is. Each new state field is cast back to its
    input's dtype, so state dtypes never drift;
  * ``wide_grads``: ``g`` is read in float32 or wider (for master weights: what their
    update path gives the inner optimizer);
  * ``unscale``: ``g`` is multiplied by ``h.inv_scale`` first (a loss scale's inverse; the
    product in float32 or wider);
  * ``prologue``: optax links before the optimizer, applied to ``g`` next
    (:func:`apply_prologue`: global-norm and element clipping, scaling, decay);
  * ``apply``: the first output is the new params ``p + u`` in the params' dtype, as
    :func:`optax.apply_updates` computes them;
  * ``master``: ``p`` is a float32 master copy; the outputs are the low-precision params
    (the new master cast to ``p_low``'s dtype), the fields, then the new master;
  * ``guard``: where ``h.finite`` is 0 every output keeps its input's value (a zero update
    on the update path): a skipped step;
  * ``rounding``: bfloat16 state is rounded stochastically (:mod:`optirs_jax.rounding`),
    keyed by the seed (``h.seed_lo``, ``h.seed_hi``), the step count (``h.count_lo``,
    ``h.count_hi``), the output and the ``index`` of each element in its leaf;
    ``param_rounding`` likewise for the new params of ``apply`` and ``master``, with
    ``h.pseed_lo``, ``h.pseed_hi``. The rule then computes in float32 or wider (on every
    executor), and each result is rounded once.
  """

  fn: Callable
  fields: tuple[str, ...]
  with_params: bool
  static: tuple[tuple[str, Any], ...]
  apply: bool = False
  master: bool = False
  unscale: bool = False
  guard: bool = False
  wide_grads: bool = False
  rounding: bool = False
  param_rounding: bool = False
  prologue: tuple[str, ...] = ()

  @property
  def widens_mixed(self) -> bool:
    """Whether inputs of mixed dtypes are computed in float32 by design (master weights,
    stochastic rounding); otherwise they promote op by op, as in optax."""
    return self.master or self.indexed

  def unguarded(self) -> BoundRule | None:
    """This rule without its guard, where a skipped step keeps every input as it was (the
    fused apply: the params, master copies and state); None otherwise (no guard, or the
    update path, whose skipped update is zeros)."""
    if self.guard and (self.apply or self.master):
      return dataclasses.replace(self, guard=False)
    return None

  def hyper(self, base: tuple[str, ...]) -> tuple[str, ...]:
    """The names of the scalars a kernel of this rule reads: ``base`` (the spec's), then
    those of its wiring (the loss scale's inverse, the links, the guard's flag, the count
    and seeds of the rounding), in the order the executors pack them."""
    return base + (("inv_scale",) if self.unscale else ()) + prologue_names(self.prologue) + (
        ("finite",) if self.guard else ()) + (("count_lo", "count_hi") if self.indexed else ()) + (
        ("seed_lo", "seed_hi") if self.rounding else ()) + (
        ("pseed_lo", "pseed_hi") if self.param_rounding else ())

  @property
  def indexed(self) -> bool:
    """Whether the rule needs each element's index in its leaf (``index=``)."""
    return self.rounding or self.param_rounding

  def __call__(self, h, g, *rest, index=None, compute_dtype=None):
    with jax.numpy_dtype_promotion("standard"):
      return self._call(h, g, *rest, index=index, compute_dtype=compute_dtype)

  def _call(self, h, g, *rest, index, compute_dtype):
    n = len(self.fields)
    state, extra = rest[:n], rest[n:]
    uniform = len({x.dtype for x in (g, *state, *extra)}) == 1
    if self.wide_grads:
      g = g.astype(widened(g.dtype))
    if self.unscale:
      g = g.astype(widened(g.dtype))
      g = g * jnp.asarray(h.inv_scale, g.dtype)
    if self.widens_mixed:  # float32 by design: master weights, stochastic rounding
      to = common(g, *state, *extra, jnp.float32)
    elif compute_dtype is not None and uniform:  # a kernel: one dtype, computed in float32
      to = common(g, compute_dtype)
    else:  # mixed dtypes promote op by op, exactly as optax's would (on every executor)
      to = None
    widen = lambda x: x if to is None or x.dtype == to else x.astype(to)
    p = widen(extra[0]) if self.with_params else None
    g = widen(g)
    if self.prologue:
      g = apply_prologue(self.prologue, h, g, p)
    u, *new_state = self.fn(h, g, p=p, **dict(zip(self.fields, map(widen, state))),
                            **dict(self.static))

    def cast(x, dtype, salt, seed):
      if seed is None:
        return x.astype(dtype)
      return round_with_key(x, dtype, (*seed, h.count_lo, h.count_hi), salt, index)

    state_seed = (h.seed_lo, h.seed_hi) if self.rounding else None
    param_seed = (h.pseed_lo, h.pseed_hi) if self.param_rounding else None
    new_state = [cast(x, s.dtype, k + 1, state_seed)
                 for k, (x, s) in enumerate(zip(new_state, state))]
    tail = []
    if self.master:
      new_master = (p + u).astype(extra[0].dtype)
      u = cast(new_master, extra[1].dtype, 0, param_seed)
      tail = [new_master]
    elif self.apply:
      u = cast(p + u, extra[0].dtype, 0, param_seed)
    if self.guard:
      finite = h.finite > 0
      keep = extra[-1] if (self.apply or self.master) else jnp.zeros_like(u)
      u = rules.where_scalar(finite, u, keep)
      new_state = [rules.where_scalar(finite, x, s) for x, s in zip(new_state, state)]
      tail = [rules.where_scalar(finite, x, extra[0]) for x in tail]
    return (u, *new_state, *tail)

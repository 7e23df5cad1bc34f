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

import numpy as np


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
  """

  name: str
  init: float | str = 0.0
  dtype: str | None = None
  pad: float = 0.0
  when: str | None = None

  def exists(self, options: Mapping[str, Any]) -> bool:
    if self.when is None:
      return True
    value = options[self.when]  # a flag, or a number (maybe traced) that may be None
    return bool(value) if isinstance(value, (bool, np.bool_)) else value is not None


@dataclasses.dataclass(frozen=True)
class Reduction:
  """Per-leaf L2 norms the rule's executor returns, and the second pass that uses them.

  Attributes:
    inputs: names among the rule's inputs (``"g"``, a field, ``"p"``) to take norms of.
    outputs: names among its outputs (``"u"``, a field) to take norms of.
    finish: ``finish(h, u, p, *norms, cast_lr=...) -> update``, elementwise on one leaf.
  """

  inputs: tuple[str, ...]
  outputs: tuple[str, ...]
  finish: Callable


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """Everything the builder needs to make an optimizer.

  Attributes:
    name: the optimizer's name (its kernels are named after it).
    arguments: ``(name, kind)`` of each argument of the public function besides
      ``backend`` and ``executor_options``, checked by kind: ``"schedule"`` (a number, a
      scalar array or a callable of the count), ``"number"``, ``"optional number"``,
      ``"flag"``, ``"dtype"`` (``None`` or a floating dtype) or ``"mask"``.
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
  validate: Callable[[str, Mapping[str, Any]], None] | None = None


@dataclasses.dataclass(frozen=True)
class BoundRule:
  """A spec's rule with its wiring and static options bound: ``(h, *inputs) -> outputs``.

  Hashable (it keys the kernel caches). With ``apply`` the first output is the new params
  ``p + u`` in the params' dtype, as :func:`optax.apply_updates` computes them.
  """

  fn: Callable
  fields: tuple[str, ...]
  with_params: bool
  static: tuple[tuple[str, Any], ...]
  apply: bool = False

  def __call__(self, h, g, *rest):
    state = dict(zip(self.fields, rest))
    p = rest[len(self.fields)] if self.with_params else None
    u, *new_state = self.fn(h, g, p=p, **state, **dict(self.static))
    if self.apply:
      u = (p + u).astype(p.dtype)
    return (u, *new_state)

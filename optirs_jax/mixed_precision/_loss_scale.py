"""Loss scales (jmp's semantics), and the finiteness helpers a scaled step needs."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import numbers
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optirs_jax.dtypes import widened


def _concrete(x) -> float | None:
  """``x`` as a Python float when it is known now (not traced), else None."""
  try:
    return float(x)
  except Exception:  # a tracer, an abstract value, a placeholder
    return None


def _check_at_least(cls: str, name: str, value, low: float, *, strict: bool) -> None:
  v = _concrete(value)
  if v is not None and not (v > low if strict else v >= low):
    rule = "positive" if strict else f">= {low:g}"
    raise ValueError(f"{cls}: {name}={value!r} must be {rule}")


def _warn_if_not_floating(x, name: str) -> None:
  """jmp's warning for an integer scale. Only numbers and arrays are checked: a pytree is
  also unflattened with placeholders in its leaves (JAX's, orbax's)."""
  if isinstance(x, (bool, np.bool_)) or not isinstance(
      x, (numbers.Number, np.ndarray, np.generic, jax.Array)):
    return
  dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
  if not jnp.issubdtype(dtype, jnp.floating):
    warnings.warn(f"Expected floating type for {name}, got {dtype}", stacklevel=4)


def _static_float(cls: str, name: str, value):
  """A static setting (it keys the compiled step) as a Python number: a concrete array is
  converted; a traced one is an error."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return value
  v = _concrete(value)
  if v is None:
    raise ValueError(f"{cls}: {name}={value!r} must be a concrete number (it is static)")
  return v


def _widen(x: jax.Array) -> jax.Array:
  """Floating ``x`` in float32 or wider (float16/bfloat16 leaves become float32)."""
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    return x
  return x.astype(widened(x.dtype))


def _times(tree, factor):
  """Floating leaves, widened to float32 or more, times ``factor``; other leaves as they are."""

  def times(x):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return x
    x = _widen(x)
    return x * jnp.asarray(factor, jnp.float32).astype(x.dtype)

  return jax.tree.map(times, tree)


@functools.partial(jax.tree_util.register_dataclass, data_fields=[],
                   meta_fields=["loss_scale"])
@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """A fixed loss scale: ``scale`` multiplies, ``unscale`` divides, ``adjust`` keeps it.

  As in jmp, a pytree without leaves: the scale is a static number (a concrete array is
  taken as its value), so a step compiles for it.

  >>> import jax.numpy as jnp
  >>> ls = StaticLossScale(128.0)
  >>> ls.scale(jnp.float32(2.0)), ls.unscale(jnp.float16(256.0)).dtype
  (Array(256., dtype=float32), dtype('float32'))
  """

  loss_scale: Any

  def __post_init__(self):
    object.__setattr__(self, "loss_scale",
                       _static_float("StaticLossScale", "loss_scale", self.loss_scale))
    _check_at_least("StaticLossScale", "loss_scale", self.loss_scale, 0.0, strict=False)

  def scale(self, tree):
    """``tree * loss_scale`` (floating leaves in float32 or wider)."""
    return _times(tree, self.loss_scale)

  def unscale(self, tree):
    """``tree / loss_scale`` (float16/bfloat16 leaves come back in float32)."""
    return _times(tree, 1.0 / jnp.asarray(self.loss_scale, jnp.float32))

  def adjust(self, grads_finite) -> StaticLossScale:
    del grads_finite
    return self


@functools.partial(jax.tree_util.register_dataclass, data_fields=[], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """No loss scaling: ``scale`` and ``unscale`` return the tree unchanged."""

  @property
  def loss_scale(self) -> jax.Array:
    return jnp.ones([], jnp.float32)

  def scale(self, tree):
    return tree

  def unscale(self, tree):
    return tree

  def adjust(self, grads_finite) -> NoOpLossScale:
    del grads_finite
    return self


@functools.partial(jax.tree_util.register_dataclass, data_fields=["loss_scale", "counter"],
                   meta_fields=["period", "factor", "min_loss_scale"])
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  r"""A loss scale that grows after ``period`` finite steps and shrinks on a non-finite one.

  jmp's semantics: on a finite step the counter goes up, and after ``period`` consecutive
  finite steps the scale is multiplied by ``factor`` (unless that overflows) and the
  counter resets; on a non-finite step the scale is divided by ``factor``, never below
  ``min_loss_scale``, and the counter resets. A pytree (``loss_scale`` and ``counter`` are
  its leaves), so it can live in an optimizer state under ``jax.jit``.

  Args:
    loss_scale: the current scale (> 0; a float, as in jmp: an integer one warns).
    counter: finite steps since the last change.
    period: finite steps before the scale grows (a whole number >= 1).
    factor: the growth and backoff factor (>= 1).
    min_loss_scale: the floor of the scale (>= 0; a float: an integer one warns); it holds
      under ``jax.jit``.

  >>> import jax.numpy as jnp
  >>> ls = DynamicLossScale(2.0**15, period=2)
  >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
  >>> float(ls.loss_scale), int(ls.counter)
  (65536.0, 0)
  >>> float(ls.adjust(jnp.array(False)).loss_scale)
  32768.0
  """

  loss_scale: Any
  counter: Any = 0
  period: int = 2000
  factor: float = 2
  min_loss_scale: float = 1.0

  def __post_init__(self):
    cls = "DynamicLossScale"
    _warn_if_not_floating(self.loss_scale, "loss_scale")
    _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
    _check_at_least(cls, "loss_scale", self.loss_scale, 0.0, strict=True)
    for name in ("period", "factor", "min_loss_scale"):  # static: they key the step
      object.__setattr__(self, name, _static_float(cls, name, getattr(self, name)))
    _check_at_least(cls, "min_loss_scale", self.min_loss_scale, 0.0, strict=False)
    if isinstance(self.period, bool) or self.period != int(self.period) or self.period < 1:
      raise ValueError(f"{cls}: period={self.period!r} must be a whole number >= 1")
    object.__setattr__(self, "period", int(self.period))
    if self.factor < 1:
      raise ValueError(f"{cls}: factor={self.factor!r} must be a number >= 1")

  def scale(self, tree):
    """``tree * loss_scale`` (floating leaves in float32 or wider)."""
    return _times(tree, self.loss_scale)

  def unscale(self, tree):
    """``tree / loss_scale`` (float16/bfloat16 leaves come back in float32)."""
    return _times(tree, 1.0 / jnp.asarray(self.loss_scale, jnp.float32))

  def adjust(self, grads_finite) -> DynamicLossScale:
    """The next loss scale, given whether this step's gradients were all finite."""
    grads_finite = jnp.asarray(grads_finite)
    if grads_finite.ndim != 0:
      raise ValueError(f"adjust expects a boolean scalar; got shape {grads_finite.shape}")
    scale = jnp.asarray(self.loss_scale, jnp.float32)
    counter = jnp.asarray(self.counter, jnp.int32)
    grown = scale * self.factor
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    finite_scale = jnp.where(counter == self.period - 1, grown, scale)
    shrunk = jnp.maximum(jnp.float32(self.min_loss_scale), scale / self.factor)
    new_scale = jnp.where(grads_finite, finite_scale, shrunk)
    new_counter = jnp.where(grads_finite, (counter + 1) % self.period, 0).astype(jnp.int32)
    return dataclasses.replace(self, loss_scale=new_scale, counter=new_counter)


LossScale = DynamicLossScale | StaticLossScale | NoOpLossScale


def all_finite(tree) -> jax.Array:
  """A boolean scalar: whether every element of every leaf is finite (True for no leaves).

  >>> import jax.numpy as jnp
  >>> bool(all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
  False
  """
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


class PredicateError(ValueError, AssertionError):
  """A predicate that is not a boolean scalar: a ValueError, and the AssertionError jmp's
  ``select_tree`` raises, so code written for either catches it."""


def select_tree(pred, a, b):
  """``a`` where the boolean scalar ``pred`` is True, else ``b`` (trees of one structure).

  >>> import jax.numpy as jnp
  >>> select_tree(jnp.array(False), {"x": jnp.ones(2)}, {"x": jnp.zeros(2)})["x"]
  Array([0., 0.], dtype=float32)
  """
  pred = jnp.asarray(pred)
  if pred.ndim != 0 or pred.dtype != jnp.bool_:
    raise PredicateError("select_tree: expected boolean scalar as pred; got "
                         f"{pred.dtype}{list(pred.shape)}")
  ta, tb = jax.tree.structure(a), jax.tree.structure(b)
  if ta != tb:
    raise ValueError(f"select_tree: the two trees differ in structure: {ta} vs {tb}"[:600])

  def pick(path, x, y):
    if jnp.shape(x) != jnp.shape(y) or jnp.asarray(x).dtype != jnp.asarray(y).dtype:
      raise ValueError(f"select_tree: leaf {jax.tree_util.keystr(path)} is "
                       f"{jnp.asarray(x).dtype}{list(jnp.shape(x))} in one tree and "
                       f"{jnp.asarray(y).dtype}{list(jnp.shape(y))} in the other")
    return jax.lax.select(pred, x, y)

  return jax.tree_util.tree_map_with_path(pick, a, b)


def _register_with_flax_serialization() -> None:
  """Teaches ``flax.serialization`` the loss scales (it knows only its own pytrees, dicts,
  lists and NamedTuples), where flax is installed: ``to_bytes``/``from_bytes`` of a state
  holding one then round-trip. The static settings (period, factor, the static scale) come
  from the target, as the structure does."""
  if importlib.util.find_spec("flax") is None:
    return
  from flax import serialization

  def dynamic_to(ls):
    return {"loss_scale": serialization.to_state_dict(ls.loss_scale),
            "counter": serialization.to_state_dict(ls.counter)}

  def dynamic_from(target, state):
    return dataclasses.replace(
        target, loss_scale=serialization.from_state_dict(target.loss_scale,
                                                          state["loss_scale"], "loss_scale"),
        counter=serialization.from_state_dict(target.counter, state["counter"], "counter"))

  serialization.register_serialization_state(DynamicLossScale, dynamic_to, dynamic_from,
                                             override=True)
  for cls in (StaticLossScale, NoOpLossScale):  # no arrays: the target is the value
    serialization.register_serialization_state(cls, lambda ls: {},
                                               lambda target, state: target, override=True)


_register_with_flax_serialization()

"""A spec's wiring, checked when an optimizer is built: the rule's keywords, the scalars it
reads, the scalars the spec computes, the outputs it returns.

A mismatch (a field the rule has no keyword for, an ``h.<name>`` that is not in the spec's
``hyper``, a ``hyper`` name nothing computes, one output too few) is a ``ValueError`` that
names it, when the optimizer is made, on every backend; without the check it surfaced as
an ``AttributeError`` inside one executor only (the kernels read ``h`` from a vector laid
out by ``hyper``). The rule is traced once per variant on abstract values
(``jax.eval_shape``), so the check costs no computation.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from optirs_jax.spec import OptimizerSpec

BUILDER_SCALARS = ("neg_lr", "wd")  # what the builder computes itself


class _Recording(dict):
  """A hyper-parameter dict that answers any name with a float32 scalar and records it."""

  def __init__(self):
    super().__init__()
    self.read: set[str] = set()

  def __getattr__(self, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    self.read.add(name)
    return jnp.ones((), jnp.float32)

  def __getitem__(self, name):
    return self.__getattr__(name)


def check_wiring(fn: str, spec: OptimizerSpec, options: Mapping[str, Any],
                 names: tuple[str, ...]) -> None:
  """Raises a ValueError naming the first mismatch between ``spec``'s rule, its ``hyper``,
  its ``scalars`` and its fields, for the optimizer made with ``options``."""
  fac = spec.factored
  if fac is not None and (spec.reduction is None or names != (fac.full,)):
    raise ValueError(f"{fn}: spec {spec.name!r} keeps factored statistics: it needs a "
                     f"reduction, and its rule's only field must be {fac.full!r} (fields: "
                     f"{list(names)})")
  static = dict(spec.static(options))
  if spec.weight_decay:
    static["decay"] = True  # the variant that reads the most: h.wd and p
  _check_keywords(fn, spec, static)
  scalar_names = _scalar_names(spec, options)
  missing = [n for n in spec.hyper if n not in scalar_names and n not in BUILDER_SCALARS]
  if missing:
    raise ValueError(f"{fn}: spec {spec.name!r} lists {missing} in hyper, but its scalars() "
                     f"computes only {sorted(scalar_names)} (and the builder "
                     f"{list(BUILDER_SCALARS)})")
  read, outputs = _trace(spec, names, tuple(sorted(static.items(), key=lambda kv: kv[0])))
  unknown = sorted(read - set(spec.hyper))
  if unknown:
    raise ValueError(f"{fn}: the rule {spec.rule.__name__} reads h.{unknown[0]}, which is not "
                     f"in spec {spec.name!r}'s hyper {list(spec.hyper)}")
  if outputs != 1 + len(names):
    raise ValueError(f"{fn}: the rule {spec.rule.__name__} returns {outputs} arrays; spec "
                     f"{spec.name!r} wants the update and its fields {list(names)}: "
                     f"{1 + len(names)}")


def _check_keywords(fn: str, spec: OptimizerSpec, static: Mapping[str, Any]) -> None:
  params = inspect.signature(spec.rule).parameters
  if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return
  late = set(spec.reduction.fields) if spec.reduction is not None else set()
  late |= {f.name for f in spec.fields if f.per_leaf}  # the reduction's between() reads them
  given = {"p", "cast_lr", *static, *(f.name for f in spec.fields if f.name not in late)}
  for name in sorted(given):
    if name not in params:
      what = ("a state field" if name in {f.name for f in spec.fields} else
              "a static option" if name in static else "a keyword the builder passes")
      raise ValueError(f"{fn}: the rule {spec.rule.__name__} has no keyword {name!r} "
                       f"({what} of spec {spec.name!r}); its parameters are {list(params)}")
  for name, p in list(params.items())[2:]:  # after (h, g)
    if name not in given and name not in late and p.default is inspect.Parameter.empty:
      raise ValueError(f"{fn}: the rule {spec.rule.__name__} needs {name!r}, which spec "
                       f"{spec.name!r} neither has as a field nor returns from static()")


def _scalar_names(spec: OptimizerSpec, options) -> set[str]:
  out = {}

  def scalars(count):
    out.update(spec.scalars(options, count))
    return count

  jax.eval_shape(scalars, jax.ShapeDtypeStruct((), jnp.int32))
  return set(out)


@functools.lru_cache(maxsize=256)
def _trace(spec: OptimizerSpec, names: tuple[str, ...], static: tuple) -> tuple[set, int]:
  """(the names the rule reads from ``h``, how many arrays it returns) for one variant."""
  h = _Recording()
  leaf = jax.ShapeDtypeStruct((4,), jnp.float32)
  box = {}

  def run(g, p, *fields):
    out = spec.rule(h, g, p=p, cast_lr=False, **dict(zip(names, fields)), **dict(static))
    box["n"] = len(out)
    return out

  jax.eval_shape(run, leaf, leaf, *([leaf] * len(names)))
  return set(h.read), box["n"]

"""Which transformations :func:`optirs_jax.apply` runs as one kernel pass, and how.

A *fused step* takes ``(grads, state, params)`` and the mixed-precision wrappers' keywords
(``master``, ``inv_scale``, ``finite``, ``param_seed``) and returns ``(new params, new
state)`` (and the new master copies, given ``master``): the params are written by the
optimizer's kernel, never as ``update`` followed by :func:`optax.apply_updates`. Fused are:

* an optirs_jax optimizer, and :func:`~optirs_jax.mixed_precision.with_loss_scaling` /
  :func:`~optirs_jax.mixed_precision.master_weights` around a fused one;
* ``optax.chain(link, ..., inner)`` (and ``optax.named_chain``) whose last transformation
  is fused and whose other links are optax's ``clip_by_global_norm`` (first only),
  ``clip``, ``scale``, ``scale_by_learning_rate``, ``scale_by_schedule``,
  ``add_decayed_weights`` (without a mask) or ``identity``: each link becomes a few
  scalars and one elementwise step on the gradient inside the optimizer's kernel
  (:func:`optirs_jax.spec.apply_prologue`), and the global norm one read-only pass over the
  gradients (:mod:`optirs_jax.global_norm`);
* ``optax.inject_hyperparams(f)(...)`` where ``f`` makes a fused transformation: the
  hyper-parameters are traced values of the kernel's hyper-parameter vector anyway.

Anything else (another link, a link after the optimizer, a masked decay) runs as
``update`` and ``optax.apply_updates``, with the same numbers; :func:`explain` says which
path a transformation takes and why. optax's transformations are recognized by the
functions optax builds (their names and the values they close over, as in optax 0.2.x);
one that does not look as expected is not fused, never guessed at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optirs_jax.global_norm import global_norm
from optirs_jax.spec import NotFused

FusedStep = Callable[..., tuple]


@dataclasses.dataclass(frozen=True)
class _Link:
  """An optax link before the optimizer: its kind and the values it closes over."""

  kind: str
  value: Any = None


def _closure(fn) -> dict:
  code = getattr(fn, "__code__", None)
  cells = getattr(fn, "__closure__", None) or ()
  if code is None:
    return {}
  return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def _is(fn, module_prefix: str, qualname: str, *freevars: str) -> bool:
  """Whether ``fn`` is the function optax builds under that name, closing over those."""
  return (getattr(fn, "__qualname__", None) == qualname
          and str(getattr(fn, "__module__", "")).startswith(module_prefix)
          and set(freevars) <= set(_closure(fn)))


def _unwrap(update_fn):
  """``update_fn`` without optax's ``with_extra_args_support`` wrappers."""
  while _is(update_fn, "optax", "with_extra_args_support.<locals>.update", "tx"):
    update_fn = _closure(update_fn)["tx"].update
  return update_fn


def _link(update_fn) -> _Link | None:
  """The link an optax update function is, or None."""
  c = _closure(update_fn)
  for kind, freevar in (("clip_by_global_norm", "max_norm"), ("clip", "max_delta"),
                        ("scale", "step_size"), ("scale_by_schedule", "step_size_fn"),
                        ("add_decayed_weights", "weight_decay")):
    if _is(update_fn, "optax", f"{kind}.<locals>.update_fn", freevar):
      return _Link(kind, c[freevar])
  if _is(update_fn, "optax", "identity.<locals>.update_fn"):
    return _Link("identity")
  return None


def _describe(update_fn) -> str:
  """A short name of an update function: its optirs_jax name, or the optax function that
  built it (``optax.chain``, ``optax.scale``), or its module and qualified name."""
  name = getattr(update_fn, "optirs_name", None)
  if name is not None:
    return name
  module = getattr(update_fn, "__module__", "?")
  qualname = getattr(update_fn, "__qualname__", "?").split(".<locals>.")[0]
  if module.split(".")[0] in ("optax", "optirs_jax"):
    module = module.split(".")[0]
  return f"{module}.{qualname}"


def _plan(update_fn) -> tuple[FusedStep | None, str]:
  """``(fused step or None, description or the reason it is not fused)``."""
  update_fn = _unwrap(update_fn)
  fused = getattr(update_fn, "fused_apply", None)
  if fused is not None:
    name = getattr(update_fn, "optirs_name", "optirs_jax")
    inner = getattr(update_fn, "inner_not_fused", None)  # a wrapper around an unfused one
    if inner is not None:
      return None, f"{name}: {inner}"
    return fused, name
  if _is(update_fn, "optax", "chain.<locals>.update_fn", "update_fns"):
    return _chain_plan(list(_closure(update_fn)["update_fns"]), "chain")
  if _is(update_fn, "optax", "named_chain.<locals>.update_fn", "transforms"):
    transforms = _closure(update_fn)["transforms"]
    return _chain_plan([t.update for _, t in transforms], "named_chain")
  if _is(update_fn, "optax", "inject_hyperparams.<locals>.wrapped_transform.<locals>.update_fn",
         "inner_factory", "other_hps", "sched_hps", "hyperparam_dtype"):
    c = _closure(update_fn)
    name = getattr(c["inner_factory"], "__name__", "?")
    if not str(getattr(c["inner_factory"], "__module__", "")).startswith("optirs_jax"):
      return None, f"inject_hyperparams({name}): {name} is not an optirs_jax optimizer"
    return _inject_step(c), f"inject_hyperparams({name})"
  return None, f"{_describe(update_fn)} is not a transformation optirs_jax fuses"


def _chain_plan(update_fns: list, what: str) -> tuple[FusedStep | None, str]:
  if not update_fns:
    return None, f"an empty {what}"
  inner, inner_name = _plan(update_fns[-1])
  if inner is None:
    return None, f"{what}: its last transformation is not fused ({inner_name})"
  if len(update_fns) > 1 and not getattr(_unwrap(update_fns[-1]), "folds_links", True):
    return None, f"{what}: {inner_name} does not fold links into its kernel yet"
  links = []
  for k, fn in enumerate(update_fns[:-1]):
    link = _link(_unwrap(fn))
    if link is None:
      return None, (f"{what}: link {k} ({_describe(_unwrap(fn))}) is not a link optirs_jax "
                    "folds into a kernel")
    if link.kind == "clip_by_global_norm" and any(x.kind != "identity" for x in links):
      return None, f"{what}: clip_by_global_norm after another link (only first is fused)"
    links.append(link)
  names = ", ".join([x.kind for x in links] + [inner_name])
  return _chain_step(links, inner), f"{what}({names})"


def _guarded(finite, new, old):
  """``new`` where the step is finite (or unguarded), else ``old`` (small states)."""
  if finite is None:
    return new
  return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def _chain_step(links: list[_Link], inner: FusedStep) -> FusedStep:
  def run(grads, state, params, *, prologue=(), inv_scale=None, finite=None, **kw):
    if not isinstance(state, tuple) or len(state) != len(links) + 1:
      raise ValueError(f"optirs_jax.apply: the chain has {len(links) + 1} transformations "
                       f"but its state has {len(state) if isinstance(state, tuple) else 'no'} "
                       "parts; was it made by this chain's init()?")
    prologue, new_states = list(prologue), list(state)
    for k, (link, s) in enumerate(zip(links, state)):
      item, new_states[k] = _fold(link, s, grads, inv_scale, first=not prologue)
      new_states[k] = _guarded(finite, new_states[k], s)
      if item is not None:
        prologue.append(item)
    out = inner(grads, state[-1], params, prologue=tuple(prologue), inv_scale=inv_scale,
                finite=finite, **kw)
    new_states[-1] = out[1]
    return (out[0], tuple(new_states), *out[2:])

  return run


def _fold(link: _Link, state, grads, inv_scale, first: bool):
  """``((kind, scalars) or None, new link state)``: what a link adds to the kernel's
  prologue at this step, as optax's link computes its values."""
  v = link.value
  if link.kind == "identity":
    return None, state
  if link.kind == "clip_by_global_norm":
    if not first:
      raise NotFused("clip_by_global_norm after another link")
    return ("clip_by_global_norm", {"norm": global_norm(jax.tree.leaves(grads), inv_scale),
                                    "max": v}), state
  if link.kind == "clip":
    return ("clip", {"max": v}), state
  if link.kind == "scale":
    return ("scale", {"step": v}), state
  if link.kind == "scale_by_schedule":
    return (("scale_by_schedule", {"step": v(state.count)}),
            state._replace(count=optax.safe_increment(state.count)))
  if link.kind == "add_decayed_weights":
    new_state = state._replace(count=optax.safe_increment(state.count)) if callable(v) else state
    if isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0.0:
      return None, new_state  # optax skips a zero constant
    return ("add_decayed_weights", {"wd": v(state.count) if callable(v) else v}), new_state
  raise NotFused(f"link {link.kind}")


def _convert_floats(x, dtype):
  """optax's conversion of injected hyper-parameters (``optax.schedules._inject``'s)."""
  if isinstance(x, jax.Array) and not getattr(x, "weak_type", False):
    return x
  current = x.dtype if hasattr(x, "dtype") else type(x)
  if jax.dtypes.issubdtype(current, jnp.floating):
    return jnp.asarray(x, dtype=dtype)
  return x


def _inject_step(c: dict) -> FusedStep:
  inner_factory, other_hps = c["inner_factory"], c["other_hps"]
  sched_hps, hyperparam_dtype = c["sched_hps"], c["hyperparam_dtype"]

  def run(grads, state, params, *, finite=None, **kw):
    dtype = hyperparam_dtype or optax.tree.dtype(params, "highest")
    hparams = {k: _convert_floats(v, dtype) for k, v in state.hyperparams.items()}
    hparams.update({k: _convert_floats(f(state.hyperparams_states[k]), dtype)
                    for k, f in sched_hps.items()})
    hstates = {k: f.update(state.hyperparams_states[k]) for k, f in sched_hps.items()}
    step, why = _plan(inner_factory(**other_hps, **hparams).update)
    if step is None:
      raise NotFused(why)
    out = step(grads, state.inner_state, params, finite=finite, **kw)
    small = _guarded(finite, (optax.safe_increment(state.count), hparams, hstates),
                     (state.count, state.hyperparams, state.hyperparams_states))
    new_state = state._replace(count=small[0], hyperparams=small[1],
                               hyperparams_states=small[2], inner_state=out[1])
    return (out[0], new_state, *out[2:])

  return run


def name_of(tx: optax.GradientTransformation) -> str:
  """A short name of ``tx`` for messages: ``chain(clip_by_global_norm, adamw)``, ``adamw``,
  or the function optax built."""
  step, what = _plan(tx.update)
  return what if step is not None else _describe(_unwrap(tx.update))


def fused_step(tx: optax.GradientTransformation) -> FusedStep | None:
  """The fused step of ``tx``, or None where ``apply`` runs ``update`` and
  ``apply_updates``."""
  return _plan(tx.update)[0]


def why_not_fused(tx: optax.GradientTransformation) -> str | None:
  """Why ``tx`` has no fused step, or None where it has one."""
  step, what = _plan(tx.update)
  return None if step is not None else what


def _innermost(update_fn):
  """The transformation at the end of ``update_fn``'s chains (itself if not a chain)."""
  update_fn = _unwrap(update_fn)
  if _is(update_fn, "optax", "chain.<locals>.update_fn", "update_fns"):
    fns = list(_closure(update_fn)["update_fns"])
    return _innermost(fns[-1]) if fns else None
  if _is(update_fn, "optax", "named_chain.<locals>.update_fn", "transforms"):
    transforms = _closure(update_fn)["transforms"]
    return _innermost(transforms[-1][1].update) if transforms else None
  return update_fn


def why_not_wrapped(tx: optax.GradientTransformation, what: str) -> str | None:
  """Why a wrapper cannot fold ``what`` (loss scaling, master weights) into ``tx``'s fused
  step -- its optimizer draws noise before its kernel, keeps factored statistics in XLA,
  or is 8-bit Adam -- or None."""
  fn = _innermost(tx.update)
  if fn is not None and getattr(fn, "folds_wrappers", True) is False:
    return f"{getattr(fn, 'optirs_name', _describe(fn))} does not fold {what} into its kernel"
  return None


def explain(tx: optax.GradientTransformation) -> str:
  """Which path :func:`optirs_jax.apply` takes for ``tx``, and why.

  >>> import optax, optirs_jax
  >>> from optirs_jax.fusion import explain
  >>> explain(optax.chain(optax.clip_by_global_norm(1.0), optirs_jax.adamw(1e-3)))
  'fused: chain(clip_by_global_norm, adamw)'
  >>> explain(optax.chain(optirs_jax.adamw(1e-3), optax.scale(0.5)))[:60]
  'update + apply_updates: chain: its last transformation is no'
  """
  step, what = _plan(tx.update)
  return f"fused: {what}" if step is not None else f"update + apply_updates: {what}"

"""Argument and tree checks shared by the optimizers: each error names the bad value (and
the leaf's key path) and lists what is valid."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optirs_jax.backends import validate_backend
from optirs_jax.pallas.options import ExecutorOptions


def check_number(fn: str, name: str, value: Any, *, allow_none: bool = False) -> None:
  """A numeric hyper-parameter: a Python number or a (traced) scalar array."""
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (numbers.Real, jax.Array, np.ndarray,
                                                        np.generic)):
    raise TypeError(f"{fn}: {name}={value!r} must be a real number or a scalar array")
  if getattr(value, "ndim", 0) != 0:
    raise ValueError(f"{fn}: {name} must be a scalar; got an array of shape {value.shape}")


def check_unit_interval(fn: str, name: str, value: Any) -> None:
  """A number (or scalar array) in [0, 1), such as a decay rate; traced values pass (one
  rule for every optimizer: a rate of 1 divides by a zero bias correction)."""
  check_number(fn, name, value)
  if isinstance(value, jax.core.Tracer):
    return
  if not 0 <= float(value) < 1:
    raise ValueError(f"{fn}: {name}={value!r} must be in [0, 1)")


def check_number_or_schedule(fn: str, name: str, value: Any) -> None:
  if callable(value):
    return
  try:
    check_number(fn, name, value)
  except TypeError:
    raise TypeError(f"{fn}: {name}={value!r} must be a number, a scalar array or a schedule "
                    "(a callable from step count to value)") from None


def check_flag(fn: str, name: str, value: Any) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{fn}: {name}={value!r} must be True or False")


def canonical_dtype(fn: str, name: str, dtype: Any):
  """``None`` or a floating/complex numpy dtype, checked (optax's ``canonicalize_dtype``)."""
  if dtype is None:
    return None
  if isinstance(dtype, (jax.Array, np.ndarray)):
    # optax.inject_hyperparams takes a dtype class (jnp.float32: callable) for a schedule
    # and passes its value at the count: an array of that dtype.
    dtype = dtype.dtype
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    raise TypeError(f"{fn}: {name}={dtype!r} is not a dtype; use None or a floating dtype such "
                    "as jnp.float32 or jnp.bfloat16") from None
  if not jnp.issubdtype(dt, jnp.inexact):
    raise TypeError(f"{fn}: {name}={dt} must be a floating or complex dtype")
  return jax.dtypes.canonicalize_dtype(dt)


def check_seed(fn: str, name: str, value: Any) -> None:
  """A non-negative 32-bit integer, or an integer scalar array (traced under
  ``optax.inject_hyperparams``)."""
  if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0 and jnp.issubdtype(
      value.dtype, jnp.integer):
    return
  if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
      or not 0 <= value < 2**32):
    raise ValueError(f"{fn}: {name}={value!r} must be a non-negative 32-bit int")


def is_random_key(value: Any) -> bool:
  """A typed random key array (``jax.random.key``'s)."""
  return isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jax.dtypes.prng_key)


def check_key(fn: str, name: str, value: Any) -> None:
  """A random key (``jax.random.key``'s typed key array) or an integer seed of one, as
  optax's ``add_noise`` takes (an integer scalar array too: traced under
  ``optax.inject_hyperparams``)."""
  if is_random_key(value) and value.ndim == 0:
    return
  if isinstance(value, (jax.Array, np.ndarray)) and value.ndim == 0 and jnp.issubdtype(
      value.dtype, jnp.integer):
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{fn}: {name}={value!r} must be a random key (jax.random.key(seed)) or "
                    "an int seed")


def check_axes(fn: str, name: str, value: Any) -> None:
  """``None``, a mesh axis name, or a tuple of them."""
  names = (value,) if isinstance(value, str) else value
  if value is not None and not (isinstance(names, tuple) and names
                                and all(isinstance(n, str) for n in names)):
    raise ValueError(f"{fn}: {name}={value!r} must be None, a mesh axis name or a tuple of "
                     "them")


def structural_int(fn: str, name: str, value: Any, lo: int) -> int | None:
  """An int argument that shapes the state, as an int ``>= lo`` (a concrete integer array,
  as ``optax.inject_hyperparams`` passes it, is taken); None where it is traced (under
  ``inject_hyperparams`` in ``update``, where the state already says it)."""
  if isinstance(value, jax.core.Tracer):
    return None
  try:
    v = int(value)
  except (TypeError, ValueError, jax.errors.ConcretizationTypeError):
    v = None
  if isinstance(value, bool) or v is None or v != value or v < lo:
    raise ValueError(f"{fn}: {name}={value!r} must be an int >= {lo} (a concrete value: "
                     f"under optax.inject_hyperparams pass static_args=('{name}',))")
  return v


def check_backend(fn: str, backend: str) -> str:
  try:
    return validate_backend(backend)
  except (ValueError, RuntimeError) as e:
    raise type(e)(f"{fn}: {e}") from None


def check_executor_options(fn: str, options: Any) -> ExecutorOptions:
  if options is None:
    return ExecutorOptions()
  if not isinstance(options, ExecutorOptions):
    raise TypeError(f"{fn}: executor_options={options!r} must be None or an "
                    "optirs_jax.ExecutorOptions")
  return options


def key_paths(tree, is_leaf=None) -> list[str]:
  """The key paths of ``tree``'s leaves as text (``"['w']"``; ``"<root>"`` for a bare leaf)."""
  with_paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
  return [jax.tree_util.keystr(p) or "<root>" for p, _ in with_paths]


def _some(paths: Sequence[str]) -> str:
  shown = ", ".join(paths[:5])
  return shown + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def structure_mismatch(fn: str, what: str, tree, ref_paths: Sequence[str], ref_what: str,
                       ref_treedef=None, is_leaf=None) -> str:
  """The message for a ``tree`` whose structure is not the reference's: the key paths one
  has and the other lacks, else (the same paths, other node types) both structures."""
  have = key_paths(tree, is_leaf)
  extra = [p for p in have if p not in set(ref_paths)]
  missing = [p for p in ref_paths if p not in set(have)]
  if missing or extra:
    parts = []
    if missing:
      parts.append(f"{what} have no leaf {_some(missing)}, which the {ref_what} have")
    if extra:
      parts.append(f"the {ref_what} have no leaf {_some(extra)}, which {what} have")
    hint = (" (was the state made by init() for other params?)" if what.startswith("state")
            else "")
    return f"{fn}: " + "; ".join(parts) + hint
  ref = ref_treedef if ref_treedef is not None else "?"
  return (f"{fn}: {what} do not have the structure of the {ref_what}: "
          f"{what} {_describe(tree)} vs {ref_what} {ref}")[:800]


def _describe(tree) -> str:
  text = str(jax.tree.structure(tree))
  return text if len(text) <= 300 else text[:300] + "..."


def flatten(fn: str, what: str, tree) -> tuple[list, list[str], Any]:
  """Leaves, their key paths as text, and the treedef; every leaf must be a float array."""
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [jax.tree_util.keystr(p) or "<root>" for p, _ in with_paths]
  leaves = []
  for path, (_, x) in zip(paths, with_paths):
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
      raise TypeError(f"{fn}: {what} leaf {path} is {type(x).__name__}, not an array")
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      raise TypeError(f"{fn}: {what} leaf {path} has dtype {x.dtype}; valid dtypes are floating "
                      "(float32, bfloat16, float16, float64) and complex")
    leaves.append(x)
  return leaves, paths, treedef


def match(fn: str, what: str, tree, treedef, ref_leaves: Sequence, paths: Sequence[str],
          ref_what: str = "updates", per_leaf: bool = False) -> list:
  """Leaves of ``tree``, checked to have ``treedef`` and the shapes of ``ref_leaves`` (or
  shape ``()``, one scalar per leaf, with ``per_leaf``)."""
  leaves, tdef = jax.tree.flatten(tree)
  if tdef != treedef:
    raise ValueError(structure_mismatch(fn, what, tree, paths, ref_what, treedef))
  for x, r, path in zip(leaves, ref_leaves, paths):
    want = () if per_leaf else r.shape
    if not hasattr(x, "shape") or x.shape != want:
      expected = ("it holds one scalar per leaf: shape ()" if per_leaf else
                  f"the {ref_what} leaf has shape {r.shape}")
      raise ValueError(f"{fn}: {what} leaf {path} has shape {getattr(x, 'shape', None)} but "
                       f"{expected}")
  return leaves


def mask_flags(fn: str, mask, tree, treedef) -> list[bool]:
  """Per-leaf booleans from an optax-style mask: a (prefix) tree of bools or a callable."""
  if mask is None:
    return [True] * treedef.num_leaves
  m = mask(tree) if callable(mask) else mask
  try:
    full = jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub), m, tree)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{fn}: mask must be a tree of bools with the structure of (a prefix of) "
                     f"the params: {e}") from None
  flags = jax.tree.leaves(full)
  for f in flags:
    if not isinstance(f, (bool, np.bool_)):
      raise TypeError(f"{fn}: mask leaves must be Python bools (static), got {f!r}")
  return [bool(f) for f in flags]


def as_float(count: jax.Array) -> jax.Array:
  """The step count as the default float type: what optax's ``decay**count`` promotes it to
  (float32, or float64 with ``jax_enable_x64``)."""
  return count.astype(jax.dtypes.canonicalize_dtype(jnp.float64))


def learning_rate(lr, count) -> tuple[Any, bool]:
  """``(-lr at this count, cast_to_update_dtype)`` as optax's ``scale_by_learning_rate``
  (``None``: no scaling, as optax's identity; its rule then reads no ``neg_lr``)."""
  if lr is None:
    return 0.0, False
  if callable(lr):
    return -1 * lr(count), True
  return -1 * lr, False


def weight_decay_value(wd, count):
  """The decay at this count, and whether the decay term exists at all (optax skips a
  Python-constant zero)."""
  if isinstance(wd, (int, float)) and not isinstance(wd, bool) and wd == 0.0:
    return 0.0, False
  return (wd(count) if callable(wd) else wd), True

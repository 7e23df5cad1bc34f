"""Mixed-precision policies: which dtype params are stored in, computed in, and output in."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


class _ByDtype(dict):
  """A dict keyed by dtype that takes any spelling of one (``np.float16``,
  ``jnp.float16``, ``np.dtype("float16")``) as its key."""

  def __missing__(self, key):
    try:
      canonical = jnp.dtype(key)
    except TypeError:
      raise KeyError(key) from None
    for k, v in self.items():
      if jnp.dtype(k) == canonical:
        return v
    raise KeyError(key)

  def __contains__(self, key) -> bool:
    try:
      self[key]
    except KeyError:
      return False
    return True


# Each dtype's names, the first being its short form in ``str(policy)`` (jmp's table).
dtype_to_names = _ByDtype({
    jnp.bfloat16: ("bf16", "bfloat16"),
    jnp.float16: ("f16", "float16"),
    jnp.float32: ("full", "f32", "float32", "single"),
    jnp.float64: ("f64", "float64", "double"),
})
_DTYPES = {name: dtype for dtype, names in dtype_to_names.items() for name in names}
_KEYS = {"p": "param_dtype", "params": "param_dtype", "c": "compute_dtype",
         "compute": "compute_dtype", "o": "output_dtype", "output": "output_dtype"}


def _cast(tree, dtype):
  """Floating leaves cast to ``dtype``; integer, boolean and other leaves untouched."""
  def cast(x):
    if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype) if hasattr(x, "astype") else jnp.asarray(x).astype(dtype)
    return x
  return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
  """Where a mixed-precision model keeps its params, computes and returns its outputs.

  >>> import jax.numpy as jnp
  >>> policy = get_policy("p=f32,c=bf16,o=f32")
  >>> policy.cast_to_compute({"w": jnp.ones(2), "step": jnp.int32(3)})["w"].dtype
  dtype(bfloat16)
  >>> str(policy)
  'p=full,c=bf16,o=full'
  """

  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any

  def __post_init__(self):
    for name in ("param_dtype", "compute_dtype", "output_dtype"):
      dt = jnp.dtype(getattr(self, name))
      if not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(f"Policy: {name}={dt} must be a floating dtype")
      object.__setattr__(self, name, dt)

  def cast_to_param(self, tree):
    """Floating leaves in the params' dtype (integer leaves untouched)."""
    return _cast(tree, self.param_dtype)

  def cast_to_compute(self, tree):
    """Floating leaves in the compute dtype (integer leaves untouched)."""
    return _cast(tree, self.compute_dtype)

  def cast_to_output(self, tree):
    """Floating leaves in the output dtype (integer leaves untouched)."""
    return _cast(tree, self.output_dtype)

  def with_param_dtype(self, dtype) -> Policy:
    return dataclasses.replace(self, param_dtype=dtype)

  def with_compute_dtype(self, dtype) -> Policy:
    return dataclasses.replace(self, compute_dtype=dtype)

  def with_output_dtype(self, dtype) -> Policy:
    return dataclasses.replace(self, output_dtype=dtype)

  def __str__(self) -> str:
    """jmp's short form, which :func:`get_policy` reads back: ``p=full,c=bf16,o=full``."""
    short = lambda dt: dtype_to_names[dt][0]
    return f"p={short(self.param_dtype)},c={short(self.compute_dtype)},o={short(self.output_dtype)}"


def half_dtype():
  """The half-precision dtype of the default backend: bfloat16 on a TPU, else float16 (as
  jmp's ``half_dtype``).

  >>> half_dtype() in (jnp.float16, jnp.bfloat16)
  True
  """
  return jnp.bfloat16 if jax.local_devices()[0].platform == "tpu" else jnp.float16


def cast_to_full(tree):
  """Floating leaves in float32; other leaves (integers, non-arrays) untouched.

  >>> cast_to_full({"h": jnp.ones(2, jnp.float16), "i": jnp.arange(2)})["h"].dtype
  dtype('float32')
  """
  return _cast(tree, jnp.float32)


def cast_to_half(tree):
  """Floating leaves in :func:`half_dtype`; other leaves untouched.

  >>> cast_to_half({"f": jnp.ones(2)})["f"].dtype in (jnp.float16, jnp.bfloat16)
  True
  """
  return _cast(tree, half_dtype())


def _parse_dtype(text: str, policy: str):
  name = text.strip().lower()
  if name == "half":
    return half_dtype()
  try:
    return _DTYPES[name]
  except KeyError:
    raise ValueError(f"Unknown dtype {text.strip()!r} in policy {policy!r}; valid dtypes are "
                     f"{sorted([*_DTYPES, 'half'])}") from None


def get_policy(policy: str) -> Policy:
  """A :class:`Policy` from jmp's string format.

  ``"params=float32,compute=bfloat16,output=float32"``, its short form
  ``"p=f32,c=bf16,o=f32"``, or one dtype for all three (``"bf16"``). Omitted parts default
  to float32 params, compute in the params' dtype and output in the compute dtype. A
  dtype is any name in :data:`dtype_to_names` or ``"half"`` (:func:`half_dtype`).

  >>> get_policy("c=f16").output_dtype
  dtype('float16')
  >>> get_policy("p=f32,x=bf16")  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  ValueError: Unknown key 'x' in policy 'p=f32,x=bf16'; valid keys are ['c', 'compute', ...]
  """
  if not isinstance(policy, str) or not policy.strip():
    raise ValueError(f"policy={policy!r} must be a non-empty string such as "
                     "'params=float32,compute=bfloat16,output=float32'")
  if "=" not in policy:
    dtype = _parse_dtype(policy, policy)
    return Policy(dtype, dtype, dtype)
  parts: dict[str, Any] = {}
  for part in policy.split(","):
    if part.count("=") != 1:
      raise ValueError(f"policy {policy!r}: {part.strip()!r} is not key=dtype")
    key, value = (t.strip() for t in part.split("="))
    if key.lower() not in _KEYS:
      raise ValueError(f"Unknown key {key!r} in policy {policy!r}; valid keys are "
                       f"{sorted(_KEYS)}")
    parts[_KEYS[key.lower()]] = _parse_dtype(value, policy)
  param = parts.get("param_dtype", jnp.float32)
  compute = parts.get("compute_dtype", param)
  return Policy(param, compute, parts.get("output_dtype", compute))

"""Which executor runs an optimizer's update.

=========  ==================================================================================
backend    what runs
=========  ==================================================================================
``auto``   the Pallas kernel on GPU (Triton) and TPU (Mosaic), the jnp reference elsewhere;
           chosen per platform at lowering time (``jax.lax.platform_dependent``'s
           semantics; each platform's branch traced only when lowered for), so one traced
           step exports correctly for every platform
``jnp``    the pure-jnp reference everywhere (XLA fuses it per leaf)
``pallas`` the Pallas kernels everywhere: Triton on GPU, Mosaic on TPU, interpret mode on
           CPU and other platforms (slow; for tests and debugging)
=========  ==================================================================================

All three compute the same elementwise rule (:mod:`optirs_jax.rules`); ``auto`` never
changes the math, only where it runs.
"""

from __future__ import annotations

import functools

SUPPORTED_BACKENDS: tuple[str, ...] = ("auto", "jnp", "pallas")


@functools.cache
def _pallas_import_error() -> str | None:
  try:
    from jax.experimental import pallas  # noqa: F401
    from jax.experimental.pallas import tpu, triton  # noqa: F401
  except ImportError as e:  # pragma: no cover - depends on the jax build
    return f"{type(e).__name__}: {e}"
  return None


def available_backends() -> tuple[str, ...]:
  """The backends that can run in this process (``jnp`` and ``auto`` always can).

  >>> import optirs_jax
  >>> "jnp" in optirs_jax.available_backends()
  True
  """
  return tuple(b for b in SUPPORTED_BACKENDS if b != "pallas" or _pallas_import_error() is None)


def validate_backend(backend: str) -> str:
  """Returns ``backend`` if it is supported and can run here, else raises a clear error."""
  if not isinstance(backend, str) or backend not in SUPPORTED_BACKENDS:
    raise ValueError(
        f"backend={backend!r} is not a known backend; valid backends are {SUPPORTED_BACKENDS}")
  if backend not in available_backends():
    raise RuntimeError(
        f"backend={backend!r} cannot run here ({_pallas_import_error()}); "
        f"available backends are {available_backends()}")
  return backend

"""optirs_jax: fused, Optax-compatible optimizers for JAX.

Each optimizer returns an :class:`optax.GradientTransformationExtraArgs` that computes the
same numbers as its optax namesake; on GPU and TPU the update runs as Pallas kernels over
many leaves per launch, on CPU a pure-jnp reference computes the same rule. The optimizers
are those of :data:`optirs_jax.transforms.REGISTRY` (:data:`OPTIMIZERS` names them).

>>> import jax.numpy as jnp, optax, optirs_jax
>>> opt = optax.chain(optax.clip_by_global_norm(1.0), optirs_jax.lamb(1e-3))
>>> params = {"w": jnp.ones((2, 3))}
>>> updates, state = opt.update(params, opt.init(params), params)
>>> updates["w"].dtype
dtype('float32')
"""

from importlib import metadata as _metadata

from optirs_jax import (
  flat,
  fusion,
  mixed_precision,
  multi_device,
  orthogonal,
  quantization,
  sparse,
)
from optirs_jax.apply import apply
from optirs_jax.backends import SUPPORTED_BACKENDS, available_backends
from optirs_jax.orthogonal import muon
from optirs_jax.pallas.options import ExecutorOptions, Tiling
from optirs_jax.quantization import adam8bit, adamw8bit
from optirs_jax.transforms import REGISTRY

# Every optimizer of the registry, and its state NamedTuple, under its own name: an
# optimizer's module in optirs_jax/transforms/ is all it takes to add one.
OPTIMIZERS: tuple[str, ...] = tuple(REGISTRY)
for _entry in REGISTRY.values():
  globals()[_entry.name] = _entry.make
  globals()[_entry.spec.state.__name__] = _entry.spec.state
_STATES = sorted({e.spec.state.__name__ for e in REGISTRY.values()})

try:
  __version__ = _metadata.version("optirs_jax")
except _metadata.PackageNotFoundError:  # running from a source tree
  __version__ = "0.0.0+local"

__all__ = [
    "OPTIMIZERS", "SUPPORTED_BACKENDS", "ExecutorOptions", "Tiling", "adam8bit", "adamw8bit",
    "apply", "available_backends", "flat", "fusion", "mixed_precision", "multi_device", "muon",
    "orthogonal", "quantization", "sparse",
]
__all__ += [*OPTIMIZERS, *_STATES]  # the registry's

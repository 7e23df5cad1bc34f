"""optirs_jax: fused, Optax-compatible optimizers for JAX.

Each optimizer returns an :class:`optax.GradientTransformationExtraArgs` that computes the
same numbers as its optax namesake; on GPU and TPU the update runs as Pallas kernels over
many leaves per launch, on CPU a pure-jnp reference computes the same rule.

>>> import jax.numpy as jnp, optax, optirs_jax
>>> opt = optax.chain(optax.clip_by_global_norm(1.0), optirs_jax.lamb(1e-3))
>>> params = {"w": jnp.ones((2, 3))}
>>> updates, state = opt.update(params, opt.init(params), params)
>>> updates["w"].dtype
dtype('float32')
"""

from importlib import metadata as _metadata

from optirs_jax import flat, mixed_precision, multi_device, quantization, sparse
from optirs_jax.apply import apply
from optirs_jax.backends import SUPPORTED_BACKENDS, available_backends
from optirs_jax.pallas.options import ExecutorOptions, Tiling
from optirs_jax.quantization import adam8bit, adamw8bit
from optirs_jax.transforms import (
  AdagradState,
  AdamState,
  LionState,
  RmspropState,
  SgdState,
  adagrad,
  adam,
  adamw,
  lamb,
  lion,
  rmsprop,
  sgd,
)

try:
  __version__ = _metadata.version("optirs_jax")
except _metadata.PackageNotFoundError:  # running from a source tree
  __version__ = "0.0.0+local"

__all__ = [
    "SUPPORTED_BACKENDS", "AdagradState", "AdamState", "ExecutorOptions", "LionState",
    "RmspropState", "SgdState", "Tiling", "adagrad", "adam", "adam8bit", "adamw", "adamw8bit",
    "apply", "available_backends", "flat", "lamb", "lion", "mixed_precision", "multi_device",
    "quantization", "rmsprop", "sgd", "sparse",
]

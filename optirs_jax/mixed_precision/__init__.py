"""Mixed-precision training: loss scaling, float32 master weights, precision policies.

What JAX and optax lack for float16/bfloat16 training, composable with any optax
transformation and usable from Flax and Haiku (casting itself is ``astype``):

* loss scales with jmp's semantics -- :class:`DynamicLossScale`, :class:`StaticLossScale`,
  :class:`NoOpLossScale` -- and :func:`all_finite`, :func:`select_tree`;
* :func:`with_loss_scaling`: an optimizer wrapper that unscales the gradients, skips
  non-finite steps and adjusts the scale (:func:`loss_scale_of`, :func:`skipped_steps_of`);
* :func:`master_weights`: float32 master copies of half-precision params;
* :class:`Policy` and :func:`get_policy` (jmp's ``"params=f32,compute=bf16,output=f32"``),
  :func:`half_dtype`, :func:`cast_to_full`, :func:`cast_to_half`.

A drop-in for jmp: jmp 0.0.4's own test files pass against this module
(``tests/test_jmp_suite.py``).

Low-precision optimizer state is a keyword of the optimizers themselves (``mu_dtype``,
``nu_dtype``, ``accumulator_dtype``, ``stochastic_rounding``).

A whole step (float16 compute, float32 master weights, dynamic loss scaling):

>>> import jax, jax.numpy as jnp, optirs_jax
>>> from optirs_jax import mixed_precision as mp
>>> policy = mp.get_policy("p=f16,c=f16,o=f32")
>>> tx = mp.with_loss_scaling(mp.master_weights(optirs_jax.adamw(1e-3)))
>>> params = {"w": jnp.full((4, 2), 0.5, jnp.float16)}
>>> state = tx.init(params)
>>> x, y = jnp.ones((8, 4), jnp.float16), jnp.zeros((8, 2))
>>> def loss_fn(p, scale):
...   out = policy.cast_to_output(x @ policy.cast_to_compute(p)["w"])
...   return scale.scale(jnp.mean((out - y) ** 2))
>>> @jax.jit
... def step(params, state):
...   grads = jax.grad(loss_fn)(params, mp.loss_scale_of(state))
...   return optirs_jax.apply(tx, grads, state, params)
>>> for _ in range(4):  # the first steps' float16 gradients overflow: skipped, scale halved
...   params, state = step(params, state)
>>> int(mp.skipped_steps_of(state)), float(mp.loss_scale_of(state).loss_scale)
(1, 16384.0)
>>> params["w"][0, 0], state.inner_state.master["w"][0, 0]
(Array(0.497, dtype=float16), Array(0.49700007, dtype=float32))
"""

from optirs_jax.mixed_precision._loss_scale import (
  DynamicLossScale,
  LossScale,
  NoOpLossScale,
  PredicateError,
  StaticLossScale,
  all_finite,
  select_tree,
)
from optirs_jax.mixed_precision._policy import (
  Policy,
  cast_to_full,
  cast_to_half,
  dtype_to_names,
  get_policy,
  half_dtype,
)
from optirs_jax.mixed_precision._wrappers import (
  LossScalingState,
  MasterWeightsState,
  loss_scale_of,
  master_weights,
  skipped_steps_of,
  with_loss_scaling,
)

__all__ = ["DynamicLossScale", "LossScale", "LossScalingState", "MasterWeightsState",
           "NoOpLossScale", "Policy", "PredicateError", "StaticLossScale", "all_finite",
           "cast_to_full", "cast_to_half", "dtype_to_names", "get_policy", "half_dtype",
           "loss_scale_of", "master_weights", "select_tree", "skipped_steps_of",
           "with_loss_scaling"]

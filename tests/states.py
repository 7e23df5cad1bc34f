"""Every kind of optimizer state this library makes, for the tests that carry states through
other libraries (Flax NNX, flax.serialization, orbax, pickle).

Each entry builds a transformation and names the params dtype it trains: the elementwise
and per-leaf-norm optimizers, the 8-bit ones (with 8-bit and float32 leaves), master
weights, loss scaling (dynamic, static, none), the row-sparse optimizers, and the optax
wrappers users put them in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import optirs_jax
from optirs_jax import mixed_precision as mp
from optirs_jax import sparse

# (id, factory, params dtype). Factories, not transformations: each test builds its own.
STATES = [
    ("adam", lambda: optirs_jax.adam(1e-2), jnp.float32),
    ("adamw_masked", lambda: optirs_jax.adamw(
        1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
     jnp.float32),
    ("sgd_nesterov", lambda: optirs_jax.sgd(1e-2, momentum=0.9, nesterov=True), jnp.float32),
    ("rmsprop_centered", lambda: optirs_jax.rmsprop(1e-3, centered=True, momentum=0.9),
     jnp.float32),
    ("adagrad", lambda: optirs_jax.adagrad(1e-2), jnp.float32),
    ("lamb", lambda: optirs_jax.lamb(1e-2, weight_decay=0.01), jnp.float32),
    ("lion", lambda: optirs_jax.lion(1e-3), jnp.float32),
    ("lars_master_weights", lambda: mp.master_weights(optirs_jax.lars(1e-1, weight_decay=1e-2)),
     jnp.bfloat16),
    ("novograd", lambda: optirs_jax.novograd(1e-2, weight_decay=1e-2), jnp.float32),
    ("adam8bit", lambda: optirs_jax.adam8bit(1e-2, min_8bit_size=512), jnp.float32),
    ("adamw8bit", lambda: optirs_jax.adamw8bit(1e-2, min_8bit_size=512), jnp.float32),
    ("lion_dynamic8", lambda: optirs_jax.lion(1e-3, state_quantization="dynamic8",
                                              min_quantized_size=512), jnp.float32),
    ("rmsprop_fp8", lambda: optirs_jax.rmsprop(1e-3, momentum=0.9, state_quantization="fp8",
                                               min_quantized_size=512), jnp.float32),
    ("master_weights", lambda: mp.master_weights(optirs_jax.adamw(1e-2)), jnp.bfloat16),
    ("loss_scaling_dynamic", lambda: mp.with_loss_scaling(
        mp.master_weights(optirs_jax.adamw(1e-2)), mp.DynamicLossScale(2.0**10, period=2)),
     jnp.bfloat16),
    ("loss_scaling_static", lambda: mp.with_loss_scaling(optirs_jax.adam(1e-2),
                                                         mp.StaticLossScale(8.0)), jnp.float32),
    ("loss_scaling_noop", lambda: mp.with_loss_scaling(optirs_jax.sgd(1e-2),
                                                       mp.NoOpLossScale()), jnp.float32),
    ("sparse_adam_catch_up", lambda: sparse.sparse_adam(1e-2, catch_up=True), jnp.float32),
    ("sparse_sgd", lambda: sparse.sparse_sgd(1e-2, momentum=0.9), jnp.float32),
    ("chain_clip_adamw", lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                             optirs_jax.adamw(1e-2)), jnp.float32),
    ("inject_adamw8bit", lambda: optax.inject_hyperparams(optirs_jax.adamw8bit)(
        learning_rate=1e-2, min_8bit_size=512), jnp.float32),
]

IDS = [s[0] for s in STATES]


def assert_quantized_close(a, b, step_rtol: float) -> None:
  """Two 8-bit moments (``Quantized8bit`` of one leaf or of trees) that two programs computed
  from the same math, where XLA may contract a product and a sum into one fma in one program
  and not in the other: the scales to float32 rounding, the codes equal almost everywhere,
  and where not, one code step apart (``step_rtol``: the format's largest relative step)."""
  import numpy as np
  for x, y in zip(jax.tree.leaves(a.absmax), jax.tree.leaves(b.absmax)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=0)
  for x, y in zip(jax.tree.leaves(a.codes), jax.tree.leaves(b.codes)):
    same = np.asarray(x).view(np.uint8) == np.asarray(y).view(np.uint8)
    assert same.mean() > 0.999, same.mean()
  for x, y in zip(jax.tree.leaves(a.dequantize()), jax.tree.leaves(b.dequantize())):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=step_rtol, atol=1e-12)


def nearest_codes(a, table):
  """bitsandbytes' encoding rule in numpy: of the largest value of the sorted map ``table``
  at most ``a`` (in [0, 1]) and the next one, the nearer, the smaller on a tie."""
  import numpy as np
  m0 = np.searchsorted(table, a, side="right") - 1
  m1 = np.minimum(m0 + 1, len(table) - 1)
  return np.where(table[m1] - a < a - table[m0], m1, m0)


def whole_block_trees(steps: int = 3):
  """``(params, [grads] * steps)`` for the grouped 8-bit launches' tests: leaves of several
  sizes whose last axes are whole blocks of 256 ("a" to "d"), one of a short last block
  ("e", the jnp math) and a small one ("f", float32 state); gradients in float32 and, on
  "b" and "d", bfloat16 (two runs of dtypes in one launch)."""
  import numpy as np
  shapes = {"a": (8, 512), "b": (2, 3, 256), "c": (1024,), "d": (4, 256), "e": (3, 700),
            "f": (37,)}
  rng = np.random.default_rng(0)
  params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in shapes.items()}
  grads = [{k: jnp.asarray(0.1 * rng.standard_normal(s),
                           jnp.bfloat16 if k in "bd" else jnp.float32)
            for k, s in shapes.items()} for _ in range(steps)]
  return params, grads

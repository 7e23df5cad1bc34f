"""A GPT-2-shaped decoder in Flax NNX, for the training benchmark (:mod:`optirs_jax.bench.train`).

GPT-2's architecture: learned position embeddings, pre-LayerNorm blocks of causal
self-attention and a 4x GELU MLP, a final LayerNorm, the output head tied to the token
embedding; weights drawn from N(0, 0.02), the residual projections' scaled by
``1/sqrt(2 * layers)``. Params in ``param_dtype``, computation in ``dtype`` (bfloat16 by
default), the loss in float32.

>>> from flax import nnx
>>> GPTConfig.preset("gpt2").parameters()  # GPT-2 small
124439808
>>> model = GPT(GPTConfig.preset("tiny"), nnx.Rngs(0))
>>> model(jnp.zeros((2, 16), jnp.int32)).shape
(2, 16, 256)
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import optax
from flax import nnx


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """One model of the family: depth, width, heads, context, vocabulary and dtypes."""

  layers: int
  width: int
  heads: int
  context: int
  vocab: int = 256
  dtype: str = "bfloat16"
  param_dtype: str = "float32"

  PRESETS: ClassVar[dict[str, dict]] = {
      # GPT-2 small's shape (its vocabulary: byte ids fill the first 256 rows; the others
      # still train, through the tied head's softmax, as GPT-2's rare tokens do).
      "gpt2": dict(layers=12, width=768, heads=12, context=1024, vocab=50257),
      # A smaller model of the family on bytes, for curves of a few thousand steps.
      "small": dict(layers=6, width=384, heads=6, context=256),
      # For CPU tests and the notebook's executed cells.
      "tiny": dict(layers=2, width=64, heads=2, context=64),
  }

  @classmethod
  def preset(cls, name: str, **changes) -> GPTConfig:
    if name not in cls.PRESETS:
      raise ValueError(f"unknown model {name!r}; valid: {sorted(cls.PRESETS)}")
    return cls(**(cls.PRESETS[name] | changes))

  def __post_init__(self):
    if self.width % self.heads:
      raise ValueError(f"width={self.width} is not a multiple of heads={self.heads}")
    for name in ("layers", "width", "heads", "context", "vocab"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be at least 1")

  def parameters(self) -> int:
    """The number of parameters (embeddings counted once: the head is tied)."""
    d = self.width
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return self.vocab * d + self.context * d + self.layers * block + 2 * d

  def scaled(self, layers: int, width: int) -> GPTConfig:
    """The same family at another depth and width (heads of 64 dimensions, as GPT-2's)."""
    return dataclasses.replace(self, layers=layers, width=width, heads=max(1, width // 64))


def _linear(d_in, d_out, config, rngs, std):
  return nnx.Linear(d_in, d_out, dtype=config.dtype, param_dtype=config.param_dtype,
                    kernel_init=nnx.initializers.normal(std), rngs=rngs)


class Block(nnx.Module):
  """Pre-LayerNorm attention and MLP, each added to the residual stream."""

  def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
    d, std = config.width, 0.02
    out_std = std / math.sqrt(2 * config.layers)
    norm = lambda: nnx.LayerNorm(d, epsilon=1e-5, dtype=config.dtype,
                                 param_dtype=config.param_dtype, rngs=rngs)
    self.heads = config.heads
    self.ln1, self.ln2 = norm(), norm()
    self.qkv = _linear(d, 3 * d, config, rngs, std)
    self.proj = _linear(d, d, config, rngs, out_std)
    self.fc = _linear(d, 4 * d, config, rngs, std)
    self.out = _linear(4 * d, d, config, rngs, out_std)

  def __call__(self, x):
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(self.ln1(x)).reshape(b, t, 3 * self.heads, d // self.heads),
                        3, axis=2)
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + self.proj(attended.reshape(b, t, d))
    return x + self.out(jax.nn.gelu(self.fc(self.ln2(x)), approximate=True))


class GPT(nnx.Module):
  """Token ids ``[batch, time]`` to logits ``[batch, time, vocab]`` (in ``dtype``)."""

  def __init__(self, config: GPTConfig, rngs: nnx.Rngs):
    init = nnx.initializers.normal(0.02)
    embed = lambda n: nnx.Embed(n, config.width, dtype=config.dtype,
                                param_dtype=config.param_dtype, embedding_init=init, rngs=rngs)
    self.config = config
    self.wte, self.wpe = embed(config.vocab), embed(config.context)
    self.blocks = nnx.List([Block(config, rngs) for _ in range(config.layers)])
    self.ln_f = nnx.LayerNorm(config.width, epsilon=1e-5, dtype=config.dtype,
                              param_dtype=config.param_dtype, rngs=rngs)

  def __call__(self, ids):
    # The byte embedding as a one-hot product and the positions as a slice, not gathers:
    # a gather's gradient is a scatter-add, and on a GPU the 8K tokens of a batch adding
    # into 256 rows with atomics took 17-34 ms of a 52-67 ms step (run 42, an H100), varied
    # by that much between identical configurations and summed in a different order each
    # run. The product's gradient is a matrix product: fast and the same every run. Each
    # row is exact (one term is nonzero), so the forward pass is the lookup's.
    dtype = self.config.dtype
    onehot = jax.nn.one_hot(ids, self.config.vocab, dtype=dtype)
    positions = self.wpe.embedding[...][:ids.shape[1]].astype(dtype)
    x = onehot @ self.wte.embedding[...].astype(dtype) + positions[None]
    for block in self.blocks:
      x = block(x)
    return self.wte.attend(self.ln_f(x))


def loss(model: GPT, batch: jax.Array) -> jax.Array:
  """Mean next-byte cross-entropy (nats) of ``batch`` (``[batch, context + 1]`` ids), in
  float32."""
  logits = model(batch[:, :-1]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

"""What the benchmark times: the trees, the optimizers and each implementation's step."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import optirs_jax
from optirs_jax import mixed_precision as mp
from optirs_jax.transforms import REGISTRY, Entry


def gpt2_small_shapes(d: int = 768, vocab: int = 50257, ctx: int = 1024, layers: int = 12):
  """The 148 parameter shapes of GPT-2 small (124M parameters at d=768)."""
  shapes = {"wte": (vocab, d), "wpe": (ctx, d)}
  for i in range(layers):
    p = f"h{i}."
    shapes |= {p + "ln_1.g": (d,), p + "ln_1.b": (d,), p + "attn.w": (d, 3 * d),
               p + "attn.b": (3 * d,), p + "proj.w": (d, d), p + "proj.b": (d,),
               p + "ln_2.g": (d,), p + "ln_2.b": (d,), p + "fc.w": (d, 4 * d),
               p + "fc.b": (4 * d,), p + "mlp_proj.w": (4 * d, d), p + "mlp_proj.b": (d,)}
  return shapes | {"ln_f.g": (d,), "ln_f.b": (d,)}


def leaves_tree(n: int, size: int = 16384) -> dict:
  return {f"l{i:04d}": (size,) for i in range(n)}


TREES = ("gpt2", "leaves", "leaves-1000", "leaves-4000", "flat", "leaves-flat")


def tree_shapes(name: str, scale: float) -> dict[str, tuple[int, ...]]:
  """Shapes of a benchmark tree; ``scale`` < 1 shrinks it (sizes, and the leaf count)."""
  if name == "gpt2":
    d = max(128, int(768 * scale**0.5) // 128 * 128) if scale < 1 else 768
    return gpt2_small_shapes(d=d)
  if name.startswith("leaves") and name != "leaves-flat":
    n = int(name.split("-")[1]) if "-" in name else 2000
    return leaves_tree(n if scale >= 1 else max(25, int(n * scale**0.5)))
  if name == "flat":
    return {"flat": (max(1 << 16, int((1 << 28) * scale)),)}
  if name == "leaves-flat":  # the leaves tree's parameters in one buffer (opt-in flat layout)
    return {"flat": (sum(s[0] for s in tree_shapes("leaves", scale).values()),)}
  raise ValueError(f"unknown tree {name!r}; valid trees are {TREES}")


def make_tree(shapes, seed: int, dtype=jnp.float32):
  key = jax.random.PRNGKey(seed)
  return {name: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.float32).astype(dtype)
          for i, (name, shape) in enumerate(shapes.items())}


def abstract_tree(tree: str, dtype=jnp.float32) -> dict[str, jax.ShapeDtypeStruct]:
  """The benchmark tree ``tree`` at full scale as shapes and a dtype, no data: what the
  compile-only scripts trace, lower and compile on.

  >>> abstract_tree("gpt2")["wte"]
  ShapeDtypeStruct(shape=(50257, 768), dtype=float32)
  """
  return {k: jax.ShapeDtypeStruct(s, dtype) for k, s in tree_shapes(tree, 1.0).items()}


LOSS_SCALE = 2.0**15  # the scaled cases' gradients: with_loss_scaling's initial scale


def param_count(shapes) -> int:
  """The number of parameters of a tree of shapes."""
  return sum(math.prod(s) for s in shapes.values())


def make_grads(shapes, opt: Opt):
  """The gradients of one case: ``make_tree(shapes, 1)`` in the case's dtype, times the loss
  scale 2**15 when the case's gradients are of a scaled loss."""
  grads = make_tree(shapes, 1, opt.dtype)
  if opt.scaled:
    grads = jax.tree.map(lambda g: g * jnp.asarray(LOSS_SCALE, g.dtype), grads)
  return grads


@dataclasses.dataclass(frozen=True)
class Opt:
  """One optimizer case.

  Attributes:
    bytes_per_param: the minimal traffic of one fused update + apply per parameter.
    optirs: ``(**executor kwargs) -> transformation``.
    optax: the optax transformation with the same numbers, or None.
    torch: ``(params, mode) -> torch optimizer``, or None.
    dtype: the params' and gradients' dtype.
    scaled: the gradients are of a scaled loss (a loss-scaling wrapper divides them).
  """

  bytes_per_param: int
  optirs: Callable
  optax: Callable | None
  torch: Callable | None = None
  dtype: object = jnp.float32
  scaled: bool = False


def _torch(cls_name, **kw):
  def make(params, mode):
    import torch
    cls = getattr(torch.optim, cls_name)
    return cls(params, **kw, **({"fused": True} if mode == "fused" else {"foreach": True}))
  return make


def _mixed(**o):
  """AdamW on bfloat16 params with float32 master weights and dynamic loss scaling."""
  return mp.with_loss_scaling(mp.master_weights(optirs_jax.adamw(1e-3, weight_decay=1e-2, **o)))


def _mixed_optax():
  """The same wrappers around optax's adamw: what optax does with them."""
  return mp.with_loss_scaling(mp.master_weights(optax.adamw(1e-3, weight_decay=1e-2)))


def _clipped(inner):
  """The usual LLM recipe: clip the gradients' global norm, then the optimizer."""
  return optax.chain(optax.clip_by_global_norm(1.0), inner)


# torch's optimizer of the same numbers, where it has one (the registry's default arguments
# but the learning rate, and what torch names otherwise).
TORCH = {"adam": _torch("Adam", lr=1e-3), "adamw": _torch("AdamW", lr=1e-3, weight_decay=1e-2),
         "sgd": _torch("SGD", lr=1e-3, momentum=0.9),
         "rmsprop": _torch("RMSprop", lr=1e-3, alpha=0.9),
         "rmsprop_centered": _torch("RMSprop", lr=1e-3, alpha=0.9, centered=True),
         "adagrad": _torch("Adagrad", lr=1e-3)}
# The registry's arguments for the benchmark's cases, where they differ from the defaults.
_BENCH_KW = {"adamw": {"weight_decay": 1e-2}, "sgd": {"momentum": 0.9},
             "noisy_sgd": {"key": 0}}  # (without a key both warn, as optax does)


def _entry_case(name: str, entry: Entry) -> Opt:
  kw = _BENCH_KW.get(name, {})
  lr = 1e-4 if name == "lion" else 1e-3
  return Opt(entry.bytes_per_param, lambda **o: entry.make(lr, **kw, **o),
             (lambda: entry.optax(lr, **kw)) if entry.optax else None, TORCH.get(name))


def _state_quantized(name: str, fmt: str, **kw) -> Callable:
  """The registry's optimizer ``name`` of the benchmark's arguments, its state in ``fmt``."""
  lr = 1e-4 if name == "lion" else 1e-3
  return lambda **o: REGISTRY[name].make(lr, **_BENCH_KW.get(name, {}), state_quantization=fmt,
                                         **kw, **o)


# Every optimizer of the registry, and the benchmark's composite cases.
OPTIMIZERS = {name: _entry_case(name, entry) for name, entry in REGISTRY.items()} | {
    "rmsprop_centered": Opt(28, lambda **o: optirs_jax.rmsprop(1e-3, centered=True, **o),
                            lambda: optax.rmsprop(1e-3, centered=True), TORCH["rmsprop_centered"]),
    # Read g (bf16) twice (finiteness, then the step), master, mu, nu (f32); write master,
    # mu, nu (f32) and p (bf16): 2 + 2 + 12 + 12 + 2 = 30 bytes per parameter.
    "adamw_bf16_master": Opt(30, _mixed, _mixed_optax, dtype=jnp.bfloat16, scaled=True),
    # optax.chain(clip_by_global_norm(1.0), adamw): the gradients read once more for their
    # global norm, 28 + 4 = 32 bytes per parameter.
    "adamw_clip": Opt(32, lambda **o: _clipped(optirs_jax.adamw(1e-3, weight_decay=1e-2, **o)),
                      lambda: _clipped(optax.adamw(1e-3, weight_decay=1e-2))),
    # optax.inject_hyperparams: the hyper-parameters are state, the same 28 bytes.
    "adamw_inject": Opt(28, lambda **o: optax.inject_hyperparams(optirs_jax.adamw)(
        learning_rate=1e-3, weight_decay=1e-2, **o),
                        lambda: optax.inject_hyperparams(optax.adamw)(
                            learning_rate=1e-3, weight_decay=1e-2)),
    # 8-bit moments: read p, g (f32) and both codes; write p and both codes (the per-block
    # scales add 16 bytes per 256 parameters): 4 + 4 + 1 + 1 + 4 + 1 + 1 = 16 bytes. No
    # optax equivalent: compare with the "adam" case of the same run.
    "adam8bit": Opt(16, lambda **o: optirs_jax.adam8bit(1e-3, **o), None),
    "adamw8bit": Opt(16, lambda **o: optirs_jax.adamw8bit(1e-3, **o), None),
    # The usual recipe on 8-bit AdamW: the links fold into its kernel, g read once more for
    # the global norm, 16 + 4 = 20 bytes per parameter.
    "adamw8bit_clip": Opt(20, lambda **o: _clipped(optirs_jax.adamw8bit(1e-3, **o)), None),
    # The same bytes with float8_e4m3fn codes (state_quantization="fp8").
    "adamw8bit_fp8": Opt(16, lambda **o: optirs_jax.adamw8bit(
        1e-3, state_quantization="fp8", **o), None),
    # Any optimizer's state in 8 bits (state_quantization): the fields decoded and encoded
    # inside the rule's kernel. Lion reads p, g (f32) and the momentum's codes, writes p and
    # the codes: 4 + 4 + 1 + 4 + 1 = 14 bytes (SGD with momentum too); AdamW 16.
    **{f"{name}_{fmt}": Opt(nbytes, _state_quantized(name, fmt), None)
       for name, nbytes in (("lion", 14), ("adamw", 16), ("sgd", 14))
       for fmt in ("dynamic8", "fp8")},
    # The same on XLA (backend="jnp"): the fields decoded, stepped and encoded by XLA's
    # fusions, for the contract path's choice between the two.
    **{f"{name}_{fmt}_xla": Opt(nbytes, _state_quantized(name, fmt, backend="jnp"), None)
       for name, nbytes in (("lion", 14), ("adamw", 16)) for fmt in ("dynamic8", "fp8")},
}

JAX_IMPLS = ("optirs-apply", "optirs-update", "optax", "optax-flatten")


def jax_step(impl: str, opt: Opt, options=None):
  """(transformation, step(params, state, grads) -> (params, state)) for one implementation
  (``options``: the optirs_jax executor options).

  The donated arguments come in the order of the outputs: JAX pairs each donated buffer
  with the first unclaimed output of its shape and dtype, so ``step(g, s, p) -> (p, s)``
  would pair the first moment with the new params and make XLA copy every state buffer.
  """
  if impl == "optirs-apply":
    tx = opt.optirs(executor_options=options)
    return tx, lambda p, s, g: optirs_jax.apply(tx, g, s, p)
  if impl.startswith("optax") and opt.optax is None:
    raise ValueError("optax has no equivalent of this case")
  tx = {"optirs-update": lambda: opt.optirs(executor_options=options), "optax": opt.optax,
        "optax-flatten": lambda: optax.flatten(opt.optax())}[impl]()

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return tx, step


def step_and_inputs(tree: str, name: str, impl: str):
  """(step, (params, state, grads)) of one bench case at full scale, on the device: what a
  first-call measurement compiles and runs (:func:`jax_step`'s donation order)."""
  opt = OPTIMIZERS[name]
  shapes = tree_shapes(tree, 1.0)
  grads = make_grads(shapes, opt)
  params = make_tree(shapes, 0, opt.dtype)
  tx, step = jax_step(impl, opt)
  state = tx.init(params)
  jax.block_until_ready((params, state, grads))
  return step, (params, state, grads)


def abstract_step_and_inputs(tree: str, name: str, impl: str):
  """:func:`step_and_inputs` as shapes and dtypes, no data (:func:`abstract_tree`; the
  gradients shaped and typed as the params): for tracing, lowering and compiling for a
  device this process need not have."""
  opt = OPTIMIZERS[name]
  params = abstract_tree(tree, opt.dtype)
  tx, step = jax_step(impl, opt)
  return step, (params, jax.eval_shape(tx.init, params), params)

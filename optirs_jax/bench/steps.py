"""The training benchmark's configurations: one GPT step each, as users write it.

Every configuration trains the same model (:mod:`optirs_jax.bench.gpt`, seed 0) on the same
batches with AdamW inside ``optax.chain(optax.clip_by_global_norm(1.0), ...)``, the same
hyper-parameters and schedule; they differ in the optimizer and in the path its step takes:

* ``optax``: ``optax.adamw`` through Flax's ``nnx.Optimizer`` (``update`` + ``apply_updates``).
* ``optirs-nnx``: ``optirs_jax.adamw`` through the stock ``nnx.Optimizer`` (the contract path).
* ``optirs-fused``: ``optirs_jax.adamw`` through ``optirs_jax.flax.Optimizer`` (the fused
  apply: the clip folded into the kernel).
* ``adamw8bit``: ``optirs_jax.adamw8bit`` through ``optirs_jax.flax.Optimizer``;
  ``adamw-fp8``: ``optirs_jax.adamw`` with ``state_quantization="fp8"``, likewise.
* ``lion``, ``lion-dynamic8``, ``lion-fp8``: ``optirs_jax.lion`` (float32 state, or 8-bit
  in either format) through ``optirs_jax.flax.Optimizer``, its learning rate 5x below
  AdamW's on the same schedule's shape and its decay 5x above (:data:`LION_SCALE`).
* ``optax-bf16-master`` and ``bf16-master``: bfloat16 params, float32 master weights and
  dynamic loss scaling (:mod:`optirs_jax.mixed_precision`) around ``optax.adamw`` (the
  contract path) and ``optirs_jax.adamw`` (the fused apply); ``bf16-master-8bit`` the same
  around ``optirs_jax.adamw(state_quantization="dynamic8")`` (the smallest state: 2 + 2 +
  4 + 2 bytes a parameter).
* ``muon``: ``optirs_jax.muon`` with bfloat16 Newton–Schulz for the blocks' matrices and
  AdamW for the embeddings, norms and biases (Muon's learning rate 0.02 on the same
  schedule's shape), through ``nnx.Optimizer``. (``optax.contrib.muon`` does not take a
  callable of an ``nnx.State`` with ``None`` entries: its labels fail on the Variables'
  ``.value`` nodes; ``benchmarks/muon_step.py`` compares the two on plain trees.)

A :class:`Run` holds a configuration's state and its jitted steps (state donated).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

import optirs_jax
import optirs_jax.flax as oflax
from optirs_jax import fusion
from optirs_jax import mixed_precision as mp
from optirs_jax.bench import gpt


@dataclasses.dataclass(frozen=True)
class Hyper:
  """AdamW's hyper-parameters and the schedule (linear warm-up, cosine decay to 10%)."""

  learning_rate: float = 6e-4
  warmup: int = 100
  total: int = 2000
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.1
  clip: float = 1.0

  def schedule(self) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, self.learning_rate, self.warmup,
                                              max(self.total, self.warmup + 1),
                                              end_value=0.1 * self.learning_rate)


def _adamw(module, h: Hyper):
  return optax.chain(optax.clip_by_global_norm(h.clip),
                     module.adamw(h.schedule(), b1=h.b1, b2=h.b2, weight_decay=h.weight_decay))


def _adamw8bit(h: Hyper):
  return optax.chain(optax.clip_by_global_norm(h.clip),
                     optirs_jax.adamw8bit(h.schedule(), b1=h.b1, b2=h.b2,
                                          weight_decay=h.weight_decay))


def _adamw_quantized(h: Hyper, state_quantization="fp8"):
  return optax.chain(optax.clip_by_global_norm(h.clip),
                     optirs_jax.adamw(h.schedule(), b1=h.b1, b2=h.b2, weight_decay=h.weight_decay,
                                      state_quantization=state_quantization))


# Lion's step is a sign (each element moves by the learning rate): the usual recipe takes a
# learning rate 3-10x below AdamW's and a decay as many times larger (Chen et al., 2023).
LION_SCALE = 5.0


def _lion(h: Hyper, state_quantization=None):
  schedule = h.schedule()
  return optax.chain(optax.clip_by_global_norm(h.clip), optirs_jax.lion(
      lambda count: schedule(count) / LION_SCALE, b1=0.9, b2=0.99,
      weight_decay=h.weight_decay * LION_SCALE, state_quantization=state_quantization))


def _mixed(module, h: Hyper):
  return _loss_scaled_master(_adamw(module, h))


def _loss_scaled_master(tx):
  return mp.with_loss_scaling(mp.master_weights(tx), mp.DynamicLossScale(2.0**15))


MUON_LEARNING_RATE = 0.02


def _hidden_matrices(params):
  """Muon's leaves: the blocks' 2-D weights (not the embeddings, whose rows are looked up)."""
  from optirs_jax.orthogonal import MuonDimensionNumbers

  def dims(path, x):
    name = jax.tree_util.keystr(path)
    hidden = x.ndim == 2 and "wte" not in name and "wpe" not in name
    return MuonDimensionNumbers() if hidden else None

  return jax.tree_util.tree_map_with_path(dims, params)


def _muon(make, h: Hyper, **kw):
  scale = MUON_LEARNING_RATE / h.learning_rate
  schedule = h.schedule()
  return optax.chain(optax.clip_by_global_norm(h.clip), make(
      lambda count: scale * schedule(count), weight_decay=h.weight_decay,
      adam_learning_rate=schedule, adam_b1=h.b1, adam_b2=h.b2,
      adam_weight_decay=h.weight_decay, muon_weight_dimension_numbers=_hidden_matrices, **kw))


@dataclasses.dataclass(frozen=True)
class Config:
  """How one configuration steps: through an ``nnx.Optimizer`` class, or functional with a
  loss scale (the mixed-precision ones)."""

  describe: str
  make_tx: Callable[[Hyper], optax.GradientTransformation]
  optimizer: type | None = None  # an nnx.Optimizer class; None: the functional loop
  param_dtype: str = "float32"


CONFIGS = {
    "optax": Config("optax.adamw, nnx.Optimizer", lambda h: _adamw(optax, h), nnx.Optimizer),
    "optirs-nnx": Config("optirs_jax.adamw, nnx.Optimizer (update + apply_updates)",
                         lambda h: _adamw(optirs_jax, h), nnx.Optimizer),
    "optirs-fused": Config("optirs_jax.adamw, optirs_jax.flax.Optimizer (fused apply)",
                           lambda h: _adamw(optirs_jax, h), oflax.Optimizer),
    "adamw8bit": Config("optirs_jax.adamw8bit, optirs_jax.flax.Optimizer", _adamw8bit,
                        oflax.Optimizer),
    "adamw-fp8": Config("optirs_jax.adamw(state_quantization='fp8'), optirs_jax.flax.Optimizer",
                        _adamw_quantized, oflax.Optimizer),
    "lion": Config("optirs_jax.lion, optirs_jax.flax.Optimizer", _lion, oflax.Optimizer),
    "lion-dynamic8": Config("optirs_jax.lion(state_quantization='dynamic8'), "
                            "optirs_jax.flax.Optimizer",
                            lambda h: _lion(h, "dynamic8"), oflax.Optimizer),
    "lion-fp8": Config("optirs_jax.lion(state_quantization='fp8'), optirs_jax.flax.Optimizer",
                       lambda h: _lion(h, "fp8"), oflax.Optimizer),
    "optax-bf16-master": Config("optax.adamw, bf16 params + f32 master + loss scaling",
                                lambda h: _mixed(optax, h), param_dtype="bfloat16"),
    "bf16-master": Config("optirs_jax.adamw, bf16 params + f32 master + loss scaling, fused",
                          lambda h: _mixed(optirs_jax, h), param_dtype="bfloat16"),
    "bf16-master-8bit": Config("optirs_jax.adamw(state_quantization='dynamic8'), bf16 params "
                               "+ f32 master + loss scaling, fused",
                               lambda h: _loss_scaled_master(_adamw_quantized(h, "dynamic8")),
                               param_dtype="bfloat16"),
    "muon": Config("optirs_jax.muon (bf16 Newton-Schulz), nnx.Optimizer",
                   lambda h: _muon(optirs_jax.muon, h, ns_dtype="bfloat16"), nnx.Optimizer),
}


def check_configs(names) -> list[str]:
  unknown = [n for n in names if n not in CONFIGS]
  if unknown:
    raise ValueError(f"unknown configuration {unknown[0]!r}; valid: {list(CONFIGS)}")
  return list(names)


def hlo_kernels(text: str) -> dict:
  """``{"fusions", "custom_calls"}`` of a compiled program's entry computation."""
  entry = text[text.index("ENTRY"):]
  return {"fusions": len(re.findall(r"= \S+ fusion\(", entry)),
          "custom_calls": len(re.findall(r"custom-call\(", entry))}


class Run:
  """A configuration's model and optimizer state, and its jitted steps.

  ``step(batch) -> loss`` trains one step; ``held_out(batch) -> loss`` evaluates;
  ``optimizer_only(grads)`` runs the optimizer's update alone (its share of the step);
  ``path`` says which step the optimizer took (:func:`optirs_jax.fusion.explain`).
  """

  def __init__(self, name: str, model_config: gpt.GPTConfig, hyper: Hyper, seed: int = 0):
    self.name, self.config = name, CONFIGS[name]
    model_config = dataclasses.replace(model_config, param_dtype=self.config.param_dtype)
    self.parameters = model_config.parameters()
    model = gpt.GPT(model_config, nnx.Rngs(seed))
    tx = self.config.make_tx(hyper)
    self.path = (fusion.explain(tx) if self.config.optimizer is not nnx.Optimizer
                 else "update + apply_updates (nnx.Optimizer)")
    if self.config.optimizer is not None:
      self._init_nnx(model, tx)
    else:
      self._init_functional(model, tx)

  # Flax NNX: the model and the optimizer split into one state, merged inside the step.
  def _init_nnx(self, model, tx):
    optimizer = self.config.optimizer(model, tx, wrt=nnx.Param)
    graphdef, self.state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
      model, optimizer = nnx.merge(graphdef, state)
      value, grads = nnx.value_and_grad(gpt.loss)(model, batch)
      optimizer.update(model, grads)
      return nnx.state((model, optimizer)), value

    @functools.partial(jax.jit, donate_argnums=0)
    def opt_step(state, grads):
      model, optimizer = nnx.merge(graphdef, state)
      optimizer.update(model, grads)
      return nnx.state((model, optimizer))

    @jax.jit
    def grads_of(state, batch):
      model, _ = nnx.merge(graphdef, state)
      return nnx.grad(gpt.loss)(model, batch)

    @jax.jit
    def held_out(state, batch):
      model, _ = nnx.merge(graphdef, state)
      return gpt.loss(model, batch)

    self._step, self._opt_step, self._grads, self._held_out = step, opt_step, grads_of, held_out

  # The functional loop of the mixed-precision README example: the loss scale is state.
  def _init_functional(self, model, tx):
    graphdef, params = nnx.split(model)
    loss_of = lambda p, batch: gpt.loss(nnx.merge(graphdef, p), batch)
    self.state = (params, tx.init(params))

    def update(params, opt_state, grads):
      return optirs_jax.apply(tx, grads, opt_state, params)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
      params, opt_state = state
      scale = mp.loss_scale_of(opt_state)
      value, grads = jax.value_and_grad(lambda p: scale.scale(loss_of(p, batch)))(params)
      return update(params, opt_state, grads), scale.unscale(value)

    @functools.partial(jax.jit, donate_argnums=0)
    def opt_step(state, grads):
      return update(*state, grads)

    @jax.jit
    def grads_of(state, batch):
      scale = mp.loss_scale_of(state[1])
      return jax.grad(lambda p: scale.scale(loss_of(p, batch)))(state[0])

    self._step, self._opt_step, self._grads = step, opt_step, grads_of
    self._held_out = jax.jit(lambda state, batch: loss_of(state[0], batch))

  def step(self, batch: jax.Array) -> jax.Array:
    self.state, value = self._step(self.state, batch)
    return value

  def held_out(self, batch: jax.Array) -> jax.Array:
    return self._held_out(self.state, batch)

  def grads(self, batch: jax.Array) -> Any:
    return self._grads(self.state, batch)

  def optimizer_only(self, grads) -> None:
    self.state = self._opt_step(self.state, grads)

  def kernels(self, batch: jax.Array) -> dict:
    """Fusions and custom calls (the Pallas kernels) of the compiled whole step, of the
    gradients alone and of the optimizer alone: what XLA fuses into or adds around the
    optimizer inside the step (``step - gradients`` against ``optimizer``)."""
    grads = jax.eval_shape(self._grads, self.state, batch)
    out = {}
    for what, fn, args in (("step", self._step, (self.state, batch)),
                           ("gradients", self._grads, (self.state, batch)),
                           ("optimizer", self._opt_step, (self.state, grads))):
      out[what] = hlo_kernels(fn.lower(*args).compile().as_text())
    return out

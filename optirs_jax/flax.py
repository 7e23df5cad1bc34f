"""Flax's training-loop classes on the fused step: switching is one import.

:class:`Optimizer` is Flax NNX's ``nnx.Optimizer`` and :class:`TrainState` Flax linen's
``flax.training.train_state.TrainState``, with the same constructors, fields and state
layout; only their update runs :func:`optirs_jax.apply` (the optimizer's kernel writes the
new params and state in one pass, and the links of an ``optax.chain`` fold into it:
:mod:`optirs_jax.fusion`) where the stock classes run ``tx.update`` and then
``optax.apply_updates``. The numbers are those of the stock classes. Flax is an optional
dependency: this module imports it, ``import optirs_jax`` does not.

>>> import jax, jax.numpy as jnp, optax, optirs_jax
>>> from flax import nnx
>>> import optirs_jax.flax
>>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
>>> optimizer = optirs_jax.flax.Optimizer(model, optirs_jax.adamw(1e-2), wrt=nnx.Param)
>>> grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((3, 4)))))(model)
>>> _ = optimizer.update(model, grads)
>>> int(optimizer.step[...])
1
"""

from __future__ import annotations

import inspect

import jax
from flax import nnx
from flax.training import train_state

from optirs_jax.apply import apply

_OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"  # flax linen's collection name


def _state(node, wrt, graph):
  """``nnx.state(node, wrt)`` as pure arrays (``graph`` where this Flax takes it)."""
  if graph is not None and "graph" in inspect.signature(nnx.state).parameters:
    return nnx.as_pure(nnx.state(node, wrt, graph=graph))
  return nnx.as_pure(nnx.state(node, wrt))


class Optimizer(nnx.Optimizer):
  """``nnx.Optimizer`` whose :meth:`update` is one fused step.

  Construct it as ``nnx.Optimizer(model, tx, wrt=nnx.Param)``; ``opt_state`` and ``step``
  are the stock class's. Where ``tx`` has no fused step (:func:`optirs_jax.fusion.explain`)
  the update is the stock one, with the same numbers either way.
  """

  def update(self, model, grads, /, **kwargs):
    """Updates the model's ``wrt`` variables and ``opt_state`` with ``grads`` (as
    ``nnx.Optimizer.update``), in one kernel pass.

    Returns:
      The updates applied, as the new params minus the old (inside ``nnx.jit`` XLA drops
      the subtraction when the result is unused).
    """
    if kwargs:  # extra arguments for the transformation: the stock path passes them on
      return super().update(model, grads, **kwargs)
    graph = getattr(self, "graph", None)
    params = _state(model, self.wrt, graph)
    new_params, new_opt_state = apply(self.tx, _state(grads, self.wrt, graph),
                                      nnx.as_pure(self.opt_state), params)
    nnx.update(model, new_params)
    if graph is not None and "graph" in inspect.signature(nnx.state).parameters:
      nnx.update(self.opt_state, nnx.state(new_opt_state, graph=graph))
    else:
      nnx.update(self.opt_state, nnx.state(new_opt_state))
    self.step[...] += 1
    return jax.tree.map(lambda new, old: new - old, new_params, params)


class TrainState(train_state.TrainState):
  """Flax linen's ``TrainState`` whose :meth:`apply_gradients` is one fused step.

  ``TrainState.create(apply_fn=..., params=..., tx=...)`` as the stock class; its fields
  and ``opt_state`` are the stock class's, so a checkpoint of one restores into the other.

  >>> import jax.numpy as jnp, optirs_jax
  >>> from optirs_jax.flax import TrainState
  >>> state = TrainState.create(apply_fn=None, params={"w": jnp.ones(3)},
  ...                           tx=optirs_jax.adamw(1e-2))
  >>> state = state.apply_gradients(grads={"w": jnp.full(3, 0.5)})
  >>> int(state.step), state.params["w"][0]
  (1, Array(0.98999906, dtype=float32))
  """

  def apply_gradients(self, *, grads, **kwargs):
    """Updates ``step``, ``params`` and ``opt_state`` with ``grads`` (and replaces the
    fields in ``kwargs``), as the stock class does; params and state in one kernel pass."""
    overwrite = _OVERWRITE_WITH_GRADIENT in grads
    grads_with_opt = grads["params"] if overwrite else grads
    params_with_opt = self.params["params"] if overwrite else self.params
    new_params_with_opt, new_opt_state = apply(self.tx, grads_with_opt, self.opt_state,
                                               params_with_opt)
    if overwrite:  # as the stock class: that collection takes the gradients themselves
      new_params = {"params": new_params_with_opt,
                    _OVERWRITE_WITH_GRADIENT: grads[_OVERWRITE_WITH_GRADIENT]}
    else:
      new_params = new_params_with_opt
    return self.replace(step=self.step + 1, params=new_params, opt_state=new_opt_state,
                        **kwargs)


__all__ = ["Optimizer", "TrainState"]

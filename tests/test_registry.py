"""The registry of optimizers and the spec wiring checked when an optimizer is built."""

import dataclasses

import jax
import optax
import pytest

import optirs_jax
from optirs_jax import rules
from optirs_jax.spec import Field
from optirs_jax.transforms import REGISTRY, build
from optirs_jax.transforms.adam import ADAMW, adam_rule
from optirs_jax.transforms.lion import LION


def test_every_optimizer_module_is_in_the_registry_and_the_face():
  import pkgutil

  import optirs_jax.transforms as t
  modules = [m.name for m in pkgutil.iter_modules(t.__path__) if not m.name.startswith("_")]
  owners = {e.make.__module__.rsplit(".", 1)[-1] for e in REGISTRY.values()}
  assert set(modules) == owners
  for name, entry in REGISTRY.items():
    assert getattr(optirs_jax, name) is entry.make and name in optirs_jax.__all__
    assert getattr(optirs_jax, entry.spec.state.__name__) is entry.spec.state
    assert entry.spec.name == name
    if entry.optax is not None:
      assert entry.optax is getattr(optax, name)  # the namesake
    for kw in (*entry.cases, entry.typical):  # every case builds
      entry.make(1e-3, **kw)
  assert tuple(REGISTRY) == optirs_jax.OPTIMIZERS


def _args(spec, **kw):
  defaults = dict(learning_rate=1e-3, b1=0.9, b2=0.99, eps=1e-8, eps_root=0.0, mu_dtype=None,
                  nu_dtype=None, weight_decay=1e-4, mask=None, nesterov=False,
                  stochastic_rounding=False, rounding_seed=0, backend="jnp",
                  executor_options=None)
  return {name: defaults[name] for name, _ in spec.arguments} | {
      "backend": "jnp", "executor_options": None} | kw


@pytest.mark.parametrize("change, match", [
    (dict(hyper=tuple(n for n in ADAMW.hyper if n != "bc2")),
     r"the rule adam_rule reads h\.bc2, which is not in spec 'broken'"),
    (dict(hyper=(*ADAMW.hyper, "typo")), r"lists \['typo'\] in hyper, but its scalars\(\)"),
    (dict(fields=(*ADAMW.fields, Field("extra"))),
     r"the rule adam_rule has no keyword 'extra' \(a state field"),
    (dict(static=lambda o: dict(nesterov=False, scale=True, mu_dtype=None, flavour=1)),
     r"has no keyword 'flavour' \(a static option"),
    (dict(rule=lambda h, g, *, p, mu, nu, nesterov, decay, scale, cast_lr, mu_dtype=None:
          adam_rule(h, g, p=p, mu=mu, nu=nu, nesterov=nesterov, decay=decay, scale=scale,
                    cast_lr=cast_lr)[:2]),
     r"returns 2 arrays; spec 'broken' wants the update and its fields \['mu', 'nu'\]: 3"),
])
def test_a_miswired_spec_fails_when_built_naming_the_mismatch(change, match):
  spec = dataclasses.replace(ADAMW, name="broken", **change)
  with pytest.raises(ValueError, match=match):
    build(spec, _args(spec))


def test_a_rule_that_needs_a_keyword_the_spec_never_gives():
  def rule(h, g, *, p, mu, decay, cast_lr, mu_dtype=None, temperature):
    del temperature
    return (rules.scale_lr(h, g, cast_lr), mu)
  spec = dataclasses.replace(LION, name="broken", rule=rule)
  with pytest.raises(ValueError, match=r"needs 'temperature', which spec 'broken'"):
    build(spec, _args(spec))


def test_the_wiring_check_traces_no_computation():
  """Built inside jit with traced hyper-parameters (inject_hyperparams), still fine."""
  tx = optax.inject_hyperparams(optirs_jax.adamw)(learning_rate=1e-3, b1=0.8)
  params = {"w": jax.numpy.ones(3)}
  jax.jit(tx.update)(params, jax.jit(tx.init)(params), params)

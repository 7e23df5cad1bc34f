"""The Triton dialect's Python module under the name jaxlib's MLIR bindings look for: the
lowering makes no failed imports, and the Triton IR is the same as without it."""

import json
import os
import subprocess
import sys

import pytest

from optirs_jax.pallas import dialect_lookup

pytest.importorskip("jaxlib.triton.dialect", reason="this jaxlib has no Triton bindings")

# Exports a fused Adam step for an abstract H200 (the grouped Triton launches) and prints
# the serialized module's digest and how many searches for a ".tt" module it made. argv[1]:
# "off" takes the entry out before anything is lowered (jaxlib remembers a dialect module
# once it has found one, so this needs a fresh process).
_EXPORT = r"""
import hashlib, json, sys
import jax
import optirs_jax
from optirs_jax.pallas import dialect_lookup
from tests import cases
from tests.test_lowering import TRITON, abstract_target

if sys.argv[1] == "off":
  sys.modules.pop(dialect_lookup.SEARCHED_NAME)
searched = []

class Searches:
  def find_spec(self, name, path=None, target=None):
    searched.append(name)

sys.meta_path.insert(0, Searches())
jax.config.update("jax_numpy_dtype_promotion", "standard")
tx = optirs_jax.adam(1e-3)
shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), cases.ragged_tree(0))
state = jax.eval_shape(tx.init, shapes)
with abstract_target("NVIDIA H200", "cuda"):
  exp = jax.export.export(
      jax.jit(lambda p, s, g: optirs_jax.apply(tx, g, s, p)), platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(
          shapes, state, shapes)
print(json.dumps({"digest": hashlib.sha256(exp.mlir_module_serialized).hexdigest(),
                  "triton": exp.mlir_module().count(TRITON),
                  "searches": len([n for n in searched if n.endswith(".tt")])}))
"""


def _export(mode: str) -> dict:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
  proc = subprocess.run([sys.executable, "-c", _EXPORT, mode], capture_output=True, text=True,
                        env=env, cwd=root, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_module_is_registered_once_under_the_searched_name():
  from jaxlib.triton import dialect
  assert sys.modules[dialect_lookup.SEARCHED_NAME] is dialect
  assert dialect_lookup.register() is False  # the name is taken now: nothing to do


def test_lowering_to_triton_searches_no_dialect_module_and_emits_the_same_ir():
  with_entry, without = _export("on"), _export("off")
  assert with_entry["triton"] >= 1
  assert with_entry["searches"] == 0
  assert without["searches"] > 100  # every wrapped Triton op searched every prefix again
  assert with_entry["digest"] == without["digest"]

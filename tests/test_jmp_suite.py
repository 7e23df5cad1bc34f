"""jmp's own test files, run against :mod:`optirs_jax.mixed_precision` in place of jmp.

jmp (a test extra) ships ``loss_scale_test.py`` and ``policy_test.py`` in its wheel. Each is
read from the installed package, its one line importing jmp's module is pointed at ours,
and its ``TestCase`` classes are collected here: jmp's expectations, unchanged, are what
this module must meet to be a drop-in for jmp.
"""

import importlib.util
import pathlib
import unittest

import jax
import pytest

pytest.importorskip("jmp", reason="jmp is a test extra (its test files are the reference)")
pytest.importorskip("absl.testing.parameterized", reason="jmp's tests use absl")

# jmp's loss-scale test computes ``np.float32(10) / 3**100`` itself (numpy warns that the
# integer overflows float32 on the way); the warning is the test's, not the code's.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")


@pytest.fixture(autouse=True)
def _jax_defaults():
  """jmp's tests are written for JAX's default (standard) dtype promotion, where this
  suite's conftest makes it strict."""
  with jax.numpy_dtype_promotion("standard"):
    yield


def _jmp_test_module(name: str, ours: str) -> dict:
  """jmp's ``_src/<name>_test.py`` with ``from jmp._src import <name> as jmp`` replaced by
  ``import <ours> as jmp``, executed; returns its namespace."""
  spec = importlib.util.find_spec(f"jmp._src.{name}_test")
  if spec is None or spec.origin is None:
    pytest.skip(f"this jmp wheel has no _src/{name}_test.py", allow_module_level=True)
  source = pathlib.Path(spec.origin).read_text()
  line = f"from jmp._src import {name} as jmp"
  assert source.count(line) == 1, f"jmp's {name}_test.py no longer imports {line!r}"
  namespace = {"__name__": f"jmp_{name}_test_against_optirs_jax"}
  exec(compile(source.replace(line, f"import {ours} as jmp"), spec.origin, "exec"), namespace)
  return namespace


_LOSS_SCALE = _jmp_test_module("loss_scale", "optirs_jax.mixed_precision")
_POLICY = _jmp_test_module("policy", "optirs_jax.mixed_precision")

TestJmpLossScale = _LOSS_SCALE["LossScaleTest"]
TestJmpPolicy = _POLICY["PolicyTest"]


def test_the_jmp_suites_hold_tests():
  """The classes collected above are jmp's and hold its tests (not an empty shell)."""
  for cls, least in ((TestJmpLossScale, 15), (TestJmpPolicy, 40)):
    assert issubclass(cls, unittest.TestCase)
    count = unittest.defaultTestLoader.loadTestsFromTestCase(cls).countTestCases()
    assert count >= least, (cls.__name__, count)

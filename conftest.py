"""Docstring examples (collected from optirs_jax/) show what a user sees: JAX's default
(standard) dtype promotion, where the tests (tests/conftest.py) make it strict."""

import importlib.util
import os

# With libtpu installed (.ci/run installs it, and jax's CUDA plugin, for the compile-only TPU
# and CUDA tests) every jax start looks for a TPU and a GPU; the tests run on the CPU and
# reach those compilers through topologies. Set before jax is first imported (here): jax
# reads JAX_PLATFORMS once, and the CUDA plugin registers its compile-only topologies only
# where CUDA was not asked for.
if importlib.util.find_spec("libtpu") is not None:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import pytest
from _pytest.doctest import DoctestItem


@pytest.fixture(autouse=True)
def _doctests_run_with_jax_defaults(request):
  if isinstance(request.node, DoctestItem):
    with jax.numpy_dtype_promotion("standard"):
      yield
  else:
    yield

"""Docstring examples (collected from optirs_jax/) show what a user sees: JAX's default
(standard) dtype promotion, where the tests (tests/conftest.py) make it strict."""

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

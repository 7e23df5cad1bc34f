"""A faster lowering to Triton: the Triton dialect's Python module under the name MLIR seeks.

jaxlib's MLIR bindings, wrapping an operation of a dialect, first import the dialect's Python
module by its namespace under each search prefix (``jaxlib.mlir.dialects.tt``, then
``jaxlib.mosaic.python.tt``, ...). The Triton dialect's module is ``jaxlib.triton.dialect``,
under none of them, and a failed search is not remembered: lowering GPT-2's grouped
launches to Triton IR made about 16,600 failed imports, half of the lowering's time (CPU,
jax 0.10.2 and 0.11.2: 1.1-1.3 s without, 0.5-0.6 s with). :func:`register` enters the
module under the first name searched, once, where nothing else answers to it; the lookup
then finds the op classes it found before, and the IR is the same.
"""

from __future__ import annotations

import importlib.util
import sys

SEARCHED_NAME = "jaxlib.mlir.dialects.tt"


def register() -> bool:
  """Makes ``jaxlib.mlir.dialects.tt`` the Triton dialect's module, unless that name is
  taken or importable, or this jaxlib has no Triton bindings. Returns whether it did."""
  if SEARCHED_NAME in sys.modules:
    return False
  try:
    if importlib.util.find_spec(SEARCHED_NAME) is not None:
      return False
    from jaxlib.triton import dialect
  except ImportError:
    return False
  sys.modules[SEARCHED_NAME] = dialect
  return True

"""One registry of the optimizers: what every per-optimizer test, the README's list and the
benchmark read, so that adding an optimizer is one file.

Each module of ``optirs_jax/transforms/`` (but the private ones) declares its optimizers as
``ENTRIES``, a tuple of :class:`Entry`; :func:`discover` collects them, and the package's
face exports each entry's public function under its name.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any

from optirs_jax.spec import OptimizerSpec


@dataclasses.dataclass(frozen=True)
class Entry:
  """One optimizer of the catalogue.

  Attributes:
    name: its public name (``optirs_jax.<name>``).
    make: the public function.
    spec: its :class:`~optirs_jax.spec.OptimizerSpec`.
    optax: optax's function of the same numbers and arguments (None: optax has none).
    cases: keyword arguments (besides the learning rate) that together cover every option:
      the parity tests run each against ``optax``.
    typical: the one case that exercises every state field, for suites that run one case
      per optimizer (multi-device, GPU, dtypes).
    alias: optax's own alias-test arguments for it (``optax/_src/alias_test.py``).
    moments: ``(field, index, optax field)`` per state field under ``typical``: where optax
      keeps the same moment (``state[index].<optax field>`` of its chain's state).
    complex: takes complex params (as in optax).
    bytes_per_param: the minimal traffic of one fused update and apply per float32
      parameter (the benchmark's % of copy bandwidth).
  """

  name: str
  make: Callable
  spec: OptimizerSpec
  optax: Callable | None
  cases: tuple[Mapping[str, Any], ...] = ({},)
  typical: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  alias: tuple[Mapping[str, Any], ...] = ()
  moments: tuple[tuple[str, int, str], ...] = ()
  complex: bool = True
  bytes_per_param: int = 20

  @property
  def norms(self) -> bool:
    """Whether the optimizer takes per-leaf norms (a second pass, as LAMB)."""
    return self.spec.reduction is not None


def discover(package: str, path) -> dict[str, Entry]:
  """Every ``ENTRIES`` of the public modules of ``package`` (at ``path``), by name."""
  entries: dict[str, Entry] = {}
  for info in sorted(pkgutil.iter_modules(path), key=lambda i: i.name):
    if info.name.startswith("_"):
      continue
    module = importlib.import_module(f"{package}.{info.name}")
    for entry in getattr(module, "ENTRIES", ()):
      if entry.name in entries:
        raise ValueError(f"two optimizers are named {entry.name!r} ({module.__name__} and "
                         "another module of the registry)")
      entries[entry.name] = entry
  return dict(sorted(entries.items()))

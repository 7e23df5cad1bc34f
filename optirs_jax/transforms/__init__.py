"""The optimizers: one spec, one public function and one registry entry each, built by one
builder.

:data:`REGISTRY` holds every optimizer of the modules here (each module's ``ENTRIES``,
found when the package is imported), so adding an optimizer is adding its module:
``optirs_jax/transforms/<name>.py`` with its state, rule, spec, public function and entry
(``docs/ARCHITECTURE.md`` shows one).

>>> from optirs_jax.transforms import REGISTRY
>>> "adamw" in REGISTRY, REGISTRY["adam"].bytes_per_param
(True, 28)
"""

from optirs_jax.transforms._builder import build
from optirs_jax.transforms._registry import Entry, discover

REGISTRY: dict[str, Entry] = discover(__name__, __path__)

__all__ = ["REGISTRY", "Entry", "build"]

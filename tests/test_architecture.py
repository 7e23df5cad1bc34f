"""The package's layers import only downward, and its modules stay small.

face (``optirs_jax/*.py``, the feature modules) -> transforms -> spec, rules, state formats
(``optirs_jax/formats``) and the backend names -> executors (``optirs_jax/pallas``) ->
planning (``optirs_jax/planning``).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent / "optirs_jax"
MAX_LINES = 450


def layer(module: str) -> int:
  """0 planning, 1 executors, 2 spec/rules/backends/formats, 3 transforms, 4 the face."""
  parts = module.split(".")
  if len(parts) > 1 and parts[1] == "planning":
    return 0
  if len(parts) > 1 and parts[1] == "pallas":
    return 1
  if len(parts) > 1 and parts[1] in ("spec", "rules", "rounding", "dtypes", "backends", "formats"):
    return 2
  if len(parts) > 1 and parts[1] == "transforms":
    return 3
  return 4


def modules():
  for path in sorted(ROOT.rglob("*.py")):
    rel = path.relative_to(ROOT.parent).with_suffix("")
    yield ".".join(p for p in rel.parts if p != "__init__"), path


def is_module(name: str) -> bool:
  rel = pathlib.Path(*name.split(".")[1:])
  return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def imports(path: pathlib.Path):
  """The modules a file imports (``from package import module`` names the module)."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        full = f"{node.module}.{a.name}"
        yield full if node.module.startswith("optirs_jax") and is_module(full) else node.module


@pytest.mark.parametrize("module, path", list(modules()), ids=lambda x: str(x))
def test_imports_go_only_downward(module, path):
  upward = [name for name in imports(path)
            if name.startswith("optirs_jax.") and layer(name) > layer(module)]
  assert not upward, f"{module} (layer {layer(module)}) imports from above: {upward}"


@pytest.mark.parametrize("module, path", list(modules()), ids=lambda x: str(x))
def test_modules_are_small(module, path):
  lines = len(path.read_text().splitlines())
  assert lines <= MAX_LINES, f"{module} has {lines} lines (at most {MAX_LINES})"


def test_the_layers_are_what_the_docstring_says():
  assert [layer(m) for m in ("optirs_jax.planning.layout", "optirs_jax.pallas.grouped",
                             "optirs_jax.spec", "optirs_jax.transforms.adam",
                             "optirs_jax.apply", "optirs_jax")] == [0, 1, 2, 3, 4, 4]

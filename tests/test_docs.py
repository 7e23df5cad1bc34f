"""The README's code runs as written, and the notebooks execute without an error.

The README's Python blocks run in order in one fresh process (a block may use what an
earlier one defined, as a reader would); each notebook runs in a kernel of its own, as
``notebooks/`` is committed (with its outputs).
"""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_readme_code_blocks_run(tmp_path):
  blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
  assert len(blocks) >= 5
  script = tmp_path / "readme.py"
  script.write_text("\n\n".join(blocks))
  proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, monkeypatch):
  nbformat = pytest.importorskip("nbformat", reason="the notebooks extra is not installed")
  nbclient = pytest.importorskip("nbclient", reason="the notebooks extra is not installed")
  if path.name == "multi_device.ipynb":  # its eight CPU devices, on a GPU machine too
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  nb = nbformat.read(path, as_version=4)
  client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                   resources={"metadata": {"path": str(path.parent)}})
  client.execute()  # raises CellExecutionError on a failing cell
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.get("output_type") == "error"]
  assert not errors


def test_every_notebook_is_committed_with_its_outputs():
  nbformat = pytest.importorskip("nbformat", reason="the notebooks extra is not installed")
  assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "performance", "planning",
                                         "mixed_precision", "multi_device", "quantization",
                                         "sparse"}
  for path in NOTEBOOKS:
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count for c in code), f"{path.name} is not executed"
    assert any("image/png" in o.get("data", {}) for c in code for o in c.outputs), (
        f"{path.name} has no plot")
    # What a reader sees is the notebook's own output: no runtime's start-up noise (an
    # environment with libtpu writes TPU initialization errors to stderr on a CPU machine).
    stderr = "".join(o.get("text", "") for c in code for o in c.outputs
                     if o.get("name") == "stderr")
    for noise in ("libtpu", "E0000", "Traceback"):
      assert noise not in stderr, f"{path.name}'s committed output holds {noise!r}"


def test_the_readme_lists_every_optimizer_of_the_registry():
  from optirs_jax.transforms import REGISTRY
  text = (ROOT / "README.md").read_text()
  intro = text[:text.index("## Setup")]
  listed = set(re.findall(r"`([a-z0-9_]+)`", intro[intro.index("optimizers, with optax"):]))
  missing = sorted(set(REGISTRY) - listed)
  assert not missing, f"the README's introduction does not list {missing}"

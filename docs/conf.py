"""Sphinx configuration: the API reference from the docstrings, the notebooks as committed.

Build with ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (the ``docs``
extra); CI builds it with warnings as errors. The notebooks are rendered with their
committed outputs, not re-executed (``tests/test_docs.py`` executes them).
"""

import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parent.parent

project = "optirs_jax"
author = "the optirs_jax authors"
copyright = "2026, the optirs_jax authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_nb",
]
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Docstrings: Google style (Args/Returns/Example), math in reST.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # Attributes: sections as fields (autodoc lists dataclass fields too)
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures show the defaults; types are in the Args
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}

# Notebooks: as committed, with their outputs; never executed here.
nb_execution_mode = "off"
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3
suppress_warnings = ["myst.header", "myst.xref_missing"]

html_theme = "alabaster"
html_title = "optirs_jax"

# The notebooks live in notebooks/ at the repository's root; Sphinx reads sources under
# docs/ only, so they are copied in (docs/notebooks/ is ignored by git).
_NOTEBOOKS = pathlib.Path(__file__).resolve().parent / "notebooks"
shutil.rmtree(_NOTEBOOKS, ignore_errors=True)
_NOTEBOOKS.mkdir()
for _nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
  shutil.copy(_nb, _NOTEBOOKS / _nb.name)

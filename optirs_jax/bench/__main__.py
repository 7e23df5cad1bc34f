"""``python -m optirs_jax.bench``: see :mod:`optirs_jax.bench`."""

import sys

from optirs_jax.bench.cli import main

sys.exit(main())

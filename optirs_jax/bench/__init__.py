"""Benchmark: optirs_jax against optax (and torch's fused optimizers) on the local device.

    python -m optirs_jax.bench [--trees gpt2,leaves,flat] [--optimizers adam,lamb,...]
                               [--impls ...] [--scale S] [--json out.json]

Times one jitted step (params and state donated, in the order of the outputs) of each
implementation on each tree -- GPT-2 small (148 leaves, 124M), many small leaves (2000 x
16K, also 1000 and 4000), one flat leaf (268M) and ``leaves-flat`` (the 2000 leaves'
parameters as one buffer) -- and, in the same run, the device's copy bandwidth.
Implementations: ``optirs-apply`` (the fused apply, :func:`optirs_jax.apply`),
``optirs-update`` (``update`` then ``optax.apply_updates``), ``optax``, ``optax-flatten``,
and ``torch-fused`` / ``torch-foreach`` where torch sees a GPU.

Per case it reports the kernel time per step (from a profiler trace: what the device
spends; :mod:`optirs_jax.bench.timing`), its % of the copy bandwidth at the optimizer's
minimal bytes (Adam 28 B/param: read p, g, m, v; write p, m, v) and its ratio to optax;
the per-call wall time of the ``jax.jit`` function and the host's share of it; the first
call's time (trace + compile + run); the step's memory. On CPU the trees are scaled down
(``--scale``) and there is no kernel time.
"""

from optirs_jax.bench.cases import (
                                    JAX_IMPLS,
                                    OPTIMIZERS,
                                    TREES,
                                    Opt,
                                    gpt2_small_shapes,
                                    jax_step,
                                    make_tree,
                                    tree_shapes,
)
from optirs_jax.bench.cli import main, run, table

__all__ = ["JAX_IMPLS", "OPTIMIZERS", "TREES", "Opt", "gpt2_small_shapes", "jax_step", "main",
           "make_tree", "run", "table", "tree_shapes"]

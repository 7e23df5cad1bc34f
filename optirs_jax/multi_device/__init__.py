"""Multi-device training: gradient sync and compression with JAX's collectives.

The optimizers themselves are sharding-correct without help: under ``jax.jit`` with
params, gradients and state sharded by ``NamedSharding`` (data parallel, FSDP, tensor
parallel; Auto or Explicit mesh axes) each device updates its own shard with the kernel
(``custom_partitioning`` or ``shard_map`` inside the executor), outputs keep the inputs'
shardings, and only LAMB's per-leaf norms cross devices (one ``psum`` of partial sums of
squares per leaf). Inside a user's ``shard_map`` every backend runs on the local shards;
LAMB's norms are then per local array unless ``lamb(..., axis_name=...)`` names the mesh
axes the leaves are sharded over.

This module adds what data parallelism needs on top:

* :func:`sync_gradients` / :func:`sync_gradients_transform`: the all-reduce of gradients;
* :func:`top_k_compression` (Deep Gradient Compression) and :func:`powersgd`: compressed
  exchanges with error feedback, and :func:`compression_stats` of what they sent.

Several hosts: call ``jax.distributed.initialize()`` first on every host; meshes then span
all hosts' devices (``jax.make_mesh`` over ``jax.devices()``) and the same code runs, the
collectives crossing hosts over the interconnect. Nothing here does its own transport.
"""

from optirs_jax.multi_device._compression import (
                                                  PowerSGDState,
                                                  TopKState,
                                                  compression_stats,
                                                  powersgd,
                                                  state_partition_specs,
                                                  top_k_compression,
)
from optirs_jax.multi_device._sync import sync_gradients, sync_gradients_transform

__all__ = ["PowerSGDState", "TopKState", "compression_stats", "powersgd",
           "state_partition_specs", "sync_gradients", "sync_gradients_transform",
           "top_k_compression"]

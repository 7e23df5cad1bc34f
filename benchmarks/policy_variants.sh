#!/usr/bin/env bash
# The many-leaf step under each small-leaf policy of the kernel backend, and under XLA's
# command buffers (CUDA graphs) on and off, on the GPU machine. One JSON per variant in $OUT.
#   bash benchmarks/policy_variants.sh
# Each variant times optirs-apply, optirs-update and optax on GPT-2 small and 2000 x 16K
# leaves (Adam); optax shows what the flag alone does to an XLA program of many kernels.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
OUT=${OUT:-/tmp/optirs_out}
mkdir -p "$OUT"
TREES=${TREES:-gpt2,leaves}
run() {  # label, XLA_FLAGS, bench args...
  local label=$1 flags=$2; shift 2
  echo "== $label (XLA_FLAGS='$flags')"
  XLA_FLAGS="$flags" timeout ${VARIANT_TIMEOUT:-240} python3 -m optirs_jax.bench --trees "$TREES" \
    --optimizers adam --no-torch --json "$OUT/policy-$label.json" "$@" 2>/dev/null | tail -n +3
}
run pack "" --small-leaves pack --impls optirs-apply,optirs-update,optax
run solo "" --small-leaves solo --impls optirs-apply,optirs-update
run reference "" --small-leaves reference --impls optirs-apply,optirs-update
run pack-nocmdbuf "--xla_gpu_enable_command_buffer=" --small-leaves pack \
  --impls optirs-apply,optax

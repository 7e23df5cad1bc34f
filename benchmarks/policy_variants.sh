#!/usr/bin/env bash
# The kernel backend's leaf policies side by side on the GPU machine, one JSON per variant in
# $OUT:
#   VARIANTS=group-all,group,pack TREES=gpt2,flat bash benchmarks/policy_variants.sh
# Variants (small-leaf policy / large-leaf policy): pack (pack / in-place), solo, reference,
# group (group / in-place), group-all (group / group), and pack-nocmdbuf (pack, with XLA's
# command buffers off). EXTRA holds more bench arguments (--loop-steps 10). The first
# variant also times optax and torch (or FIRST_IMPLS); the others time
# optirs_jax's two paths only, so compare ratios within one call.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-}
OUT=${OUT:-/tmp/optirs_out}
mkdir -p "$OUT"
TREES=${TREES:-gpt2,leaves}
OPTIMIZERS=${OPTIMIZERS:-adam}
VARIANTS=${VARIANTS:-group-all,group,pack,solo,reference,pack-nocmdbuf}
first=1
for label in ${VARIANTS//,/ }; do
  flags="" large=in-place
  case $label in
    pack|solo|reference|group) small=$label ;;
    group-all) small=group large=group ;;
    pack-nocmdbuf) small=pack flags="--xla_gpu_enable_command_buffer=" ;;
    *) echo "unknown variant $label"; exit 2 ;;
  esac
  impls=(--impls optirs-apply,optirs-update)
  if ((first)); then impls=(${FIRST_IMPLS:+--impls $FIRST_IMPLS}); first=0; fi
  echo "== $label (small leaves: $small, large leaves: $large, XLA_FLAGS='$flags')"
  XLA_FLAGS="$flags" timeout ${VARIANT_TIMEOUT:-240} python3 -m optirs_jax.bench \
    --trees "$TREES" --optimizers "$OPTIMIZERS" --small-leaves $small --large-leaves $large \
    --json "$OUT/policy-$label.json" "${impls[@]}" ${EXTRA:-} 2>>"$OUT/policy.err" | tail -n +3
done

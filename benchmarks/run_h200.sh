#!/usr/bin/env bash
# One call on the GPU machine: versions, the whole test suite with the GPU visible, then the
# benchmark. Everything lands under $OUT. Run from the repository root with the wheels that
# the GPU image lacks in .whl/ (dm-haiku, jmp):
#   bash benchmarks/run_h200.sh [pytest args...]
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/optirs_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:${PYTHONPATH:-}
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax, jaxlib, optax, chex, flax, torch; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__, 'chex', chex.__version__, 'flax', flax.__version__, 'torch', torch.__version__); print(jax.devices())"
} 2>&1 | tee "$OUT/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  python3 -m pytest -q -p no:cacheprovider -rs "$@" 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  python3 -m optirs_jax.bench ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>"$OUT/bench.err" \
    | tee "$OUT/bench.txt"
fi

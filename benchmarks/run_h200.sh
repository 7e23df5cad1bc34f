#!/usr/bin/env bash
# One call on the GPU machine. Everything lands under $OUT. Run from the repository root
# with the wheels the GPU image lacks in .whl/ (dm-haiku, jmp):
#   STEPS=env,gemm,occupancy,tests,bench bash benchmarks/run_h200.sh [pytest args...]
# Steps: env (versions), gemm (benchmarks/gemm_tflops.py), occupancy
# (benchmarks/occupancy_vs_driver.py), policy (benchmarks/policy_variants.sh), sharded
# (benchmarks/sharded_overhead.py), grouped (benchmarks/grouped_tiling.py $GROUPED_ARGS),
# finite (benchmarks/finite_tiling.py $FINITE_ARGS), qtiling (benchmarks/quantized_tiling.py
# $QTILING_ARGS), breakdown
# (benchmarks/kernel_breakdown.py for each "tree:optimizer:impl" of $BREAKDOWN), firstcall (benchmarks/first_call.py, one process
# per "tree:optimizer:impl" of $FIRST_CALLS, $FIRST_CALL_REPS rounds, each round once per
# package folder of $FIRST_CALL_PATHS, e.g. ". old" with an older checkout's optirs_jax in
# old/: alternating, so the machine's drift falls on each alike), compileprof
# (benchmarks/compile_profile.py, one process per "tree:optimizer:impl" of $COMPILE_PROFILES),
# sass (benchmarks/xla_sass.py $SASS_ARGS: the SASS XLA compiles the fused apply into),
# tests (the whole suite with the GPU visible, WORKERS pytest-xdist workers), bench (python
# -m optirs_jax.bench $BENCH_ARGS), sparse (benchmarks/sparse_rows.py $SPARSE_ARGS), bnb
# (benchmarks/bnb_adam8bit.py: needs a bitsandbytes wheel in .whl/), flax
# (benchmarks/flax_steps.py), muon (benchmarks/muon_step.py $MUON_ARGS), train (python -m
# optirs_jax.bench.train $TRAIN_ARGS).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/optirs_out}
STEPS=${STEPS:-env,tests,bench}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}  # absolute: tests run scripts from temporary folders
has() { [[ ",$STEPS," == *",$1,"* ]]; }
if has env; then
  { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import jax, jaxlib, optax, chex, flax, torch; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'optax', optax.__version__, 'chex', chex.__version__, 'flax', flax.__version__, 'torch', torch.__version__); print(jax.devices())"
  } 2>&1 | tee "$OUT/env.txt"
  # The device's own description, for tests/test_cuda_compile.py's compile-only H200.
  python3 -c "import jax; from jax._src.lib import xla_client as xc; print(xc.get_topology_for_devices(jax.devices()).target_config)" \
    > "$OUT/target_config.pbtxt" 2>&1
fi
if has gemm; then
  timeout 120 python3 benchmarks/gemm_tflops.py 2>&1 | tee -a "$OUT/extras.txt"
fi
if has occupancy; then
  timeout 120 python3 benchmarks/occupancy_vs_driver.py "$OUT/occupancy.json" > "$OUT/occupancy.txt" 2>&1
  head -30 "$OUT/occupancy.txt"
fi
if has policy; then
  bash benchmarks/policy_variants.sh 2>&1 | tee -a "$OUT/extras.txt"
fi
if has sass; then
  timeout ${SASS_TIMEOUT:-300} python3 benchmarks/xla_sass.py ${SASS_ARGS:-} 2>&1 \
    | tee -a "$OUT/sass.txt"
fi
if has grouped; then
  timeout ${GROUPED_TIMEOUT:-200} python3 benchmarks/grouped_tiling.py ${GROUPED_ARGS:-} 2>&1 \
    | tee -a "$OUT/grouped.txt"
fi
if has qtiling; then
  timeout ${QTILING_TIMEOUT:-300} python3 benchmarks/quantized_tiling.py ${QTILING_ARGS:-} 2>&1 \
    | grep -v "^WARNING\|^I0000\|^E0000" | tee -a "$OUT/qtiling.txt"
fi
if has finite; then
  timeout ${FINITE_TIMEOUT:-150} python3 benchmarks/finite_tiling.py ${FINITE_ARGS:-} 2>&1 \
    | grep -v "^WARNING\|^I0000\|^E0000" | tee -a "$OUT/finite.txt"
fi
if has breakdown; then
  for case in ${BREAKDOWN:-gpt2:lamb:optirs-apply gpt2:adamw_bf16_master:optirs-apply}; do
    IFS=: read -r tree opt impl <<< "$case"
    timeout 120 python3 benchmarks/kernel_breakdown.py "$tree" "$opt" "${impl:-optirs-apply}" \
      2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tee -a "$OUT/breakdown.txt"
  done
fi
if has firstcall; then
  for ((rep = 0; rep < ${FIRST_CALL_REPS:-2}; rep++)); do
    for case in ${FIRST_CALLS:-gpt2:adam:optirs-apply gpt2:adam:optax}; do
      IFS=: read -r tree opt impl <<< "$case"
      for path in ${FIRST_CALL_PATHS:-.}; do
        printf '%s ' "$path"
        PYTHONPATH=$PWD/$path:$PYTHONPATH timeout ${FIRST_CALL_TIMEOUT:-150} \
          python3 benchmarks/first_call.py "$tree" "$opt" "$impl" 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"
      done
    done
  done | tee -a "$OUT/first_call.txt"
fi
if has compileprof; then
  for case in ${COMPILE_PROFILES:-leaves:adam:optirs-apply}; do
    IFS=: read -r tree opt impl <<< "$case"
    timeout ${COMPILE_PROFILE_TIMEOUT:-150} python3 benchmarks/compile_profile.py "$tree" "$opt" \
      "$impl" ${COMPILE_PROFILE_TOP:-40} 2>&1 | grep -v "^WARNING\|^I0000\|^E0000"
  done | tee -a "$OUT/compile_profile.txt"
fi
if has tests; then
  # The 8-CPU-device child (tests/test_multi_device.py, minutes of CPU work) starts first,
  # beside the rest, when the whole tests/ folder runs: last in line it kept run 53 from
  # finishing in its limit.
  deselect=()
  if [[ $# -eq 0 || " $* " == *" tests "* || " $* " == *" tests/ "* ]]; then
    (CUDA_VISIBLE_DEVICES= timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -v \
      -p no:cacheprovider -p no:benchmark tests/test_multi_device.py \
      > "$OUT/pytest-multi-device.log" 2>&1) &
    deselect=(--deselect tests/test_multi_device.py::test_multi_device_cases_on_8_cpu_devices)
  fi
  # Several workers share the GPU (no preallocation); Triton compiles run in parallel.
  # Verbose: each result is logged as it comes, so a run cut by its timeout still names its
  # failures.
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TESTS_TIMEOUT:-400} python3 -m pytest -v \
    -p no:cacheprovider -p no:benchmark -rs -n ${WORKERS:-8} "${deselect[@]}" "$@" \
    > "$OUT/pytest.log" 2>&1
  wait
  grep -E "^\[gw[0-9]+\] .*(FAILED|ERROR)|^FAILED|^ERROR" "$OUT/pytest.log" | head -40
  tail -25 "$OUT/pytest.log"
  [[ ${#deselect[@]} -eq 0 ]] || tail -3 "$OUT/pytest-multi-device.log"
fi
if has sharded; then
  timeout ${SHARDED_TIMEOUT:-120} python3 benchmarks/sharded_overhead.py 2>&1 | tee "$OUT/sharded.txt"
fi
if has sparse; then
  timeout ${SPARSE_TIMEOUT:-200} python3 benchmarks/sparse_rows.py ${SPARSE_ARGS:-} 2>&1 \
    | grep -v "^WARNING\|^I0000\|^E0000" | tee -a "$OUT/sparse.txt"
fi
if has bnb; then
  timeout ${BNB_TIMEOUT:-300} python3 benchmarks/bnb_adam8bit.py --json "$OUT/bnb.json" 2>&1 \
    | grep -v "^WARNING\|^I0000\|^E0000" | tee -a "$OUT/bnb.txt"
fi
if has flax; then
  timeout ${FLAX_TIMEOUT:-300} python3 benchmarks/flax_steps.py 2>&1 \
    | grep -v "^WARNING\|^I0000\|^E0000" | tee -a "$OUT/flax.txt"
fi
if has bench; then
  timeout ${BENCH_TIMEOUT:-400} python3 -m optirs_jax.bench ${BENCH_ARGS:-} --json "$OUT/bench.json" \
    2>"$OUT/bench.err" | tee "$OUT/bench.txt"
fi
if has muon; then
  timeout ${MUON_TIMEOUT:-240} python3 benchmarks/muon_step.py ${MUON_ARGS:-} --json "$OUT/muon.json" --hlo "$OUT/muon_hlo" \
    2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tee "$OUT/muon.txt"
fi
if has train; then
  timeout ${TRAIN_TIMEOUT:-400} python3 -m optirs_jax.bench.train ${TRAIN_ARGS:-} \
    --json "$OUT/train.json" 2>"$OUT/train.err" | tee "$OUT/train.txt"
fi

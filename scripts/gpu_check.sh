#!/usr/bin/env bash
# Everything this project checks and measures on an NVIDIA GPU machine, in stages.
# Runs from the source tree (nothing is installed there); carries .whl (platformdirs, Liger).
# Usage: bash scripts/gpu_check.sh [STAGE ...] [[--] ditops bench options]   (files go to $OUT)
#   stages, in this order by default: info warmup tests reliability fuzz sanitizer overhead check bench
#   Each stage fits a 10-minute command on an H200 with a warm cache except fuzz (2000 cases a
#   backend; its shards run in parallel: DITOPS_FUZZ_CASES fewer, or -k on its shard ids) and a
#   first check on a cold cache (every kernel compiles).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ditops-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
# one cache across stages (and calls, while the machine is held); cold when new
export DITOPS_CACHE_DIR=${DITOPS_CACHE_DIR:-/tmp/ditops-gpu-cache}
WORKERS=${WORKERS:-$(( $(nproc) * 3 / 4 ))}  # pytest-xdist workers: each compiles Triton kernels on the CPU
STAGES=()
while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do STAGES+=("$1"); shift; done  # up to the first option
[ "${1:-}" = "--" ] && shift
[ ${#STAGES[@]} -eq 0 ] && STAGES=(info warmup tests reliability fuzz sanitizer overhead check bench)
PYTEST=(python -m pytest -q -p no:cacheprovider)

for stage in "${STAGES[@]}"; do
    echo "== $stage"
    case $stage in
    info)
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
        python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
        python -m ditops.cli info | tee -a "$OUT/gpu.txt" ;;
    warmup)  # the CUDA kernels: compiled (cold cache), then loaded from the cache
        python -m ditops.cli warmup > "$OUT/warmup_cold.txt" 2>&1; tail -1 "$OUT/warmup_cold.txt"
        python -m ditops.cli warmup > "$OUT/warmup_cached.txt" 2>&1; tail -1 "$OUT/warmup_cached.txt" ;;
    tests)  # conformance of every backend, CUDA graphs, dispatch, the library; not the two below
        "${PYTEST[@]}" -n "$WORKERS" tests --ignore=tests/test_reference.py --ignore=tests/test_cuda_compile.py \
            --ignore=tests/test_triton_compile.py --ignore=tests/test_gpu_reliability.py --ignore=tests/test_fuzz.py \
            2>&1 | tee "$OUT/pytest.txt" | tail -4 ;;
    reliability)  # first calls in graph capture, threads, memory; summary in reliability.json
        DITOPS_RELIABILITY_OUT="$OUT/reliability.json" "${PYTEST[@]}" -n "$WORKERS" tests/test_gpu_reliability.py \
            2>&1 | tee "$OUT/reliability.txt" | tail -4 ;;
    fuzz)  # seeded calls of every op against the float64 oracle, outputs over NaN-poisoned memory
        DITOPS_RELIABILITY_OUT="$OUT/reliability.json" "${PYTEST[@]}" -n "$WORKERS" tests/test_fuzz.py \
            2>&1 | tee "$OUT/fuzz.txt" | tail -4 ;;
    sanitizer)  # compute-sanitizer over every conformance case of the cuda backend
        SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
        "$SANITIZER" --tool memcheck --report-api-errors no --error-exitcode 9 python scripts/sanitize_cuda.py > "$OUT/memcheck.txt" 2>&1
        echo "memcheck exit $?: $(tail -2 "$OUT/memcheck.txt" | tr '\n' ' ')"
        "$SANITIZER" --tool racecheck --report-api-errors no --error-exitcode 9 python scripts/sanitize_cuda.py --dtypes bfloat16 > "$OUT/racecheck.txt" 2>&1
        echo "racecheck exit $?: $(tail -3 "$OUT/racecheck.txt" | tr '\n' ' ')" ;;
    overhead)  # eager host cost, compiled blocks
        python benchmarks/call_overhead.py --output "$OUT/overhead.json" | tail -60 ;;
    check)  # the conformance suite in every dtype, as benchmarks/results/conformance_*.txt holds it
        python -m ditops.cli check > "$OUT/conformance.txt" 2> "$OUT/check.err"
        echo "check exit $?: $(tail -1 "$OUT/check.err")" ;;
    bench)
        python -m ditops.cli bench --output "$OUT" --no-plots "$@" > "$OUT/bench.log" 2>&1
        grep -A200 "microseconds per call" "$OUT/bench.log" ;;
    *)
        echo "unknown stage $stage (stages: info warmup tests reliability fuzz sanitizer overhead check bench)" >&2
        exit 2 ;;
    esac
done

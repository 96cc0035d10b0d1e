#!/usr/bin/env bash
# One device-tool call: everything this project checks and measures on an NVIDIA GPU machine.
# Runs from the source tree (nothing is installed there); carries .whl (platformdirs, Liger).
# Usage: bash scripts/gpu_check.sh [ditops bench options]   (writes its files to $OUT)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ditops-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export DITOPS_CACHE_DIR=$(mktemp -d)/cache  # cold: the first warmup compiles everything
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python -m ditops.cli info | tee -a "$OUT/gpu.txt"

echo "== CUDA kernels: compile (cold cache), then load from the cache"
python -m ditops.cli warmup > "$OUT/warmup_cold.txt" 2>&1; tail -1 "$OUT/warmup_cold.txt"
python -m ditops.cli warmup > "$OUT/warmup_cached.txt" 2>&1; tail -1 "$OUT/warmup_cached.txt"

echo "== tests on the GPU (conformance of every backend, CUDA graphs, dispatch, library)"
python -m pytest -q -p no:cacheprovider tests --ignore=tests/test_reference.py \
    --ignore=tests/test_cuda_compile.py --ignore=tests/test_triton_compile.py 2>&1 | tee "$OUT/pytest.txt" | tail -4

echo "== compute-sanitizer over every conformance case of the cuda backend"
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
"$SANITIZER" --tool memcheck --report-api-errors no --error-exitcode 9 python scripts/sanitize_cuda.py > "$OUT/memcheck.txt" 2>&1
echo "memcheck exit $?: $(tail -2 "$OUT/memcheck.txt" | tr '\n' ' ')"
"$SANITIZER" --tool racecheck --report-api-errors no --error-exitcode 9 python scripts/sanitize_cuda.py --dtypes bfloat16 > "$OUT/racecheck.txt" 2>&1
echo "racecheck exit $?: $(tail -3 "$OUT/racecheck.txt" | tr '\n' ' ')"

echo "== call overhead (eager host cost, compiled blocks)"
python benchmarks/call_overhead.py --output "$OUT/overhead.json" | tail -60

echo "== ditops bench"
python -m ditops.cli bench --output "$OUT" --no-plots "$@" > "$OUT/bench.log" 2>&1
grep -A200 "microseconds per call" "$OUT/bench.log"

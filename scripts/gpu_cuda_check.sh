#!/usr/bin/env bash
# Device-tool call for the CUDA backend: conformance on the GPU, compute-sanitizer memcheck and
# racecheck over every conformance case, and compile/load times from a cold and a warm cache.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ditops-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export DITOPS_CACHE_DIR=/tmp/ditops-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -m ditops.cli warmup > "$OUT/warmup_cold.txt" 2>&1; tail -1 "$OUT/warmup_cold.txt"
python -m ditops.cli warmup > "$OUT/warmup_cached.txt" 2>&1; tail -1 "$OUT/warmup_cached.txt"
python -m pytest -q -p no:cacheprovider -x tests/conformance -k cuda 2>&1 | tail -4
python -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 | tail -2
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
"$SANITIZER" --tool memcheck --report-api-errors no --error-exitcode 9 python scripts/sanitize_cuda.py > "$OUT/memcheck.txt" 2>&1
echo "memcheck exit $?"; tail -3 "$OUT/memcheck.txt"
"$SANITIZER" --tool racecheck --report-api-errors no --error-exitcode 9 python scripts/sanitize_cuda.py --dtypes bfloat16 \
    --ops norm_scale_shift residual_norm_scale_shift norm_scale_shift_select add_gate_norm_scale qk_norm_rope_ > "$OUT/racecheck.txt" 2>&1
echo "racecheck exit $?"; tail -3 "$OUT/racecheck.txt"

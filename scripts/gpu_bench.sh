#!/usr/bin/env bash
# Device-tool call: CUDA-graph test, dispatch overhead and `ditops bench` (all candidates).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ditops-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
export DITOPS_CACHE_DIR=${DITOPS_CACHE_DIR:-/tmp/ditops-cache}
python -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 | tail -2
python benchmarks/dispatch_overhead.py --device cuda --json "$OUT/dispatch_overhead_cuda.json" 2>&1 | tail -12
timeout 480 python -m ditops.cli bench --output "$OUT" --no-plots "$@" > "$OUT/bench.log" 2>&1
echo "bench exit $?"
grep -A200 "microseconds per call" "$OUT/bench.log"

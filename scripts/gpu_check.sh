#!/usr/bin/env bash
# One device-tool call: everything this project checks and measures on a GPU machine.
# Runs from the source tree (nothing is installed there); carries .whl (Liger) when present.
# Usage: bash scripts/gpu_check.sh [--quick]   (writes at most 8 files to $OUT)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ditops-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python -m ditops.cli info | tee -a "$OUT/gpu.txt"
python -m pytest -q -p no:cacheprovider tests --ignore=tests/test_reference.py 2>&1 | tee "$OUT/pytest.txt" | tail -8
python -m ditops.cli check > "$OUT/check.txt" 2>&1; grep -E "^(op|[a-z_]+ +[0-9])" "$OUT/check.txt"
python benchmarks/dispatch_overhead.py --device cuda --json "$OUT/dispatch_overhead_cuda.json" | tail -10
python -m ditops.cli bench --output "$OUT" --no-plots "$@" > "$OUT/bench.log" 2>&1
grep -A200 "microseconds per call" "$OUT/bench.log"

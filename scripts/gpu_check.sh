#!/usr/bin/env bash
# One device-tool call: what this project can check on a GPU machine, with a short table at the end.
# Runs from the source tree (nothing is installed there). Usage: bash scripts/gpu_check.sh
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ditops-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python -m ditops.cli info | tee "$OUT/info.txt"
python -m pytest -q -p no:cacheprovider tests --ignore=tests/test_reference.py 2>&1 | tee "$OUT/pytest.txt" | tail -15
python -m ditops.cli check | tee "$OUT/check.txt"
python benchmarks/dispatch_overhead.py --device cuda --json "$OUT/dispatch_overhead_cuda.json"

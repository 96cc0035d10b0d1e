"""Sweep the Triton launch settings (configs/triton_launch.yaml) on this GPU.

For each row-kernel case: rows per program x num_warps; for each rotary case: tile size x
num_warps. Timed as `ditops bench` times (CUDA-graph replay, cold L2), bf16. Prints every
setting and the best per case; the table in configs/ is then written by hand from it.
Usage: python benchmarks/tune_triton.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

import ditops.backends.triton as triton_backend
from ditops.backends.triton import launch
from ditops.bench import timing
from ditops.bench.cases import CASES, minimum_bytes
from ditops.ops import PUBLIC

ROW_CASES = [
    ("norm_scale_shift", "Wan2.1-1.3B 480p"),
    ("norm_scale_shift", "Wan2.1-14B 720p"),
    ("norm_scale_shift", "HunyuanVideo 720p"),
    ("norm_scale_shift", "Qwen-Image 1024px"),
    ("norm_scale_shift", "FLUX.2-dev 1024px"),
    ("norm_scale_shift", "Z-Image-Turbo (RMS)"),
    ("residual_norm_scale_shift", "Wan2.1-14B 720p"),
    ("norm_scale_shift_select", "Qwen-Image-Edit 1024px"),
    ("add_gate_norm_scale", "Z-Image-Turbo 1024px"),
]
ROTARY_CASES = [("qk_norm_rope_", "FLUX.1-dev 1024px"), ("qk_norm_rope_", "HunyuanVideo 720p"), ("rope_", "LLM GQA Dh96 NeoX")]


def measure(op: str, model: str, l2_bytes: int, copy_gbps: float, backend: str = "triton") -> tuple:
    case = next(c for c in CASES if c.op == op and c.model == model)
    first = case.build("cuda", torch.bfloat16, torch.Generator(device="cuda").manual_seed(0))
    size = minimum_bytes(op, first)
    sets = [first] + [case.build("cuda", torch.bfloat16, torch.Generator(device="cuda").manual_seed(seed))
                      for seed in range(1, timing.rotation_sets(size, l2_bytes))]
    calls = [lambda a=a: PUBLIC[op](**a, backend=backend) for a in sets]
    us = timing.cuda_graph(calls).us
    return us, 100 * size / (us * 1e3) / copy_gbps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="also write every measured setting to this file")
    arguments = parser.parse_args()
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copy_gbps = max(timing.copy_bandwidth("cuda").values())
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s")
    results = []
    original_row, original_rotary = triton_backend.row_launch, triton_backend.rotary_launch
    rows_choices, warps_choices = ((1, 2, 4), (4, 8, 16)) if arguments.quick else ((1, 2, 4, 8), (2, 4, 8, 16))
    for op, model in ROW_CASES:
        best = None
        for rows, warps in itertools.product(rows_choices, warps_choices):
            def row_launch(kernel, hidden, vendor, rows=rows, warps=warps):
                return launch.RowLaunch(original_row(kernel, hidden, vendor).block, warps, rows)

            triton_backend.row_launch = row_launch
            try:
                us, pct = measure(op, model, l2_bytes, copy_gbps)
            except Exception as error:  # a setting that does not compile (too many registers) is skipped
                print(f"{op} {model} rows={rows} warps={warps}: {type(error).__name__}")
                continue
            results.append(dict(op=op, model=model, rows=rows, warps=warps, us=us, pct=pct))
            best = min(best or results[-1], results[-1], key=lambda r: r["us"])
        print(f"best {op} {model}: rows={best['rows']} warps={best['warps']} {best['us']:.1f} us {best['pct']:.0f}%", flush=True)
    triton_backend.row_launch = original_row
    for op, model in ROTARY_CASES:
        best = None
        for tile, warps in itertools.product((1024, 2048, 4096, 8192), (2, 4, 8)):
            def rotary_launch(head_size, rotary_dim, heads, vendor, tile=tile, warps=warps):
                chosen = original_rotary(head_size, rotary_dim, heads, vendor)
                per_head = 2 * chosen.block_half + (chosen.block_rest if head_size > rotary_dim else 0)
                block_heads = min(launch.triton.next_power_of_2(heads), max(1, tile // per_head))
                return launch.RotaryLaunch(block_heads, chosen.block_half, chosen.block_rest, warps)

            triton_backend.rotary_launch = rotary_launch
            us, pct = measure(op, model, l2_bytes, copy_gbps)
            results.append(dict(op=op, model=model, tile=tile, warps=warps, us=us, pct=pct))
            best = min(best or results[-1], results[-1], key=lambda r: r["us"])
        print(f"best {op} {model}: tile={best['tile']} warps={best['warps']} {best['us']:.1f} us {best['pct']:.0f}%", flush=True)
    triton_backend.rotary_launch = original_rotary
    if arguments.json:
        with open(arguments.json, "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()

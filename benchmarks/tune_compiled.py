"""Sweep the launch shapes of the compiled (CUDA) kernels on this GPU.

Row kernels: chunks of 8 values per thread in 1..8, with as many threads per row as that
needs (a multiple of the warp size above one warp). Rotary: threads per block. Timed as
`ditops bench` times them (CUDA-graph replay, cold L2), bf16. configs/compiled_launch.yaml is
then written by hand from the printed table.
Usage: python benchmarks/tune_compiled.py
"""

from __future__ import annotations

import itertools
import json
import math
import sys

import torch

from ditops.backends import compiled
from ditops.bench import timing
from tune_triton import measure

ROW_CASES = [
    ("norm_scale_shift", "Wan2.1-1.3B 480p", 1536),
    ("norm_scale_shift", "HunyuanVideo 720p", 3072),
    ("norm_scale_shift", "Qwen-Image 1024px", 3072),
    ("norm_scale_shift", "Z-Image-Turbo (RMS)", 3840),
    ("norm_scale_shift", "Wan2.1-14B 720p", 5120),
    ("norm_scale_shift", "FLUX.2-dev 1024px", 6144),
    ("residual_norm_scale_shift", "Qwen-Image 1024px", 3072),
    ("add_gate_norm_scale", "Z-Image-Turbo 1024px", 3840),
]
ROTARY_CASES = [("qk_norm_rope_", "FLUX.1-dev 1024px"), ("rope_", "Wan2.1-1.3B 480p"), ("rope_", "LLM GQA Dh96 NeoX")]


def row_shape(hidden: int, chunks: int) -> tuple:
    """(threads per row, block) for rows of `hidden` in `chunks` chunks per thread."""
    threads = math.ceil(hidden / compiled.CHUNK / chunks)
    threads = 1 << math.ceil(math.log2(threads)) if threads <= 32 else 32 * math.ceil(threads / 32)
    return threads, threads * max(1, 128 // threads)


def main() -> None:
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    copy_gbps = max(timing.copy_bandwidth("cuda").values())
    print(f"{torch.cuda.get_device_name()}: copy {copy_gbps:.0f} GB/s", flush=True)
    results = []
    original_row, original_rotary = compiled.row_instance, compiled.rotary_instance
    for op, model, hidden in ROW_CASES:
        for chunks in (2, 3, 4, 5, 6, 8):
            threads, block = row_shape(hidden, chunks)
            if threads > 1024:
                continue

            def row_instance(kernel, dtype, param_dtype, hidden, threads=threads, chunks=chunks, block=block):
                arguments = (compiled.C_TYPES[dtype], compiled.C_TYPES[param_dtype], threads, chunks, block)
                return compiled.Instance(f"{kernel}.cu", kernel, arguments, block, threads)

            compiled.row_instance = row_instance
            us, pct = measure(op, model, l2_bytes, copy_gbps, backend="cuda")
            results.append(dict(op=op, model=model, threads=threads, chunks=chunks, block=block, us=us, pct=pct))
            print(f"{op:28} {model:24} threads={threads:4} chunks={chunks} block={block:4}: {us:8.1f} us {pct:5.1f}%", flush=True)
    compiled.row_instance = original_row
    for op, model in ROTARY_CASES:
        for block, items in itertools.product((64, 128, 256), (1, 2, 4)):
            def rotary_instance(dtype, head_size, block=block, items=items):
                chosen = original_rotary(dtype, head_size)
                return chosen._replace(template_arguments=chosen.template_arguments[:2] + (block, items), block=block)

            compiled.rotary_instance = rotary_instance
            us, pct = measure(op, model, l2_bytes, copy_gbps, backend="cuda")
            results.append(dict(op=op, model=model, block=block, items=items, us=us, pct=pct))
            print(f"{op:28} {model:24} block={block:4} items={items}: {us:8.1f} us {pct:5.1f}%", flush=True)
    compiled.rotary_instance = original_rotary
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as file:
            json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()

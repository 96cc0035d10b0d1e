"""The norm calls that ditops.integrations.diffusers makes in a Wan2.1-1.3B block (32760 tokens,
D = 1536), with their real argument forms (float32 [1, 1, D] modulation chunks, 0-dim zeros
for an absent scale and shift, bf16 weights): the selected implementation's CUDA-graph time
with rotating inputs, and the percentage of this GPU's copy bandwidth. It found the
per-column load of scalar modulation in the Triton row kernels (row_math.load_modulation).
The self-attention's q/k RMSNorm and RoPE are one qk_norm_rope_(norm_over="token") call: its
`ditops bench` rows (Wan2.1 token norm).
Usage: python benchmarks/wan_norm_calls.py
"""

from __future__ import annotations

import torch

import ditops
from ditops.bench import timing

TOKENS, HIDDEN = 32760, 1536


def wan_calls() -> list:
    """(what, activation tensors read and written, call(x, residual)) as the integration makes them."""
    shift, scale, gate, context_shift, context_scale, _ = torch.randn(1, 6, HIDDEN, device="cuda").chunk(6, dim=1)
    weight, bias = (torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    zero = torch.zeros((), device="cuda")
    return [
        ("norm1: LayerNorm, float32 [1, 1, D] scale/shift", 2,
         lambda x, residual: ditops.norm_scale_shift(x, scale, shift)),
        ("norm2: residual + float32 gate, float32 0-dim zeros, bf16 weight/bias", 4,
         lambda x, residual: ditops.residual_norm_scale_shift(x, residual, gate, zero, zero, weight=weight, bias=bias)),
        ("norm3: residual (no gate), float32 [1, 1, D] scale/shift", 4,
         lambda x, residual: ditops.residual_norm_scale_shift(x, residual, None, context_scale, context_shift)),
    ]


def main() -> None:
    copy_gbps = max(timing.copy_bandwidth("cuda").values())
    activation_bytes = TOKENS * HIDDEN * 2
    sets = timing.rotation_sets(2 * activation_bytes, torch.cuda.get_device_properties(0).L2_cache_size)
    inputs = [(torch.randn(1, TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16),
               torch.randn(1, TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)) for _ in range(sets)]
    print(f"{torch.cuda.get_device_name()}, copy {copy_gbps:.0f} GB/s")
    for what, tensors, call in wan_calls():
        result = timing.cuda_graph([lambda x=x, residual=residual: call(x, residual) for x, residual in inputs])
        percent = 100 * tensors * activation_bytes / (result.us * 1e3) / copy_gbps
        print(f"{what:72s} {result.us:8.1f} us {percent:5.1f}% of copy")


if __name__ == "__main__":
    main()

"""The benchmark cases: each op at the real shapes of docs/ops.md, plus a small latency case.

Inputs are laid out as the models pass them (built by ditops/examples.py, the one argument
builder): modulation as [B, D] or [B, 1, D] views of [B, 6, D] tensors (float32 in Wan, the
activations' dtype elsewhere), per-token cos/sin caches for multi-axis RoPE, int64 positions
for the LLM-style RoPE rows.
``minimum_bytes`` counts the fewest bytes an op must move: each distinct input element
read once, each output written once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..examples import HeadSpec, RowSpec, build

TEXT_TOKENS = 512  # text tokens beside 4096 image tokens at 1024px (FLUX, FLUX.2, Qwen-Image, Z-Image)


@dataclass(frozen=True)
class BenchCase:
    op: str
    model: str
    shape: str  # e.g. "B1 S32760 D1536"
    build: Callable  # (device, dtype, generator) -> keyword arguments of ditops.<op>; the generator may live on the GPU
    quick: bool = False  # part of `ditops bench --quick`


def _rows(op, batch, tokens, hidden, *, modulation_dtype=None, norm="layer", affine=False, per_batch_3d=False):
    """A norm-op case builder; ``per_batch_3d`` gives [B, 1, D] modulation views (Wan) instead of [B, D]."""
    form = "batch3_view" if per_batch_3d else "batch_view"
    spec = RowSpec(
        batch, tokens, hidden, form, form, form, norm=norm, param_dtype=modulation_dtype, affine=affine, index="halves", select_form="batch_view"
    )
    return lambda device, dtype, generator: build(op, spec, dtype, device, generator)


def _heads(op, tokens, q_heads, k_heads, head_size, *, interleaved=True, positions=False, batch=None):
    """A RoPE-op case builder: q/k [T, H, Dh] (or [B, S, H, Dh] with ``batch``); a per-token
    float32 cache and no positions (multi-axis RoPE), or int64 positions into the cache; the
    q/k norm weights in the activations' dtype, as the models hold them."""
    leading = (batch, tokens) if batch else (tokens,)
    spec = HeadSpec(
        leading, q_heads, k_heads, head_size, interleaved=interleaved, positions=torch.int64 if positions else None, weight_dtypes=(None, None)
    )
    return lambda device, dtype, generator: build(op, spec, dtype, device, generator)


def _norm_cases(op: str) -> list:
    wan = dict(modulation_dtype=torch.float32, per_batch_3d=True)
    cases = [
        BenchCase(op, "Wan2.1-1.3B 480p", "B1 S32760 D1536", _rows(op, 1, 32760, 1536, **wan), quick=True),
        BenchCase(op, "Wan2.1-14B 720p", "B1 S75600 D5120", _rows(op, 1, 75600, 5120, **wan)),
        BenchCase(op, "HunyuanVideo 720p", "B1 S118800 D3072", _rows(op, 1, 118800, 3072)),
        BenchCase(op, "Qwen-Image 1024px", "B1 S4096 D3072", _rows(op, 1, 4096, 3072, affine=True)),
    ]
    if op == "norm_scale_shift":
        cases += [
            BenchCase(op, "FLUX.2-dev 1024px", f"B1 S{4096 + TEXT_TOKENS} D6144", _rows(op, 1, 4096 + TEXT_TOKENS, 6144)),
            BenchCase(op, "Z-Image-Turbo (RMS)", f"B1 S{4096 + TEXT_TOKENS} D3840", _rows(op, 1, 4096 + TEXT_TOKENS, 3840, norm="rms", affine=True)),
        ]
    return cases + [BenchCase(op, "latency", "B1 S128 D3072", _rows(op, 1, 128, 3072), quick=True)]


def _select_cases(op: str) -> list:
    return [
        BenchCase(op, "Qwen-Image-Edit 1024px", "B1 S8192 D3072", _rows(op, 1, 8192, 3072, affine=True), quick=True),
        BenchCase(op, "latency", "B1 S128 D3072", _rows(op, 1, 128, 3072)),
    ]


def _gate_norm_cases(op: str) -> list:
    tokens = 4096 + TEXT_TOKENS
    z_image = _rows(op, 1, tokens, 3840, norm="rms", affine=True, modulation_dtype=torch.float32)
    return [
        BenchCase(op, "Z-Image-Turbo 1024px", f"B1 S{tokens} D3840", z_image, quick=True),
        BenchCase(op, "latency", "B1 S128 D3072", _rows(op, 1, 128, 3072, norm="rms", affine=True)),
    ]


def _qk_norm_rope_cases() -> list:
    op = "qk_norm_rope_"
    joint = 4096 + TEXT_TOKENS
    return [
        BenchCase(op, "FLUX.1-dev 1024px", f"T{joint} H24 Dh128", _heads(op, joint, 24, 24, 128), quick=True),
        BenchCase(op, "HunyuanVideo 720p", "T118800 H24 Dh128", _heads(op, 118800, 24, 24, 128)),
        BenchCase(op, "FLUX.2-dev 1024px", f"T{joint} H48 Dh128", _heads(op, joint, 48, 48, 128)),
        BenchCase(op, "Qwen-Image-Edit 1024px", f"T{8192 + TEXT_TOKENS} H24 Dh128", _heads(op, 8192 + TEXT_TOKENS, 24, 24, 128)),
        BenchCase(op, "Z-Image-Turbo 1024px", f"T{joint} H30 Dh128", _heads(op, joint, 30, 30, 128)),
        BenchCase(op, "latency", "T128 H24 Dh128", _heads(op, 128, 24, 24, 128), quick=True),
    ]


def _rope_cases() -> list:
    op = "rope_"
    llm = 16384
    return [
        BenchCase(op, "Wan2.1-1.3B 480p", "T32760 H12 Dh128", _heads(op, 32760, 12, 12, 128), quick=True),
        BenchCase(op, "Wan2.1-14B 720p", "T75600 H40 Dh128", _heads(op, 75600, 40, 40, 128)),
        BenchCase(op, "LLM GQA NeoX", f"T{llm} Hq32 Hk8 Dh128 neox", _heads(op, llm, 32, 8, 128, interleaved=False, positions=True)),
        BenchCase(op, "LLM GQA interleaved", f"T{llm} Hq32 Hk8 Dh128", _heads(op, llm, 32, 8, 128, positions=True)),
        BenchCase(op, "LLM Dh80 NeoX", f"T{llm} H16 Dh80 neox", _heads(op, llm, 16, 16, 80, interleaved=False, positions=True)),
        BenchCase(op, "LLM GQA Dh96 NeoX", f"T{llm} Hq16 Hk2 Dh96 neox", _heads(op, llm, 16, 2, 96, interleaved=False, positions=True)),
        BenchCase(op, "latency", "T128 H24 Dh128", _heads(op, 128, 24, 24, 128), quick=True),
    ]


CASES = [
    *_norm_cases("norm_scale_shift"),
    *_norm_cases("residual_norm_scale_shift"),
    *_select_cases("norm_scale_shift_select"),
    *_select_cases("residual_norm_scale_shift_select"),
    *_gate_norm_cases("add_gate_norm"),
    *_gate_norm_cases("add_gate_norm_scale"),
    *_qk_norm_rope_cases(),
    *_rope_cases(),
]

CPU_SHAPES = {"norm": (1, 256, 512), "heads": (256, 4, 64)}  # the CPU run's stand-in shape per op family


def cpu_case(case: BenchCase) -> BenchCase:
    """The same op and layout at a shape a CPU runs in milliseconds."""
    op = case.op
    if op in ("qk_norm_rope_", "rope_"):
        tokens, heads, head_size = CPU_SHAPES["heads"]
        neox = " neox" if " neox" in case.shape else ""
        build = _heads(op, tokens, heads, heads, head_size, interleaved=not neox)
        return BenchCase(op, case.model + " (CPU stand-in)", f"T{tokens} H{heads} Dh{head_size}{neox}", build, case.quick)
    batch, tokens, hidden = CPU_SHAPES["norm"]
    norm = "rms" if "RMS" in case.model or op.startswith("add_gate") else "layer"
    build = _rows(op, batch, tokens, hidden, norm=norm, affine=True)
    return BenchCase(op, case.model + " (CPU stand-in)", f"B{batch} S{tokens} D{hidden}", build, case.quick)


def _distinct_bytes(t: Optional[torch.Tensor]) -> int:
    """Bytes of the distinct elements a tensor addresses (broadcast dimensions, stride 0, count once)."""
    if t is None:
        return 0
    elements = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            elements *= size
    return elements * t.element_size()


def minimum_bytes(op: str, arguments: dict) -> int:
    """The fewest bytes ``op`` must move: each distinct input element read once, each output
    written once. The RoPE ops read and write q and k, and read one cache row per distinct
    position (one per token when positions is None)."""
    if op in ("qk_norm_rope_", "rope_"):
        q, k, cache, positions = arguments["q"], arguments.get("k"), arguments["cos_sin_cache"], arguments.get("positions")
        tokens = q.shape[:-2].numel()
        rows = tokens if positions is None else min(positions.numel(), cache.shape[0])
        total = 2 * (_distinct_bytes(q) + _distinct_bytes(k)) + rows * cache.shape[1] * cache.element_size()
        total += _distinct_bytes(positions)
        weights = (arguments.get("q_weight"), arguments.get("k_weight"))
        return total + sum(_distinct_bytes(w) for w in weights)
    tensors = {id(value): value for value in arguments.values() if isinstance(value, torch.Tensor)}  # one tensor passed twice
    inputs = sum(_distinct_bytes(value) for value in tensors.values())  # (weight2 = weight) is read once
    x = arguments["x"]
    outputs = {
        "norm_scale_shift": 1,
        "residual_norm_scale_shift": 2,
        "norm_scale_shift_select": 2,
        "residual_norm_scale_shift_select": 3,
        "add_gate_norm": 1,
        "add_gate_norm_scale": 2,
    }[op]
    return inputs + outputs * x.numel() * x.element_size()

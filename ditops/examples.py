"""Typical arguments of each op, as a DiT block passes them, for a given shape.

Used by ``ditops info`` / ``ditops explain``, the dispatch-overhead benchmark and the
torch.library tests. Inputs are random (never zeros). The shape is x's [B, S, D] or [S, D]
for the norm ops and q's [T, H, Dh] or [B, S, H, Dh] for the RoPE ops. On the "meta"
device the tensors have shapes, strides and dtypes but no memory: enough to validate and
dispatch a call of any size (``ditops explain``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

DEFAULT_SHAPES = {
    "norm_scale_shift": (1, 4096, 3072),
    "residual_norm_scale_shift": (1, 4096, 3072),
    "norm_scale_shift_select": (1, 8192, 3072),
    "residual_norm_scale_shift_select": (1, 8192, 3072),
    "add_gate_norm": (1, 4096, 3840),
    "add_gate_norm_scale": (1, 4096, 3840),
    "qk_norm_rope_": (4608, 24, 128),
    "rope_": (4096, 32, 128),
}


def check_shape(op: str, shape: Sequence[int]) -> tuple:
    """``shape`` as a tuple if it fits op (see the module docstring), else a ValueError saying what fits."""
    if op not in DEFAULT_SHAPES:
        raise ValueError(f"op must be one of {', '.join(DEFAULT_SHAPES)}, got {op!r}")
    shape = tuple(shape)
    heads = op.endswith("_")
    wanted = "q's T,H,Dh or B,S,H,Dh" if heads else "x's B,S,D or S,D"
    ranks = (3, 4) if heads else (2, 3)
    if len(shape) not in ranks or any(not isinstance(size, int) or size < 0 for size in shape):
        raise ValueError(f"shape for {op} must be {wanted} (sizes >= 0), got {','.join(map(str, shape))}")
    return shape


def example_arguments(
    op: str,
    shape: Optional[Sequence[int]] = None,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
    seed: int = 0,
    param_dtype: Optional[torch.dtype] = None,
) -> dict:
    """Keyword arguments for ``ditops.<op>``: per-batch [B, D] modulation views of one [B, 6, D]
    tensor (as DiTs chunk it), float32 weights, a float32 cos/sin cache, no positions.
    With param_dtype, every tensor but the activations has that dtype (as in Wan: float32)."""
    shape = check_shape(op, shape or DEFAULT_SHAPES[op])
    generator = torch.Generator().manual_seed(seed)
    weight_dtype = param_dtype or torch.float32
    modulation_dtype = param_dtype or dtype
    meta = torch.device(device).type == "meta"

    def random(*size, dtype=dtype):
        if meta:  # no values, no memory: randn on the CPU first would allocate the full size
            return torch.empty(size, dtype=dtype, device="meta")
        return torch.randn(size, generator=generator).to(dtype=dtype, device=device)

    if op in ("qk_norm_rope_", "rope_"):
        head_size = shape[-1]
        tokens = shape[-3]
        arguments = dict(
            q=random(*shape),
            k=random(*shape),
            cos_sin_cache=random(tokens, head_size, dtype=weight_dtype),
        )
        if op == "qk_norm_rope_":
            arguments.update(q_weight=random(head_size, dtype=weight_dtype), k_weight=random(head_size, dtype=weight_dtype))
        return arguments

    batch, tokens, hidden = shape if len(shape) == 3 else (1, *shape)
    x = random(*shape)
    modulation = random(batch, 6, hidden, dtype=modulation_dtype) * 0.1
    shift, scale, gate = modulation[:, 0], modulation[:, 1], modulation[:, 2]
    affine = dict(weight=random(hidden, dtype=weight_dtype), bias=random(hidden, dtype=weight_dtype))
    if op == "norm_scale_shift":
        return dict(x=x, scale=scale, shift=shift, **affine)
    if op == "residual_norm_scale_shift":
        return dict(x=x, residual=random(*shape), gate=gate, scale=scale, shift=shift, **affine)
    if op in ("norm_scale_shift_select", "residual_norm_scale_shift_select"):
        other = random(batch, 6, hidden, dtype=modulation_dtype) * 0.1
        index = torch.zeros(batch, tokens, dtype=torch.int64, device=device)
        index[:, tokens // 2 :] = 1  # Qwen-Image-Edit: the first half uses set 0, the second set 1
        arguments = dict(x=x, index=index, scale0=scale, shift0=shift, gate0=gate)
        arguments.update(scale1=other[:, 1], shift1=other[:, 0], gate1=other[:, 2], **affine)
        if op == "residual_norm_scale_shift_select":
            arguments.update(residual=random(*shape), residual_gate=random(*shape, dtype=modulation_dtype))
        return arguments
    rms_weight = dict(weight=affine["weight"])
    if op == "add_gate_norm":
        return dict(x=x, branch=random(*shape), gate=gate, gate_act="tanh", **rms_weight)
    if op == "add_gate_norm_scale":
        return dict(x=x, branch=random(*shape), gate=gate, scale=scale, gate_act="tanh", weight2=affine["bias"], **rms_weight)
    raise ValueError(f"unknown op {op!r}")

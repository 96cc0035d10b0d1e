"""Random inputs of op calls, described by what they are and built here: the one builder
behind the conformance cases, the benchmark cases, ``ditops explain`` and the tests.

A ``RowSpec`` describes a norm-op call (x's [B, S, D], the form of each modulation tensor,
layout, norm, parameter dtypes), a ``HeadSpec`` a RoPE-op call (q/k heads, head size, rotary
dims, positions, layout); each op's spec (ditops/opspec.py) turns one into the op's keyword
arguments with the helpers here. Inputs are random (never zeros), drawn on the generator's
device (a CPU generator for reproducible tests, a GPU one where the largest benchmark shapes
would take seconds on the CPU) and then moved and cast. On the "meta" device the tensors have
shapes, strides and dtypes but no memory: enough to validate and dispatch a call of any size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


def is_meta(device) -> bool:
    return torch.device(device).type == "meta"


def random(generator, device, dtype, *shape) -> torch.Tensor:
    """Standard normal values, drawn on the generator's device, then moved and cast."""
    if is_meta(device):  # no values: drawing them first would allocate the full size
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.randn(shape, generator=generator, device=generator.device).to(device=device, dtype=dtype)


def _count(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def activation(generator, device, dtype, shape, layout="contiguous", special_values=False) -> torch.Tensor:
    """x-like tensor: contiguous, a row-strided view of a wider buffer, or a view at storage offset 1;
    with ``special_values``, its first row holds a NaN and its last row an Inf."""
    if layout == "strided":
        t = random(generator, device, dtype, *shape[:-1], shape[-1] + 24)[..., : shape[-1]]
    elif layout == "misaligned":
        t = random(generator, device, dtype, _count(shape) + 1)[1:].view(shape)
    else:
        t = random(generator, device, dtype, *shape)
    if special_values:
        leading = t.dim() - 1
        t[(0,) * leading + (1,)] = float("nan")
        t[(-1,) * leading + (2,)] = float("inf")
    return t


def modulation(generator, device, dtype, form, batch, tokens, hidden, frames=3, table_rows=0) -> torch.Tensor:
    """One modulation tensor in a form of docs/ops.md; values around 0.5 so that 1 + scale is not ~1.
    The table forms have ``table_rows`` (K) rows, read through a modulation_index."""
    rand = lambda *shape: random(generator, device, dtype, *shape) * 0.5  # noqa: E731
    if form == "scalar":
        return rand()
    if form == "scalar1":
        return rand(1)
    if form == "vector":
        return rand(hidden)
    if form == "vector3":
        return rand(1, 1, hidden)
    if form == "batch":
        return rand(batch, hidden)
    if form == "batch_view":  # mod[:, 2] of a [B, 6, D] tensor, as DiTs chunk their modulation
        return rand(batch, 6, hidden)[:, 2]
    if form == "batch3_view":  # mod[:, 2:3] of a [B, 6, D] tensor: [B, 1, D], as Wan chunks it
        return rand(batch, 6, hidden)[:, 2:3]
    if form == "batch3":
        return rand(batch, 1, hidden)
    if form == "token":
        return rand(batch, tokens, hidden)
    if form == "token1":
        return rand(1, tokens, hidden)
    if form == "token_expanded":  # a [B, D] vector expanded over tokens: stride 0
        return rand(batch, 1, hidden).expand(batch, tokens, hidden)
    if form == "frame":
        return rand(batch, frames, 1, hidden)
    if form == "table":
        return rand(table_rows, hidden)
    if form == "table_view":  # a [K, D] chunk of a [K, 6 * D] tensor, as MiniMax-H3 chunks its AdaLN table
        return rand(table_rows, 6 * hidden)[:, 2 * hidden : 3 * hidden]
    if form == "batch_table":
        return rand(batch, table_rows, hidden)
    raise ValueError(f"modulation form must be one of scalar, scalar1, vector, vector3, batch, batch_view, "
                     f"batch3_view, batch3, token, token1, token_expanded, frame, table, table_view, batch_table; "
                     f"got {form!r}")


@dataclass(frozen=True)
class RowSpec:
    """Shape and layout of a norm-op call."""

    batch: int
    tokens: int
    hidden: int
    scale: str = "batch_view"
    shift: str = "batch_view"
    gate: Optional[str] = "batch_view"
    layout: str = "contiguous"
    norm: str = "layer"
    param_dtype: Optional[torch.dtype] = None  # modulation and weights; None: the activations' dtype (float32 in Wan)
    weight_dtype: Optional[torch.dtype] = None  # weight and bias when they differ from param_dtype
    affine: bool = True
    two_d: bool = False
    special_values: bool = False  # plant NaN and Inf in x: they must propagate as in the reference
    index: str = "random"  # select ops: "random" 0/1 per token, or "halves" (Qwen-Image-Edit: set 1 for the second half)
    select_form: str = "batch"  # select ops: the form of their six [B, D] modulation tensors ("batch" or "batch_view")
    gate_in_param_dtype: bool = False  # residual_norm_scale_shift_select: residual_gate in param_dtype, not x's dtype and layout
    set1_dtype: Optional[torch.dtype] = None  # select ops: set 1's modulation dtype where it differs from set 0's
    fp8_dtype: Optional[torch.dtype] = None  # *_fp8 ops: the output format; None: the device's own (dispatch.fp8_dtypes)
    static_scale: Optional[float] = None  # *_fp8 ops: one scale for every row (small: values saturate); None: per row
    activation: Optional[str] = None  # quantize_fp8: applied before quantising ("gelu_tanh")
    zero_rows: bool = False  # quantize_fp8: every other row of x (and of its prefix) all zeros (the dynamic scale's floor)
    prefix: int = 0  # quantize_fp8: the width P of a prefix (x's layout) quantised with x's rows; 0: no prefix
    prefix_special_values: bool = False  # quantize_fp8: NaN and Inf planted in the prefix, as special_values does in x
    table_rows: int = 0  # K of the table modulation forms; > 0: the call takes a modulation_index (modulation_index below)
    table_index: str = "batch"  # that index: "batch", "batch_int32", "shared" or "out_of_range" (modulation_index below)


@dataclass(frozen=True)
class HeadSpec:
    """Shape and layout of a RoPE-op call."""

    leading: tuple  # (T,) or (B, S)
    q_heads: int
    k_heads: int
    head_size: int
    rotary_dim: Optional[int] = None  # None: Dh
    interleaved: bool = True
    positions: Optional[torch.dtype] = None  # None: no positions, rows position_offset + s
    position_offset: int = 0
    layout: str = "contiguous"  # or "qkv" (views of one fused buffer), "misaligned"
    cache_dtype: torch.dtype = torch.float32
    k_none: bool = False
    weight_dtypes: tuple = (torch.float32, None)  # qk_norm_rope_'s q_weight and k_weight; None: the activations' dtype
    spare_cache_rows: int = 5  # cache rows past the last position a call reads (a cache sized for longer sequences)
    norm_over: str = "head"  # qk_norm_rope_'s RMSNorm: per head, or over all heads of a token ("token", weights [H * Dh])
    norm: str = "rms"  # qk_norm_rope_'s norm: "rms", or "layer" (with biases beside the weights when affine)
    affine: bool = True  # qk_norm_rope_'s weights (and LayerNorm biases); False: None
    # cos_sin_cache's form: "shared" [P, R] for every head; a row per head: "head" [P, H, R],
    # "batch_head" [B, P, H, R] (a table per batch item), "batch1_head" [1, P, H, R] (one for every
    # item), "head_major" [B, P, H, R] read through strides from [B, H, P, R] memory
    cache: str = "shared"


def modulation_index(spec: RowSpec, device, generator) -> Optional[torch.Tensor]:
    """The modulation_index of a call with tables (spec.table_rows K > 0), else None: "batch",
    [B, S] int64 values in [0, K); "batch_int32", the same as int32; "shared", [S] int64 values
    in [0, K), one row choice for every batch item (MiniMax-H3's packed sequence);
    "out_of_range", [B, S] int64 values in [-K, 2K), which the ops clamp into [0, K)."""
    if not spec.table_rows:
        return None
    shape = (spec.tokens,) if spec.table_index == "shared" else (spec.batch, spec.tokens)
    dtype = torch.int32 if spec.table_index == "batch_int32" else torch.int64
    if is_meta(device):
        return torch.empty(shape, dtype=dtype, device="meta")
    low, high = (-spec.table_rows, 2 * spec.table_rows) if spec.table_index == "out_of_range" else (0, spec.table_rows)
    return torch.randint(low, high, shape, generator=generator, device=generator.device).to(device=device, dtype=dtype)


def selection_index(spec: RowSpec, device, generator) -> torch.Tensor:
    if is_meta(device):
        return torch.empty((spec.batch, spec.tokens), dtype=torch.int64, device="meta")
    if spec.index == "halves":
        index = torch.zeros(spec.batch, spec.tokens, dtype=torch.int64, device=device)
        index[:, spec.tokens // 2 :] = 1
        return index
    return (torch.rand((spec.batch, spec.tokens), generator=generator, device=generator.device) > 0.5).to(device=device, dtype=torch.int64)

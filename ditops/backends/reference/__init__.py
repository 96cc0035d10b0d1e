"""The reference backend: the definition of every op (docs/ops.md) in plain PyTorch.

Math runs in float32, or float64 when the activations are float64 (the tests' oracle).
Each output is rounded once, to the activations' dtype, when it is stored. Every
function takes the op's arguments, already validated, and optional output tensors
(``y``, ``out``, ..., after the op's arguments): given, the results are written into them; left out, new
tensors are returned. Shapes: x is [B, S, D] or [N, D]; q/k are [..., H, Dh].
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ...dispatch import fp8_dtypes


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _store(value: Tensor, out: Optional[Tensor], like: Tensor) -> Tensor:
    """Rounds ``value`` once to like's dtype, into ``out`` if given."""
    if out is None:
        return value.to(like.dtype).contiguous()
    return out.copy_(value)


def _broadcastable(t: Optional[Tensor], x: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
    """A modulation tensor in any form of docs/ops.md, as a tensor that broadcasts against x.

    The forms differ from torch broadcasting in one place: a [B, D] tensor is one vector
    per batch item, and [B, F, 1, D] is one vector per frame of S // F tokens.
    """
    if t is None:
        return None
    t = t.to(dtype)
    hidden = x.shape[-1]
    if t.dim() == 0 or t.shape == (1,):
        return t.reshape(())
    if t.dim() == 1:
        return t
    if t.dim() == 2:  # [B, D] or [1, D]
        t = t.unsqueeze(1)
    elif t.dim() == 4:  # [B, F, 1, D]
        tokens = x.shape[-2]
        t = t.squeeze(2).repeat_interleave(tokens // t.shape[1], dim=1)
    return t if x.dim() == 3 else t.reshape(-1, hidden)


def _tables(index: Optional[Tensor], *modulation: Optional[Tensor]) -> tuple:
    """The modulation tensors of a call, each table (with a modulation_index, a 2-D [K, D] or
    3-D [B, K, D] tensor: docs/ops.md) read at its rows' index values clamped into [0, K), as a
    per-token [B, S, D] or [1, S, D] tensor; the other forms as given. The clamp keeps every
    read inside the table, in every backend alike."""
    if index is None:
        return modulation
    rows = (index if index.dim() == 2 else index.unsqueeze(0)).long()  # [B, S] or [1, S]
    read = []
    for t in modulation:
        if t is not None and t.dim() > 1:
            table = t if t.dim() == 3 else t.unsqueeze(0)
            batch = torch.arange(table.shape[0], device=t.device).unsqueeze(1)
            t = table[batch, rows.clamp(0, table.shape[1] - 1)]
        read.append(t)
    return tuple(read)


def _normalize(v: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], norm: str, eps: float) -> Tensor:
    """LayerNorm (biased variance) or RMSNorm of v over its last dimension, with optional affine."""
    if norm == "layer":
        mean = v.mean(-1, keepdim=True)
        variance = (v - mean).square().mean(-1, keepdim=True)
        n = (v - mean) * torch.rsqrt(variance + eps)
    else:
        n = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        n = n * weight.to(v.dtype)
    if bias is not None:
        n = n + bias.to(v.dtype)
    return n


def _modulate(n: Tensor, scale: Tensor, shift: Optional[Tensor], x: Tensor) -> Tensor:
    """n * (1 + scale) + shift, with the modulation tensors in any form."""
    result = n * (1 + _broadcastable(scale, x, n.dtype))
    if shift is not None:
        result = result + _broadcastable(shift, x, n.dtype)
    return result


def _gated_sum(x: Tensor, gate: Optional[Tensor], branch: Tensor, compute: torch.dtype) -> Tensor:
    """x + gate * branch in the compute dtype, rounded once (addcmul: a fused multiply-add, as
    the kernels do; rounding the product first moves a residual by an ulp, which a LayerNorm
    over a row of tiny variance amplifies past docs/ops.md's tolerance); a gate of None is 1."""
    if gate is None:
        return x.to(compute) + branch
    return torch.addcmul(x.to(compute), _broadcastable(gate, branch, compute), branch)


def norm_scale_shift(x, scale, shift, weight=None, bias=None, norm="layer", eps=1e-6, modulation_index=None, y=None):
    """y = norm(x) * (1 + scale) + shift.

    x: [B, S, D] or [N, D]; scale, shift: any modulation form, tables with modulation_index
    ([B, S] or [S]); weight, bias: [D] or None. Returns y with x's shape and dtype.
    """
    scale, shift = _tables(modulation_index, scale, shift)
    compute = _compute_dtype(x)
    n = _normalize(x.to(compute), weight, bias, norm, eps)
    return _store(_modulate(n, scale, shift, x), y, x)


def residual_norm_scale_shift(
    x, residual, gate, scale, shift, weight=None, bias=None, norm="layer", eps=1e-6, modulation_index=None, y=None,
    residual_out=None
):
    """residual_out = residual + gate * x (stored in x.dtype); y = norm(residual_out) * (1 + scale) + shift.

    The norm reads residual_out as stored, so y matches the residual the next block gets.
    x, residual: [B, S, D] or [N, D]; gate (None = 1), scale, shift: any modulation form,
    tables with modulation_index. Returns (y, residual_out).
    """
    gate, scale, shift = _tables(modulation_index, gate, scale, shift)
    compute = _compute_dtype(x)
    summed = _store(_gated_sum(residual, gate, x.to(compute), compute), residual_out, x)
    n = _normalize(summed.to(compute), weight, bias, norm, eps)
    return _store(_modulate(n, scale, shift, x), y, x), summed


SCALE_FLOOR = 1e-12  # the smallest row amax a dynamic scale divides by: an all-zero row gets 1e-12 / fmax


def _quantize_rows(v: Tensor, fp8_dtype: torch.dtype, static_scale: Optional[Tensor], y: Optional[Tensor],
                   y_scale: Optional[Tensor]) -> tuple:
    """Rows of v (the compute dtype) as FP8 values and their float32 scales, v ~= y * y_scale.

    Dynamic (``static_scale`` None): y_scale = max(amax(|row|), SCALE_FLOOR) / fmax, fmax the
    format's largest finite value, so the row's largest value maps to +-fmax; a row holding NaN
    or +-Inf gets a NaN scale and NaN values (the bf16 ops give such a row as NaN too). Static:
    y_scale is static_scale for every row and values beyond +-fmax saturate (NaN stays NaN).
    The scale is stored in float32 and the values are divided by the scale as stored.
    fp8_dtype None: y's dtype, or the first FP8 format of v's device."""
    if y is not None:
        fp8_dtype = y.dtype
    elif fp8_dtype is None:
        fp8_dtype = fp8_dtypes(v.device if v.device.type != "meta" else "cpu")[0]
    fmax = torch.finfo(fp8_dtype).max
    if static_scale is None:
        amax = v.abs().amax(-1, keepdim=True)
        scale = torch.where(amax.isfinite(), amax.clamp_min(SCALE_FLOOR) / fmax, torch.nan)
    else:
        scale = static_scale.to(v.dtype).reshape(()).expand(*v.shape[:-1], 1)
    scale = scale.to(torch.float32).to(v.dtype)  # as stored: the values are quantised against the stored scale
    scaled = v / scale
    scaled = torch.where(scaled > fmax, fmax, torch.where(scaled < -fmax, -fmax, scaled))  # NaN stays NaN
    quantized = scaled.to(fp8_dtype) if v.dtype != torch.float64 else scaled  # float64: the oracle keeps v / scale
    if y is not None:
        y.copy_(quantized)
        y_scale.copy_(scale)
        return y, y_scale
    return quantized, scale if v.dtype == torch.float64 else scale.to(torch.float32)


def norm_scale_shift_fp8(x, scale, shift, weight=None, bias=None, norm="layer", eps=1e-6,
                         fp8_dtype=None, static_scale=None, modulation_index=None, y=None, y_scale=None):
    """norm_scale_shift's y as FP8 rows and their float32 scales [..., 1] (_quantize_rows),
    from the float32 values before any rounding. Returns (y, y_scale)."""
    scale, shift = _tables(modulation_index, scale, shift)
    compute = _compute_dtype(x)
    n = _normalize(x.to(compute), weight, bias, norm, eps)
    return _quantize_rows(_modulate(n, scale, shift, x), fp8_dtype, static_scale, y, y_scale)


def residual_norm_scale_shift_fp8(x, residual, gate, scale, shift, weight=None, bias=None, norm="layer", eps=1e-6,
                                  fp8_dtype=None, static_scale=None, modulation_index=None, y=None, y_scale=None,
                                  residual_out=None):
    """residual_norm_scale_shift with y as FP8 rows and their scales. Returns (y, y_scale, residual_out)."""
    gate, scale, shift = _tables(modulation_index, gate, scale, shift)
    compute = _compute_dtype(x)
    summed = _store(_gated_sum(residual, gate, x.to(compute), compute), residual_out, x)
    n = _normalize(summed.to(compute), weight, bias, norm, eps)
    quantized, row_scale = _quantize_rows(_modulate(n, scale, shift, x), fp8_dtype, static_scale, y, y_scale)
    return quantized, row_scale, summed


def gelu_tanh(v: Tensor) -> Tensor:
    """GELU, tanh approximation (diffusers' ``GELU(approximate="tanh")``), in v's dtype."""
    return 0.5 * v * (1 + torch.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))


def quantize_fp8(x, activation=None, prefix=None, fp8_dtype=None, static_scale=None, y=None, y_scale=None):
    """Rows of x, after ``activation`` (None or "gelu_tanh"), as FP8 rows and their float32
    scales (_quantize_rows); with a prefix [..., P], the rows of cat([prefix, act(x)], -1),
    the prefix as it is. Returns (y, y_scale)."""
    compute = _compute_dtype(x)
    v = x.to(compute)
    if activation == "gelu_tanh":
        v = gelu_tanh(v)
    if prefix is not None:
        v = torch.cat([prefix.to(compute), v], -1)
    return _quantize_rows(v, fp8_dtype, static_scale, y, y_scale)


def _select(index: Tensor, set0: Tensor, set1: Tensor, dtype: torch.dtype) -> Tensor:
    """Per token: set1[b] where index[b, s] != 0, else set0[b]. index: [B, S]; sets: [B, D] -> [B, S, D]."""
    chosen = index.reshape(set0.shape[0], -1, 1) != 0
    return torch.where(chosen, set1.to(dtype).unsqueeze(1), set0.to(dtype).unsqueeze(1))


def _rows3(x: Tensor) -> Tensor:
    return x if x.dim() == 3 else x.unsqueeze(0)


def norm_scale_shift_select(
    x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight=None, bias=None, eps=1e-6, y=None, gate_out=None
):
    """LayerNorm with per-token choice between two modulation sets (Qwen-Image-Edit).

    x: [B, S, D] or [N, D] (B=1); index: [B, S] of 0/1; the six modulation tensors: [B, D].
    y = layernorm(x) * (1 + scale_sel) + shift_sel; gate_out = gate_sel as [B, S, D].
    Returns (y, gate_out), both in x's dtype, gate_out shaped like x.
    """
    result, gate = _selected_modulation(x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps)
    return _store(result, y, x), _store(gate, gate_out, x)


def _selected_modulation(x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps) -> tuple:
    """norm_scale_shift_select's y and gate_out before rounding: the compute dtype, x's shape."""
    compute = _compute_dtype(x)
    n = _normalize(_rows3(x).to(compute), weight, bias, "layer", eps)
    result = n * (1 + _select(index, scale0, scale1, compute)) + _select(index, shift0, shift1, compute)
    return result.reshape(x.shape), _select(index, gate0, gate1, compute).reshape(x.shape)


def residual_norm_scale_shift_select(
    x,
    residual,
    residual_gate,
    index,
    scale0,
    shift0,
    gate0,
    scale1,
    shift1,
    gate1,
    weight=None,
    bias=None,
    eps=1e-6,
    y=None,
    residual_out=None,
    gate_out=None,
):
    """residual_out = residual + residual_gate * x (stored in x.dtype), then norm_scale_shift_select of it.

    residual_gate: x's shape (the gate_out of the previous call). Returns (y, residual_out, gate_out).
    """
    compute = _compute_dtype(x)
    summed = _store(_gated_sum(residual, residual_gate, x.to(compute), compute), residual_out, x)
    y, gate_out = norm_scale_shift_select(
        summed, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, y=y, gate_out=gate_out
    )
    return y, summed, gate_out


def norm_scale_shift_select_fp8(x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight=None, bias=None, eps=1e-6,
                                fp8_dtype=None, static_scale=None, y=None, y_scale=None, gate_out=None):
    """norm_scale_shift_select's y as FP8 rows and their float32 scales (_quantize_rows), from
    the float32 values before any rounding. Returns (y, y_scale, gate_out)."""
    result, gate = _selected_modulation(x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps)
    return (*_quantize_rows(result, fp8_dtype, static_scale, y, y_scale), _store(gate, gate_out, x))


def residual_norm_scale_shift_select_fp8(x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1,
                                         weight=None, bias=None, eps=1e-6, fp8_dtype=None, static_scale=None, y=None,
                                         y_scale=None, residual_out=None, gate_out=None):
    """residual_norm_scale_shift_select with y as FP8 rows and their scales. Returns (y, y_scale,
    residual_out, gate_out)."""
    compute = _compute_dtype(x)
    summed = _store(_gated_sum(residual, residual_gate, x.to(compute), compute), residual_out, x)
    quantized, row_scale, gate_out = norm_scale_shift_select_fp8(
        summed, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps, fp8_dtype, static_scale, y, y_scale,
        gate_out)
    return quantized, row_scale, summed, gate_out


def _activate(gate: Tensor, gate_act: Optional[str]) -> Tensor:
    return torch.tanh(gate) if gate_act == "tanh" else gate


def add_gate_norm(x, branch, gate, weight=None, bias=None, norm="rms", eps=1e-5, gate_act=None, out=None):
    """out = x + act(gate) * norm(branch), act = identity or tanh (Z-Image's sandwich norm).

    x, branch: [B, S, D] or [N, D]; gate: any modulation form. Returns out in x's dtype.
    """
    compute = _compute_dtype(x)
    n = _normalize(branch.to(compute), weight, bias, norm, eps)
    gate = _activate(_broadcastable(gate, x, compute), gate_act)
    return _store(x.to(compute) + gate * n, out, x)


def add_gate_norm_scale(
    x,
    branch,
    gate,
    scale,
    weight=None,
    bias=None,
    weight2=None,
    bias2=None,
    norm="rms",
    eps=1e-5,
    gate_act=None,
    out=None,
    y=None,
):
    """out = add_gate_norm(x, branch, gate) (stored in x.dtype); y = norm2(out) * (1 + scale).

    norm2 uses weight2/bias2 and reads out as stored. Returns (out, y).
    """
    summed, result = _gated_norm_scale(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, out)
    return summed, _store(result, y, x)


def _gated_norm_scale(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, out) -> tuple:
    """add_gate_norm_scale's out (stored) and its y before rounding (the compute dtype)."""
    summed = add_gate_norm(x, branch, gate, weight, bias, norm, eps, gate_act, out=out)
    n = _normalize(summed.to(_compute_dtype(x)), weight2, bias2, norm, eps)
    return summed, _modulate(n, scale, None, x)


def add_gate_norm_scale_fp8(x, branch, gate, scale, weight=None, bias=None, weight2=None, bias2=None, norm="rms", eps=1e-5,
                            gate_act=None, fp8_dtype=None, static_scale=None, y=None, y_scale=None, out=None):
    """add_gate_norm_scale with y as FP8 rows and their scales, FP8 first as the other FP8 ops
    give them. Returns (y, y_scale, out)."""
    summed, result = _gated_norm_scale(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act, out)
    return (*_quantize_rows(result, fp8_dtype, static_scale, y, y_scale), summed)


def _rope_angles(q: Tensor, cos_sin_cache: Tensor, positions: Optional[Tensor], position_offset: int, dtype):
    """cos and sin for each token of q: [..., 1, R/2] from a [P, R] cache (every head alike),
    [..., H, R/2] from a cache with a row per head, [P, H, R] or [B, P, H, R] (item b's table,
    or the one table where B is 1); each broadcasts against q's [..., H, R/2]."""
    if positions is None:
        tokens = q.shape[-3]
        positions = torch.arange(position_offset, position_offset + tokens, device=q.device)
    cache = cos_sin_cache.to(dtype)
    if cache.dim() == 4:  # q is [B, S, H, Dh]; positions [B, S] or [S]
        rows = torch.take_along_dim(cache, torch.atleast_2d(positions.long())[..., None, None], dim=1)  # [B, S, H, R]
    else:
        rows = cache[positions.long()]  # [..., R] or [..., H, R]
    cos, sin = rows.chunk(2, dim=-1)
    return (cos.unsqueeze(-2), sin.unsqueeze(-2)) if cache.dim() == 2 else (cos, sin)


def _rotate(v: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """RoPE on the first R = 2 * cos.shape[-1] dims of v; the rest is returned unchanged."""
    rotary_dim = 2 * cos.shape[-1]
    rotary, rest = v[..., :rotary_dim], v[..., rotary_dim:]
    if interleaved:  # pairs (2j, 2j+1)
        first, second = rotary[..., 0::2], rotary[..., 1::2]
        rotated = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1).flatten(-2)
    else:  # NeoX: pairs (j, j + R/2)
        first, second = rotary.chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((rotated, rest), dim=-1)


def qk_norm_rope_(
    q, k, q_weight, k_weight, cos_sin_cache, positions=None, interleaved=True, rotary_dim=None, eps=1e-6, position_offset=0,
    norm_over="head", norm="rms", q_bias=None, k_bias=None
):
    """In place: per token and head, RMSNorm (norm="layer": LayerNorm, with optional biases)
    over Dh (weights [Dh]), then RoPE on the first R dims.

    q: [T, Hq, Dh] or [B, S, Hq, Dh]; k: same leading dims, Hk heads; cos_sin_cache: [P, R]
    (R/2 cos then R/2 sin columns), or a row per head, [P, H, R] or [B, P, H, R] (H = Hq =
    Hk; a table per batch item, or B = 1 for all); positions: q's leading shape, or None for
    position_offset + token index. norm_over="token": one norm over each token's H * Dh
    values (weights and biases [H * Dh]), the RoPE still per head. No rounding between norm
    and RoPE. Returns (q, k).
    """
    compute = _compute_dtype(q)
    cos, sin = _rope_angles(q, cos_sin_cache, positions, position_offset, compute)
    for t, weight, bias in ((q, q_weight, q_bias), (k, k_weight, k_bias)):  # copies: t is written below and autograd may have saved it
        v = t.to(compute, copy=True)
        if norm_over == "token":
            v = _normalize(v.flatten(-2), weight, bias, norm, eps).view(v.shape)
        else:
            v = _normalize(v, weight, bias, norm, eps)
        t.copy_(_rotate(v, cos, sin, interleaved))
    return q, k


def rope_(q, k, cos_sin_cache, positions=None, interleaved=True, rotary_dim=None, position_offset=0):
    """In place: RoPE on the first R dims of every head of q and k (k may be None). Returns (q, k)."""
    compute = _compute_dtype(q)
    cos, sin = _rope_angles(q, cos_sin_cache, positions, position_offset, compute)
    for t in (q, k) if k is not None else (q,):
        t.copy_(_rotate(t.to(compute, copy=True), cos, sin, interleaved))
    return q, k

"""What ditops is measured against: the unfused PyTorch a model would write ("eager"),
``torch.compile`` of that same code, and the peer libraries where they have the op.

Each baseline takes the keyword arguments of ``ditops.<op>`` and returns new tensors
(the models' code is out of place). Modulation follows torch type promotion as the
models do: float32 modulation (Wan) makes the math float32, cast back at the end.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..dispatch import fp8_dtypes


def _per_token(t: Optional[torch.Tensor], x: torch.Tensor, index: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """[B, D] modulation broadcast over tokens as models write it: t[:, None]; 3-D stays. With a
    modulation_index, a table's row per token, selected as MiniMax-H3 selects it (index_select)."""
    if t is None or t.dim() < 2:
        return t
    if index is not None:
        rows = t[index] if t.dim() == 2 else torch.take_along_dim(t, index.view(-1, index.shape[-1], 1), dim=1)
        return rows if x.dim() == 3 else rows.view_as(x)
    return t.unsqueeze(1) if t.dim() == 2 and x.dim() == 3 else t


def _norm(v, weight, bias, norm, eps):
    hidden = (v.shape[-1],)
    if norm == "rms":
        return F.rms_norm(v, hidden, weight, eps)
    return F.layer_norm(v, hidden, weight, bias, eps)


def norm_scale_shift(x, scale, shift, weight=None, bias=None, norm="layer", eps=1e-6, modulation_index=None):
    y = (_norm(x, weight, bias, norm, eps) * (1 + _per_token(scale, x, modulation_index))
         + _per_token(shift, x, modulation_index))
    return y.to(x.dtype)


def residual_norm_scale_shift(x, residual, gate, scale, shift, weight=None, bias=None, norm="layer", eps=1e-6,
                              modulation_index=None):
    residual_out = (residual + _per_token(gate, x, modulation_index) * x).to(x.dtype)
    y = (_norm(residual_out, weight, bias, norm, eps) * (1 + _per_token(scale, x, modulation_index))
         + _per_token(shift, x, modulation_index))
    return y.to(x.dtype), residual_out


def _select(index, set0, set1):
    return torch.where(index.bool().unsqueeze(-1), set1.unsqueeze(1), set0.unsqueeze(1))


def norm_scale_shift_select(x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight=None, bias=None, eps=1e-6):
    y = F.layer_norm(x, (x.shape[-1],), weight, bias, eps) * (1 + _select(index, scale0, scale1)) + _select(index, shift0, shift1)
    return y.to(x.dtype), _select(index, gate0, gate1).to(x.dtype)


def residual_norm_scale_shift_select(
    x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1, weight=None, bias=None, eps=1e-6
):
    residual_out = residual + residual_gate * x
    y, gate_out = norm_scale_shift_select(residual_out, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps)
    return y, residual_out, gate_out


def _gate(gate, gate_act, x):
    gate = _per_token(gate, x)
    return torch.tanh(gate) if gate_act == "tanh" else gate


def add_gate_norm(x, branch, gate, weight=None, bias=None, norm="rms", eps=1e-5, gate_act=None):
    return (x + _gate(gate, gate_act, x) * _norm(branch, weight, bias, norm, eps)).to(x.dtype)


def add_gate_norm_scale(x, branch, gate, scale, weight=None, bias=None, weight2=None, bias2=None, norm="rms", eps=1e-5, gate_act=None):
    out = add_gate_norm(x, branch, gate, weight, bias, norm, eps, gate_act)
    return out, (_norm(out, weight2, bias2, norm, eps) * (1 + _per_token(scale, x))).to(x.dtype)


def _rotate(v, cos, sin, interleaved):
    """RoPE on the first 2 * cos.shape[-1] dims of v, in float32 as model code does."""
    rotary = 2 * cos.shape[-1]
    head, rest = v[..., :rotary].float(), v[..., rotary:]
    if interleaved:
        first, second = head[..., 0::2], head[..., 1::2]
        rotated = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1).flatten(-2)
    else:
        first, second = head.chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((rotated.to(v.dtype), rest), dim=-1)


def _angles(q, cos_sin_cache, positions, position_offset):
    """cos and sin per token as models take them from their tables: the tokens' rows (a slice,
    or the rows at positions), a [P, R] row broadcast over the heads or a [P, H, R] row per head
    ([B, P, H, R]: a table per batch item, or one for every item)."""
    if positions is None:
        rows = cos_sin_cache.narrow(0 if cos_sin_cache.dim() == 2 else -3, position_offset, q.shape[-3])
    elif cos_sin_cache.dim() == 4:
        rows = torch.take_along_dim(cos_sin_cache, torch.atleast_2d(positions.long())[..., None, None], dim=1)
    else:
        rows = cos_sin_cache[positions]
    cos, sin = rows.chunk(2, dim=-1)
    return (cos.unsqueeze(-2), sin.unsqueeze(-2)) if cos_sin_cache.dim() == 2 else (cos, sin)


def rope_(q, k, cos_sin_cache, positions=None, interleaved=True, rotary_dim=None, position_offset=0):
    cos, sin = _angles(q, cos_sin_cache, positions, position_offset)
    return _rotate(q, cos, sin, interleaved), _rotate(k, cos, sin, interleaved)


def qk_norm_rope_(q, k, q_weight, k_weight, cos_sin_cache, positions=None, interleaved=True, rotary_dim=None, eps=1e-6,
                  position_offset=0, norm_over="head", norm="rms", q_bias=None, k_bias=None):
    cos, sin = _angles(q, cos_sin_cache, positions, position_offset)

    def normalized(t, weight, bias):  # Wan's WanAttnProcessor (norm_over="token"): over the projection's H * Dh, then heads
        return _norm(t.flatten(-2) if norm_over == "token" else t, weight, bias, norm, eps).view(t.shape)

    q, k = normalized(q, q_weight, q_bias), normalized(k, k_weight, k_bias)
    return _rotate(q, cos, sin, interleaved), _rotate(k, cos, sin, interleaved)


def _quantize(v, fp8_dtype, static_scale):
    """Rowwise FP8 as torchao's dynamic per-row activation quantisation writes it: the row's
    amax in the activations' dtype, a float32 scale, the values divided, clamped and cast."""
    fp8_dtype = fp8_dtype or fp8_dtypes(v.device)[0]
    fmax = torch.finfo(fp8_dtype).max
    if static_scale is None:
        scale = v.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / fmax
    else:
        scale = static_scale.float().reshape(1).expand(*v.shape[:-1], 1)
    return (v.float() / scale).clamp(-fmax, fmax).to(fp8_dtype), scale


def norm_scale_shift_fp8(x, scale, shift, weight=None, bias=None, norm="layer", eps=1e-6, fp8_dtype=None,
                         static_scale=None, modulation_index=None):
    return _quantize(norm_scale_shift(x, scale, shift, weight, bias, norm, eps, modulation_index), fp8_dtype, static_scale)


def residual_norm_scale_shift_fp8(x, residual, gate, scale, shift, weight=None, bias=None, norm="layer", eps=1e-6,
                                  fp8_dtype=None, static_scale=None, modulation_index=None):
    y, residual_out = residual_norm_scale_shift(x, residual, gate, scale, shift, weight, bias, norm, eps, modulation_index)
    return (*_quantize(y, fp8_dtype, static_scale), residual_out)


def quantize_fp8(x, activation=None, prefix=None, fp8_dtype=None, static_scale=None):
    v = F.gelu(x, approximate="tanh") if activation == "gelu_tanh" else x
    return _quantize(torch.cat([prefix, v], -1) if prefix is not None else v, fp8_dtype, static_scale)


def norm_scale_shift_select_fp8(x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight=None, bias=None, eps=1e-6,
                                fp8_dtype=None, static_scale=None):
    y, gate_out = norm_scale_shift_select(x, index, scale0, shift0, gate0, scale1, shift1, gate1, weight, bias, eps)
    return (*_quantize(y, fp8_dtype, static_scale), gate_out)


def residual_norm_scale_shift_select_fp8(x, residual, residual_gate, index, scale0, shift0, gate0, scale1, shift1, gate1,
                                         weight=None, bias=None, eps=1e-6, fp8_dtype=None, static_scale=None):
    y, residual_out, gate_out = residual_norm_scale_shift_select(x, residual, residual_gate, index, scale0, shift0, gate0,
                                                                 scale1, shift1, gate1, weight, bias, eps)
    return (*_quantize(y, fp8_dtype, static_scale), residual_out, gate_out)


def add_gate_norm_scale_fp8(x, branch, gate, scale, weight=None, bias=None, weight2=None, bias2=None, norm="rms", eps=1e-5,
                            gate_act=None, fp8_dtype=None, static_scale=None):
    out, y = add_gate_norm_scale(x, branch, gate, scale, weight, bias, weight2, bias2, norm, eps, gate_act)
    return (*_quantize(y, fp8_dtype, static_scale), out)


EAGER = {
    function.__name__: function
    for function in (
        norm_scale_shift,
        residual_norm_scale_shift,
        norm_scale_shift_fp8,
        residual_norm_scale_shift_fp8,
        quantize_fp8,
        norm_scale_shift_select,
        residual_norm_scale_shift_select,
        norm_scale_shift_select_fp8,
        residual_norm_scale_shift_select_fp8,
        add_gate_norm,
        add_gate_norm_scale,
        add_gate_norm_scale_fp8,
        qk_norm_rope_,
        rope_,
    )
}


# Peer libraries. Each adapter returns None where the library has no equivalent of the call.


def _liger_functional():
    return importlib.import_module("liger_kernel.transformers.functional")


def liger(op: str, arguments: dict) -> Optional[Callable]:
    """Liger-Kernel's closest op for this call: LayerNorm (then torch modulation), its modulated
    RMSNorm, or its RoPE (NeoX layout, q/k as [B, H, S, Dh] views); None where it has none."""
    functional = _liger_functional()
    if arguments.get("modulation_index") is not None:  # no table form
        return None
    if op == "norm_scale_shift" and arguments.get("norm", "layer") == "rms":
        x, scale, shift = arguments["x"], arguments["scale"], arguments["shift"]
        weight = arguments.get("weight")
        if weight is None or scale.dim() != 2:
            return None
        return lambda: functional.liger_modulated_rms_norm(x, weight, scale, shift, 1e-6, in_place=False)
    if op == "norm_scale_shift":
        x, scale, shift = arguments["x"], arguments["scale"], arguments["shift"]
        hidden = x.shape[-1]
        weight = arguments.get("weight")
        weight = weight if weight is not None else torch.ones(hidden, device=x.device, dtype=x.dtype)
        bias = arguments.get("bias")
        bias = bias if bias is not None else torch.zeros(hidden, device=x.device, dtype=x.dtype)
        scale, shift = _per_token(scale, x), _per_token(shift, x)
        return lambda: (functional.liger_layer_norm(x, weight, bias, 1e-6) * (1 + scale) + shift).to(x.dtype)
    if (op == "rope_" and not arguments.get("interleaved", True) and arguments["q"].dim() == 3
            and arguments["cos_sin_cache"].dim() == 2):  # liger's tables have no head axis
        q, k, cache, positions = arguments["q"], arguments["k"], arguments["cos_sin_cache"], arguments.get("positions")
        cos, sin = (half.repeat(1, 2) for half in cache.chunk(2, dim=-1))  # NeoX: full-width cos/sin
        cos, sin = (table[positions].unsqueeze(0) for table in (cos, sin)) if positions is not None else (cos, sin)
        q_view, k_view = q.unsqueeze(0).transpose(1, 2), k.unsqueeze(0).transpose(1, 2)  # [1, H, T, Dh] views

        def rotate():
            functional.liger_rope(q_view, k_view, cos, sin)  # writes q and k in place, through the views
            return q, k

        return rotate
    return None


PEERS = {"liger": ("liger_kernel", liger), "flashinfer": ("flashinfer", None)}
"""Peer name -> (module, adapter). FlashInfer has no adapter yet: it is reported, not timed."""

DISTRIBUTIONS = {"liger_kernel": "liger-kernel", "flashinfer": "flashinfer-python"}


def _distribution_version(module: str) -> str:
    try:
        return importlib.metadata.version(DISTRIBUTIONS.get(module, module))
    except importlib.metadata.PackageNotFoundError:
        return "installed"


@functools.lru_cache(maxsize=None)
def peer_status() -> dict:
    """For each peer library: its version, or why it cannot be used here (looked up once per process)."""
    status = {}
    for name, (module, adapter) in PEERS.items():
        try:
            imported = importlib.import_module(module)
            version = getattr(imported, "__version__", None) or _distribution_version(module)
        except Exception as error:  # not installed, or broken: both mean "missing", with the reason
            status[name] = f"missing ({type(error).__name__}: {error})"
            continue
        status[name] = version if adapter else f"{version} (installed; no adapter written)"
    return status

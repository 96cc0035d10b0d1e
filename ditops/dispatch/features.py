"""The facts about one call that implementations' constraints may read.

A ``Features`` tuple is both what the constraints check and the key of the selection
cache, so a constraint can only read what the cache key holds.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch._subclasses.fake_tensor import is_fake

from .device import DeviceInfo, device_of

MAX_ALIGNMENT = 16  # bytes: the widest vector load any kernel uses


class Features(NamedTuple):
    device: DeviceInfo
    dtype: torch.dtype  # of the activations (x, residual, q, k)
    param_dtypes: tuple  # of the other tensors (modulation, weight, bias, cache), in argument order
    alignment: int  # largest power of two <= 16 dividing every data pointer and stride in bytes
    unit_stride: bool  # every tensor's last dimension has stride 1
    requires_grad: bool
    hidden_size: int  # D of the norm ops (quantize_fp8 with a prefix: its row's P + D), 0 for the RoPE ops
    batch_size: int  # B of the norm ops' x as [B, S, D] (1 for [N, D]), 0 for the RoPE ops
    head_size: int  # Dh of the RoPE ops, 0 for the norm ops
    rotary_dim: int  # R of the RoPE ops, 0 for the norm ops
    norm: str  # "layer", "rms", or "" for the RoPE ops
    modulation: tuple  # forms of the modulation tensors in argument order (validation.modulation)
    interleaved: bool
    traced: bool  # traced into a compiled graph (torch.compile), not called eagerly
    out_dtype: Optional[torch.dtype] = None  # the FP8 format of an *_fp8 op's output; None: outputs like x
    out_dtype_native: bool = True  # the device's hardware has that format (registry.yaml: fp8_formats)
    prefix_size: int = 0  # P of quantize_fp8's prefix, whose P columns come before x's D in each row; 0: none
    rope_cache: str = ""  # the RoPE ops' cos/sin cache: "shared" ([P, R]) or "per_head" (a row per head); "" for the norm ops
    affine: bool = False  # a norm op's call has a norm weight or bias (weight2, bias2); False for the RoPE ops


def describe(
    activations: tuple,
    params: tuple,
    *,
    hidden_size: int = 0,
    batch_size: int = 0,
    head_size: int = 0,
    rotary_dim: int = 0,
    norm: str = "",
    modulation: tuple = (),
    interleaved: bool = False,
    out_dtype: Optional[torch.dtype] = None,
    out_dtype_native: bool = True,
    prefix_size: int = 0,
    rope_cache: str = "",
    affine: bool = False,
) -> Features:
    """Features of a call; ``params`` may hold None for absent optional tensors."""
    # This runs on every eager call: each tensor attribute is read once, in one loop.
    address_bits = 0  # OR of every data pointer and stride in bytes: its lowest set bit is their alignment
    unit_stride = True
    grad_enabled = torch.is_grad_enabled()
    # traced: by Dynamo, or a graph node's body run on fake tensors (ops.py: <op>_traced)
    tracing = torch.compiler.is_compiling() or is_fake(activations[0])
    requires_grad = False
    param_dtypes = []
    first_param = len(activations)
    for position, t in enumerate(activations + params):
        if t is None:
            continue
        strides = t.stride()
        if not tracing:  # traced by torch.compile there are no data pointers and strides may be symbolic: see below
            address_bits |= t.data_ptr()
            if len(strides) > 1:
                element_size = t.element_size()
                for stride in strides[:-1]:
                    address_bits |= stride * element_size
        if strides and strides[-1] != 1 and t.shape[-1] > 1:
            unit_stride = False
        if grad_enabled and t.requires_grad:
            requires_grad = True
        if position >= first_param:
            param_dtypes.append(t.dtype)
    # Under torch.compile tracing, pointers are unknown and strides may be symbolic (dynamic
    # shapes): the call is taken as aligned, with no guard on any stride. Sound because only
    # the cuda/rocm entries ask for alignment, and those run as library ops that dispatch
    # again on every call with the real pointers and strides: a misaligned view still lands
    # on a backend that takes it. Triton, traced into Inductor's code, accepts any alignment
    # (Inductor specializes the kernel on the pointers it passes).
    alignment = min(address_bits & -address_bits, MAX_ALIGNMENT) if address_bits else MAX_ALIGNMENT
    first = activations[0]
    fields = (
        device_of(first.get_device()),
        first.dtype,
        tuple(param_dtypes),
        alignment,
        unit_stride,
        requires_grad,
        hidden_size,
        batch_size,
        head_size,
        rotary_dim,
        norm,
        modulation,
        interleaved,
        tracing,
        out_dtype,
        out_dtype_native,
        prefix_size,
        rope_cache,
        affine,
    )
    return tuple.__new__(Features, fields)  # skips NamedTuple.__new__'s keyword handling: 3x faster

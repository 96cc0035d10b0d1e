"""Capability checks: each YAML constraint key names one check.

A check takes the value written in the YAML and the call's ``Features`` and returns
None when the call is acceptable, else a short reason a user can act on. Adding a
kind of constraint means adding one function here and using its key in the YAML.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .features import Features

Reason = Optional[str]


def _dtype_names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def devices(wanted: list, f: Features) -> Reason:
    if f.device.vendor not in wanted:
        return f"runs on {', '.join(wanted)}, not {f.device.vendor}"


def min_sm(wanted: int, f: Features) -> Reason:
    if f.device.vendor == "cuda" and f.device.sm < wanted:
        return f"needs sm_{wanted} or newer, got {f.device.arch}"


def archs(wanted: list, f: Features) -> Reason:
    if f.device.vendor == "rocm" and f.device.arch not in wanted:
        return f"supports AMD {', '.join(wanted)}, not {f.device.arch}"


def dtypes(wanted: list, f: Features) -> Reason:
    if f.dtype not in wanted:
        return f"activations must be {_dtype_names(wanted)}, got {_dtype_names([f.dtype])}"


def param_dtypes(wanted: list, f: Features) -> Reason:
    refused = sorted({d for d in f.param_dtypes if d not in wanted}, key=str)
    if refused:
        return f"modulation/weight/cache tensors must be {_dtype_names(wanted)}, got {_dtype_names(refused)}"


def alignment(wanted: int, f: Features) -> Reason:
    if f.alignment < wanted:
        return f"needs {wanted}-byte aligned data pointers and strides, got {f.alignment}-byte alignment"


def unit_stride(wanted: bool, f: Features) -> Reason:
    if wanted and not f.unit_stride:
        return "needs every tensor's last dimension to have stride 1"


def uniform_param_dtype(wanted: bool, f: Features) -> Reason:
    if wanted and len(set(f.param_dtypes)) > 1:
        return f"needs modulation/weight tensors of one dtype, got {_dtype_names(sorted(set(f.param_dtypes), key=str))}"


def hidden_multiple_of(wanted: int, f: Features) -> Reason:
    if f.hidden_size % wanted:
        return f"needs D to be a multiple of {wanted}, got D={f.hidden_size}"


def min_hidden_size(wanted: int, f: Features) -> Reason:
    if f.hidden_size < wanted:
        return f"is preferred for D >= {wanted} only, got D={f.hidden_size}"


def max_hidden_size(wanted: int, f: Features) -> Reason:
    if f.hidden_size > wanted:
        return f"supports D <= {wanted}, got D={f.hidden_size}"


def head_sizes(wanted: list, f: Features) -> Reason:
    if f.head_size not in wanted:
        return f"supports Dh in {wanted}, got Dh={f.head_size}"


def head_size_multiple_of(wanted: int, f: Features) -> Reason:
    if f.head_size % wanted:
        return f"needs Dh to be a multiple of {wanted}, got Dh={f.head_size}"


def rotary_dim_multiple_of(wanted: int, f: Features) -> Reason:
    if f.rotary_dim % wanted:
        return f"needs R (rotary_dim) to be a multiple of {wanted}, got R={f.rotary_dim}"


def max_head_size(wanted: int, f: Features) -> Reason:
    if f.head_size > wanted:
        return f"supports Dh <= {wanted}, got Dh={f.head_size}"


def full_rotary(wanted: bool, f: Features) -> Reason:
    if wanted and f.rotary_dim != f.head_size:
        return f"needs rotary_dim == Dh, got R={f.rotary_dim}, Dh={f.head_size}"


def norms(wanted: list, f: Features) -> Reason:
    if f.norm and f.norm not in wanted:
        return f"supports norm in {wanted}, got {f.norm!r}"


def modulation(wanted: list, f: Features) -> Reason:
    refused = sorted(set(form for form in f.modulation if form not in wanted))
    if refused:
        return f"supports modulation forms {wanted}, got {refused}"


def layouts(wanted: list, f: Features) -> Reason:
    if f.head_size and ("interleaved" if f.interleaved else "neox") not in wanted:
        return f"supports RoPE layouts {wanted}, got {'interleaved' if f.interleaved else 'neox'}"


def autograd(wanted: bool, f: Features) -> Reason:
    if f.requires_grad and not wanted:
        return "is forward-only and an input requires grad"


CHECKS: dict = {
    check.__name__: check
    for check in (
        devices,
        min_sm,
        archs,
        dtypes,
        param_dtypes,
        uniform_param_dtype,
        alignment,
        unit_stride,
        hidden_multiple_of,
        min_hidden_size,
        max_hidden_size,
        head_sizes,
        head_size_multiple_of,
        rotary_dim_multiple_of,
        max_head_size,
        full_rotary,
        norms,
        modulation,
        layouts,
        autograd,
    )
}

DTYPE_CONSTRAINTS = ("dtypes", "param_dtypes")


def compile_constraints(constraints: dict, where: str) -> list:
    """Turns YAML constraints into (check, wanted) pairs, rejecting unknown keys and dtype names."""
    compiled = []
    for key, wanted in constraints.items():
        check: Callable = CHECKS.get(key)
        if check is None:
            raise ValueError(f"{where}: unknown constraint {key!r}; known: {', '.join(CHECKS)}")
        if key in DTYPE_CONSTRAINTS:
            wanted = [_dtype(name, where) for name in wanted]
        compiled.append((check, wanted))
    return compiled


def _dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: {name!r} is not a torch dtype")
    return dtype

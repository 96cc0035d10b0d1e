"""How the Triton kernels are launched: addressing of rows and modulation tensors, and the
launch settings per vendor from configs/triton_launch.yaml (rules, not autotuning)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import triton
import yaml

from ...dispatch.device import device_of

SETTINGS_FILE = Path(__file__).resolve().parents[2] / "configs" / "triton_launch.yaml"


@functools.lru_cache(maxsize=None)
def _settings() -> dict:
    return yaml.safe_load(SETTINGS_FILE.read_text())


def vendor_of(t: torch.Tensor) -> str:
    """"cuda" or "rocm": whose launch settings apply (a simulated device's, in tests)."""
    vendor = device_of(t.get_device()).vendor
    return vendor if vendor in ("cuda", "rocm") else "cuda"


class RowLaunch(NamedTuple):
    block: int
    num_warps: int
    rows_per_program: int


def row_launch(kernel: str, hidden: int, vendor: str) -> RowLaunch:
    """Settings of a row kernel ("modulated_norm", "selected_modulation_norm", "gated_add_norm")."""
    for entry in _settings()[kernel][vendor]:
        if hidden <= entry["max_hidden"]:
            return RowLaunch(triton.next_power_of_2(hidden), entry["num_warps"], entry["rows_per_program"])
    raise ValueError(f"no Triton launch setting for rows of {hidden}; the registry's max_hidden_size should refuse them")


class RotaryLaunch(NamedTuple):
    block_heads: int
    block_half: int
    block_rest: int
    num_warps: int


def rotary_launch(head_size: int, rotary_dim: int, heads: int, vendor: str) -> RotaryLaunch:
    entry = _settings()["rotary"][vendor]
    block_half = triton.next_power_of_2(rotary_dim // 2)
    block_rest = triton.next_power_of_2(max(head_size - rotary_dim, 1))
    per_head = 2 * block_half + (block_rest if head_size > rotary_dim else 0)
    block_heads = min(triton.next_power_of_2(heads), max(1, entry["tile_elements"] // per_head))
    return RotaryLaunch(block_heads, block_half, block_rest, entry["num_warps"])


class Rows(NamedTuple):
    """x as [B, S, D] rows: a 2-D x [N, D] is B=1, S=N."""

    batch: int
    tokens: int
    hidden: int
    batch_stride: int
    token_stride: int


def rows_of(t: torch.Tensor) -> Rows:
    if t.dim() == 2:
        return Rows(1, t.shape[0], t.shape[1], 0, t.stride(0))
    return Rows(t.shape[0], t.shape[1], t.shape[2], t.stride(0), t.stride(1))


def modulation(t: Optional[torch.Tensor], tokens: int) -> tuple:
    """A modulation tensor in any form of OPS.md as (tensor, batch_stride, group_stride,
    group_size, dim_stride) for row_math.load_modulation. A size-1 dimension gets stride 0,
    so [], [1], [D], [1, D], [B, D], [B, 1, D], [1, S, D], [B, S, D] and [B, F, 1, D] all fit."""
    if t is None:
        return (None, 0, 0, 1, 0)
    shape, strides = t.shape, t.stride()
    stride = lambda dim: strides[dim] if shape[dim] > 1 else 0  # noqa: E731
    if t.dim() <= 1:
        return (t, 0, 0, 1, stride(0) if t.dim() == 1 else 0)
    if t.dim() == 2:
        return (t, stride(0), 0, 1, stride(1))
    if t.dim() == 3:
        return (t, stride(0), stride(1), 1, stride(2))
    return (t, stride(0), stride(1), tokens // shape[1], stride(3))

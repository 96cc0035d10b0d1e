"""How the Triton kernels are launched: addressing of rows and modulation tensors, and the
launch settings per vendor from configs/triton_launch.yaml (rules, not autotuning)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

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


def _power_of_two_at_most(n: int) -> int:
    """The largest power of two not above n (n >= 1): a tile that fits, as tl.arange needs."""
    return 1 << (n.bit_length() - 1)


class RowLaunch(NamedTuple):
    block: int  # the head tile: the largest power of two not above D
    tail: int  # the tail tile: the next power of two of D - block (1, all masked, where D is one)
    num_warps: int
    rows_per_program: int


def row_launch(kernel: str, hidden: int, vendor: str) -> RowLaunch:
    """Settings of a row kernel ("modulated_norm", "selected_modulation_norm", "gated_add_norm")."""
    block = _power_of_two_at_most(hidden)
    tail = triton.next_power_of_2(hidden - block) if hidden > block else 1
    for entry in _settings()[kernel][vendor]:
        if hidden <= entry["max_hidden"]:
            return RowLaunch(block, tail, entry["num_warps"], entry["rows_per_program"])
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
    fitting = _power_of_two_at_most(max(1, entry["tile_elements"] // per_head))
    block_heads = min(triton.next_power_of_2(heads), fitting)
    return RotaryLaunch(block_heads, block_half, block_rest, entry["num_warps"])

"""How the Triton kernels are launched: addressing of rows and modulation tensors, and the
launch settings per vendor from configs/triton_launch.yaml (rules, not autotuning)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import yaml

from ...dispatch.device import device_of, warp_size_of

SETTINGS_FILE = Path(__file__).resolve().parents[2] / "configs" / "triton_launch.yaml"


@functools.lru_cache(maxsize=None)
def _settings() -> dict:
    return yaml.safe_load(SETTINGS_FILE.read_text())


def settings_of(t: torch.Tensor) -> tuple:
    """Whose launch settings apply to t's device (a simulated device's, in tests), most
    specific first: the device class whose name is part of the GPU's name, if the settings
    have one ("H200"), then the vendor ("cuda" or "rocm"). A kernel takes the first of these
    it has an entry for."""
    device = device_of(t.get_device())
    vendor = device.vendor if device.vendor in ("cuda", "rocm") else "cuda"
    classes = [name for name in _settings()["device_classes"].get(vendor, ()) if name in device.name]
    return (*classes[:1], vendor)


def _entry(name: str, owners: tuple):
    """The setting `name` of the first owner (settings_of) that has its own."""
    table = _settings()[name]
    return table[next(owner for owner in owners if owner in table)]


def _power_of_two_at_most(n: int) -> int:
    """The largest power of two not above n (n >= 1): a tile that fits, as tl.arange needs."""
    return 1 << (n.bit_length() - 1)


class RowLaunch(NamedTuple):
    block: int  # the head tile: the largest power of two not above D
    tail: int  # the tail tile: the next power of two of D - block (1, all masked, where D is one)
    num_warps: int
    rows_per_program: int
    early_loads: bool  # every load issued before the first store (row_math.py)


def row_launch(kernel: str, rows: int, hidden: int, owners: tuple) -> RowLaunch:
    """Settings of a row kernel ("modulated_norm", "selected_modulation_norm", "gated_add_norm")
    for rows of D = hidden on a device whose settings are owners' (settings_of). num_warps and
    rows_per_program, which set how a row is reduced, depend on D and the device alone;
    early_loads, which only reorders loads, also on the number of rows."""
    block = _power_of_two_at_most(hidden)
    tail = triton.next_power_of_2(hidden - block) if hidden > block else 1
    early_loads = rows <= _entry("early_loads_max_rows", owners)
    for entry in _entry(kernel, owners):
        if hidden <= entry["max_hidden"]:
            return RowLaunch(block, tail, entry["num_warps"], entry["rows_per_program"], early_loads)
    raise ValueError(f"no Triton launch setting for rows of {hidden}; the registry's max_hidden_size should refuse them")


class RotaryLaunch(NamedTuple):
    q_block_heads: int
    k_block_heads: int
    block_half: int
    block_rest: int
    num_warps: int


def rotary_launch(head_size: int, rotary_dim: int, q_heads: int, k_heads: int, element_size: int, owners: tuple) -> RotaryLaunch:
    """A head block for q and one for k (k_heads 0: no k). A token's heads go in one pass when
    their tile holds at most one_pass_elements values, else in blocks of about tile_elements.
    A block is never narrower than what gives every thread a 16-byte load of a half-head
    tile: on an H200 a k block of 2 heads (GQA, Dh 96) made rope_ 14% slower than one of 16,
    its masked heads costing no memory traffic."""
    entry = _entry("rotary", owners)
    block_half = triton.next_power_of_2(rotary_dim // 2)
    block_rest = triton.next_power_of_2(max(head_size - rotary_dim, 1))
    per_head = 2 * block_half + (block_rest if head_size > rotary_dim else 0)
    fitting = _power_of_two_at_most(max(1, entry["tile_elements"] // per_head))
    threads = entry["num_warps"] * warp_size_of(owners[-1])
    vector = min(fitting, triton.next_power_of_2(-(-threads * (16 // element_size) // block_half)))

    def block_heads(heads: int) -> int:
        whole = triton.next_power_of_2(max(heads, 1))
        block = whole if whole * per_head <= entry["one_pass_elements"] else min(whole, fitting)
        return max(block, vector)

    return RotaryLaunch(block_heads(q_heads), block_heads(k_heads), block_half, block_rest, entry["num_warps"])

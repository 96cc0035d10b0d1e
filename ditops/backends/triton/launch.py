"""How the Triton kernels are launched: addressing of rows and modulation tensors, and the
launch settings per vendor from configs/triton_launch.yaml (rules, not autotuning)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import yaml

from ...dispatch.device import MAX_GRID_Y, device_of, multiprocessors, warp_size_of

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


def _head_and_tail(n: int) -> tuple:
    """n (>= 1) values as a head tile, the largest power of two not above n, and a tail tile,
    the next power of two of what is left (0 where nothing is): no tile more than half padding."""
    head = _power_of_two_at_most(n)
    return head, triton.next_power_of_2(n - head) if n > head else 0


def row_tiles(hidden: int) -> tuple:
    """The head and tail tiles (row_math.py) of rows of D = hidden: _head_and_tail's, with a
    tail of 1, all masked, where the head holds the row (the row kernels always have a tail);
    D = 0 (quantize_fp8's x or prefix beside a part that is not empty) has one masked column."""
    block, tail = _head_and_tail(max(hidden, 1))
    return block, tail or 1


# The launch table's row kernel entries (row_launch's ``kernel``). FP8 calls take "<kernel>_fp8"
# (triton/__init__.py's _table), but the select kernel's residual form, whose FP8 calls measured
# best at its bf16 entries; row_quantize stores FP8 rows only.
ROW_TABLES = ("modulated_norm", "residual_norm", "selected_modulation_norm", "gated_add_norm", "row_quantize",
              "modulated_norm_fp8", "residual_norm_fp8", "selected_modulation_norm_fp8", "gated_add_norm_fp8")


class RowLaunch(NamedTuple):
    block: int  # the head tile: the largest power of two not above D
    tail: int  # the tail tile: the next power of two of D - block (1, all masked, where D is one)
    num_warps: int
    rows_per_program: int
    fold: bool  # a row's sums and maxima folded over its two tiles before one reduction (row_math.row_sum)
    early_loads: bool  # every load issued before the first store (row_math.py)
    programs_per_sm: int  # a row loop (row_loop below) of this many programs per SM; 0: none
    stages: int  # how many blocks of rows a row loop's loads run ahead, plus one


def row_launch(kernel: str, rows: int, hidden: int, owners: tuple) -> RowLaunch:
    """Settings of a row kernel (an entry of ROW_TABLES: "modulated_norm", its residual form
    "residual_norm", "selected_modulation_norm", "gated_add_norm", "row_quantize", "<kernel>_fp8")
    for rows of D = hidden on a device whose settings are owners' (settings_of). num_warps,
    rows_per_program and fold_reductions, which set how a row is reduced, depend on D and the device alone;
    early_loads and the row loop (row_grid), which only reorder loads and programs, also on
    the number of rows."""
    block, tail = row_tiles(hidden)
    early_loads = rows <= _entry("early_loads_max_rows", owners)
    for entry in _entry(kernel, owners):
        if hidden <= entry["max_hidden"]:
            loop = entry.get("row_loop")
            reduction = (entry["num_warps"], entry["rows_per_program"], entry.get("fold_reductions", False))
            if loop is None or not loop.get("min_rows", 0) <= rows <= loop.get("max_rows", rows):
                return RowLaunch(block, tail, *reduction, early_loads, 0, 1)
            return RowLaunch(block, tail, *reduction, early_loads, loop["programs_per_sm"], loop["stages"])
    raise ValueError(f"no Triton launch setting for rows of {hidden}; the registry's max_hidden_size should refuse them")


class RowGrid(NamedTuple):
    grid: tuple  # (programs per batch item, batch items)
    hoist: bool  # the modulation loaded once per program, before its loop over blocks
    stages: int


def row_grid(launch: RowLaunch, x: torch.Tensor, batch: int, tokens: int, invariant: bool) -> RowGrid:
    """How a row kernel's programs cover batch x tokens rows. By default a program per block of
    rows_per_program tokens. Where the launch table gives the kernel a row loop on this device
    and the modulation is the same for every token of a batch item (``invariant``: per-batch
    vectors, as in FLUX, Wan and Qwen-Image), programs_per_sm programs per SM, split over the
    batch items, each loop over blocks of rows with the modulation loaded once and held in
    registers, while Triton pipelines the loop's loads ``stages`` deep through shared memory
    (tl.range num_stages: the next blocks' rows are in flight while one is reduced). Every row
    is computed by the same operations either way, so the grid never changes a result."""
    if batch > MAX_GRID_Y:
        raise ValueError(f"x: got {batch} batch items; the Triton row kernels take at most {MAX_GRID_Y}")
    blocks = -(-tokens // launch.rows_per_program)
    if not (launch.programs_per_sm and invariant):
        return RowGrid((blocks, batch), False, 1)
    programs = -(-launch.programs_per_sm * multiprocessors(x) // batch)
    return RowGrid((min(blocks, programs), batch), True, launch.stages)


class RotaryLaunch(NamedTuple):
    q_block_heads: int
    k_block_heads: int
    half_head: int  # the rotated pairs' head tile: the largest power of two not above R/2
    half_tail: int  # their tail tile: the next power of two of R/2 - half_head; 0: none
    block_rest: int
    num_warps: int
    split: bool  # a program for a token's q heads and one for its k heads (rotary.py); only with k
    store_eviction: str  # q_out and k_out stored with this cache eviction policy ("": the default)


def rotary_launch(head_size: int, rotary_dim: int, q_heads: int, k_heads: int, element_size: int, tokens: int,
                  owners: tuple, token_norm: bool = False, layer_norm: bool = False) -> RotaryLaunch:
    """A head block for q and one for k (k_heads 0: no k). A token's heads go in one pass when
    their tile holds at most one_pass_elements values, else in blocks of about tile_elements.
    A block is never narrower than what gives every thread a 16-byte load of the head tile of
    its pairs: on an H200 a k block of 2 heads (GQA, Dh 96) made rope_ 14% slower than one of
    16, its masked heads costing no memory traffic. A head whose pairs have a tail tile runs at
    tail_num_warps (the launch table has the numbers). Calls with k of at most split_max_tokens
    tokens give q and k a program each (split), which only spreads the same operations over
    more programs. Calls of evict_first_stores' token range store with evict_first: a cache
    hint, the same operations and bits. token_norm (an RMSNorm over all heads of a token): each
    tensor's heads in one block whatever its size, at the num_warps of the first token_norm
    class whose max_hidden is at least the call's D, the wider of Hq * Dh and Hk * Dh. layer_norm
    (norm="layer"): the entry's layer_norm settings, where it has them, replace its own."""
    entry = _entry("rotary", owners)
    if layer_norm:
        entry = {**entry, **entry.get("layer_norm", {})}
    half_head, half_tail = _head_and_tail(rotary_dim // 2)
    block_rest = triton.next_power_of_2(max(head_size - rotary_dim, 1))
    per_head = 2 * (half_head + half_tail) + (block_rest if head_size > rotary_dim else 0)
    fitting = _power_of_two_at_most(max(1, entry["tile_elements"] // per_head))
    num_warps = entry["tail_num_warps"] if half_tail else entry["num_warps"]
    threads = num_warps * warp_size_of(owners[-1])
    vector = min(fitting, triton.next_power_of_2(-(-threads * (16 // element_size) // half_head)))

    def block_heads(heads: int) -> int:
        whole = triton.next_power_of_2(max(heads, 1))
        block = whole if token_norm or whole * per_head <= entry["one_pass_elements"] else min(whole, fitting)
        return max(block, vector)

    if token_norm:  # the registry's max_hidden_size keeps D within the last class
        width = max(q_heads, k_heads) * head_size
        num_warps = next(c["num_warps"] for c in entry["token_norm"] if width <= c["max_hidden"])

    streamed = entry.get("evict_first_stores")
    evict_first = streamed is not None and streamed["min_tokens"] <= tokens <= streamed["max_tokens"]
    return RotaryLaunch(block_heads(q_heads), block_heads(k_heads), half_head, half_tail, block_rest, num_warps,
                        k_heads > 0 and tokens <= entry["split_max_tokens"], "evict_first" if evict_first else "")

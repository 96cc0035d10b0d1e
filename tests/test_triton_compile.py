"""Ahead-of-time compilation of every Triton kernel specialization the registry can select,
for NVIDIA (sm_80, sm_90) and AMD (gfx90a, gfx942, gfx950), with no GPU: real machine code
(cubin / hsaco) must come out. That takes minutes per arch on a CPU: it runs under
``-m exhaustive``; the default run compiles one specialization of each kernel for sm_90.

The specializations are found by running the backend's launch code on every conformance
case and dtype, on a simulated device of each vendor, with the kernels replaced by a
recorder: what the launch code would launch is what is compiled.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

import ditops.backends.triton as triton_backend
from ditops import conformance
from conftest import script_module
from ditops.backends.triton import launch, row_math
from ditops.dispatch import current_device, fp8_dtypes, simulated_device
from ditops.examples import example_arguments
from ditops.ops import OPS, ordered_arguments
from ditops.opspec import SPECS

KERNELS = ("modulated_norm_kernel", "selected_modulation_norm_kernel", "gated_add_norm_kernel", "rotary_kernel",
           "row_quantize_kernel")
TARGETS = {
    "sm_80": (GPUTarget("cuda", 80, 32), "cuda", "cubin"),
    "sm_90": (GPUTarget("cuda", 90, 32), "cuda", "cubin"),
    "gfx90a": (GPUTarget("hip", "gfx90a", 64), "rocm", "hsaco"),
    "gfx942": (GPUTarget("hip", "gfx942", 64), "rocm", "hsaco"),
    "gfx950": (GPUTarget("hip", "gfx950", 64), "rocm", "hsaco"),
}
POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.bool: "*i1",
    torch.uint8: "*u8",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e4m3fnuz: "*fp8e4b8",
}


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records instead of launching."""

    def __init__(self, kernel, found: set):
        self.kernel, self.found = kernel, found

    def __getitem__(self, grid):
        return functools.partial(self._record)

    def _record(self, *args, num_warps=4, **constexprs):
        signature, constants = {}, dict(constexprs)
        parameters = inspect.signature(self.kernel.fn).parameters
        for name, value in zip(self.kernel.arg_names, args):
            if parameters[name].annotation in (tl.constexpr, "tl.constexpr"):  # a constexpr passed by position
                signature[name], constants[name] = "constexpr", value
            elif value is None:
                signature[name], constants[name] = "constexpr", None
            elif isinstance(value, torch.Tensor):
                signature[name] = POINTER_TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i64" if abs(value) >= 2**31 else "i32"
            else:
                signature[name] = "fp32"
        for name in constexprs:
            signature[name] = "constexpr"
        self.found.add((self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__,
                        tuple(signature.items()), tuple(sorted(constants.items(), key=lambda item: item[0])), num_warps))


@contextlib.contextmanager
def launch_table(**changes):
    """The launch table with some of its top-level entries replaced."""
    settings = {**launch._settings(), **changes}
    original, launch._settings = launch._settings, lambda: settings
    try:
        yield
    finally:
        launch._settings = original


def _launch_every_case(dtypes=conformance.DTYPES, ops=OPS, device="cpu"):
    """Runs the backend's op function on each conformance case of ops in each dtype; yields
    (case, dtype, the tensors it wrote: its outputs, or q and k for the in-place RoPE ops).
    The FP8 ops' cases run where the device has an FP8 format (their check refuses the others)."""
    has_fp8 = bool(fp8_dtypes(current_device()))
    for case in conformance.CASES:
        if case.op not in ops or (SPECS[case.op].quantized and not has_fp8):
            continue
        for dtype in dtypes:
            arguments, _ = ordered_arguments(case.op, **case.arguments(dtype, device))
            if OPS[case.op].check(*arguments) is None:
                continue  # empty input: nothing is launched
            outputs = OPS[case.op].outputs(*arguments)
            getattr(triton_backend, case.op)(*arguments, *outputs)
            yield case, dtype, tuple(t for t in arguments[:2] if t is not None) if OPS[case.op].in_place else outputs


def long_calls() -> dict:
    """Launch-table entries giving conformance cases (short calls) the long calls' launches:
    the row kernels' late loads, one rotary program per token and, where a vendor's table has
    them, the rotary kernel's evict_first stores."""
    def long(entry: dict) -> dict:
        streamed = {"evict_first_stores": {"min_tokens": 0, "max_tokens": 2**62}} if "evict_first_stores" in entry else {}
        return dict(entry, split_max_tokens=0, **streamed)

    rotary = {owner: long(entry) for owner, entry in launch._settings()["rotary"].items()}
    return dict(early_loads_max_rows={"cuda": 0, "rocm": 0}, rotary=rotary)


def every_entry_with(kernels: tuple, **changes) -> dict:
    """Launch-table entries of the kernels' tables, every entry of every device with changes."""
    return {kernel: {owner: [dict(entry, **changes) for entry in entries]
                     for owner, entries in launch._settings()[kernel].items()}
            for kernel in kernels}


def row_loop_everywhere(programs_per_sm: int, stages: int) -> dict:
    """Launch-table entries giving every row kernel a row loop on every device (launch.row_grid;
    row_quantize's launch has none and ignores it)."""
    return every_entry_with(launch.ROW_TABLES, row_loop=dict(programs_per_sm=programs_per_sm, stages=stages,
                                                             max_rows=2**62))


@functools.lru_cache(maxsize=None)
def specializations(arch: str) -> tuple:
    """The specializations the launch code gives every conformance case on a simulated ``arch``."""
    found: set = set()
    originals = {name: getattr(triton_backend, name) for name in KERNELS}
    try:
        for name, kernel in originals.items():
            setattr(triton_backend, name, _Recorder(kernel, found))
        vendor = "cuda" if arch.startswith("sm_") else "rocm"
        with simulated_device(arch):
            # as tabled; with the long calls' launches (conformance cases are all short calls);
            # with a row loop (pipelined, modulation hoisted) on every row kernel where the vendor's
            # launch table has row loops (NVIDIA), and with folded reductions in every modulated-norm
            # kernel on the architecture whose entries fold (sm_90: the H200's)
            extra = [row_loop_everywhere(2, 3)] if vendor == "cuda" else []
            extra += [folded_everywhere()] if arch == "sm_90" else []
            for table in ({}, long_calls(), *extra):
                with launch_table(**table):
                    for _ in _launch_every_case():
                        pass
    finally:
        for name, kernel in originals.items():
            setattr(triton_backend, name, kernel)
    return tuple(sorted(found, key=repr))


def test_every_kernel_and_option_is_exercised():
    found = specializations("sm_90")
    assert {kernel for kernel, *_ in found} == set(KERNELS)
    constants = [dict(constants) for _, _, constants, _ in found]
    for flag in ("RMS", "HAS_RESIDUAL", "HAS_GATE", "HAS_WEIGHT", "HAS_BIAS", "TANH_GATE", "HAS_SCALE", "NORM", "INTERLEAVED",
                 "HAS_POSITIONS", "HAS_K", "EARLY_LOADS", "HOIST", "SPLIT", "QUANT", "HAS_STATIC_SCALE", "GELU", "TABLE",
                 "LAYER", "HAS_Q_BIAS", "HAS_K_BIAS", "HEAD_CACHE", "FOLD"):
        assert {c[flag] for c in constants if flag in c} == {True, False}, flag


def _compile_ahead_of_time(target_name: str, found) -> None:
    """Compiles specializations for a target in a fresh process: this test session runs
    Triton's interpreter (conftest.py), whose kernels cannot be compiled, and Triton chooses
    between the two when a kernel is defined."""
    target, _, binary = TARGETS[target_name]
    work = [dict(kernel=kernel, signature=dict(signature), constants=dict(constants), num_warps=num_warps)
            for kernel, signature, constants, num_warps in found]
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("triton_aot.py")), target.backend, str(target.arch), str(target.warp_size), binary],
        input=json.dumps(work), capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="0"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("compiled ")]
    assert len(compiled) == len(work)


# A target's specializations in this many compiler processes (each some 3 s of start-up), so that
# the exhaustive run's workers finish together instead of one compiling a whole target alone.
PARTS = 3


@pytest.mark.exhaustive
@pytest.mark.parametrize("part", range(PARTS))
@pytest.mark.parametrize("target_name", TARGETS)
def test_ahead_of_time_compile(target_name, part):
    _compile_ahead_of_time(target_name, specializations(target_name)[part::PARTS])


def test_each_kernel_compiles_ahead_of_time():
    """The default run's smoke compile: one specialization of each kernel for sm_90, so that a
    Triton that cannot compile one of them fails here too."""
    first = {}
    for specialization in specializations("sm_90"):
        first.setdefault(specialization[0], specialization)
    assert set(first) == set(KERNELS)
    _compile_ahead_of_time("sm_90", first.values())


def test_float64_eps_is_computed_in_float32():
    """Inductor passes a Python float to a kernel it launches (wrap_triton) as float64, where
    Triton's own launch passes float32. The kernels cast eps to float32 first: once float64
    reached the normalisation, every value after it was float64 and the kernel ran 1.5x
    slower inside compiled graphs (H100, 2026-11-25). Compiled here with eps typed float64."""
    work = []
    for kernel, signature, constants, num_warps in specializations("sm_90"):
        signature = dict(signature)
        if "eps" in signature and kernel not in {item["kernel"] for item in work} and dict(constants).get("NORM", True):
            work.append(dict(kernel=kernel, signature=dict(signature, eps="fp64"), constants=dict(constants), num_warps=num_warps))
    assert {item["kernel"] for item in work} == set(KERNELS) - {"row_quantize_kernel"}  # the one kernel without eps
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("triton_aot.py")), "cuda", "90", "32", "ttgir"],
        input=json.dumps(work), capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="0"),
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    counts = [line for line in result.stdout.splitlines() if "float64 ops:" in line]
    assert len(counts) == len(work) and all(line.endswith("float64 ops: 0") for line in counts), result.stdout[-3000:]


def test_rotary_head_blocks(monkeypatch):
    """Each of q and k gets its own head block: all heads in one pass while that tile holds at
    most one_pass_elements values, else blocks of about tile_elements; never narrower than a
    16-byte load per thread of the pairs' head tile (a 2-head k block made GQA rope_ 14% slower).
    Pairs of a head tile and a tail tile (R/2 not a power of two) run at tail_num_warps."""
    from ditops.backends.triton import launch

    settings = {"rotary": {"cuda": {"one_pass_elements": 4096, "tile_elements": 2048, "num_warps": 4, "tail_num_warps": 2,
                                    "split_max_tokens": 512}}}
    monkeypatch.setattr(launch, "_settings", lambda: settings)
    assert launch.rotary_launch(128, 128, 24, 24, 2, 4096, ("cuda",))[:2] == (32, 32)  # 32 x 128 values: one pass
    assert launch.rotary_launch(128, 128, 48, 48, 2, 4096, ("cuda",))[:2] == (16, 16)  # 64 x 128 > 4096: 2048-value blocks
    assert launch.rotary_launch(96, 96, 16, 2, 2, 4096, ("cuda",))[:2] == (16, 16)  # bf16: 64 threads x 8 / 32 = 16 heads at least
    assert launch.rotary_launch(96, 96, 16, 2, 4, 4096, ("cuda",))[:2] == (16, 8)  # float32: 4 per 16 bytes
    assert launch.rotary_launch(64, 64, 16, 2, 2, 4096, ("cuda",))[:2] == (32, 32)  # 128 threads x 8 / 32 = 32 heads at least
    # pairs as a head tile and a tail tile: 40 = 32 + 8, 48 = 32 + 16, 64 = 64 + none; tail_num_warps with a tail
    tiles = [launch.rotary_launch(size, size, 16, 16, 2, 4096, ("cuda",)) for size in (80, 96, 128)]
    assert [(t.half_head, t.half_tail, t.num_warps) for t in tiles] == [(32, 8, 2), (32, 16, 2), (64, 0, 4)]
    assert launch.rotary_launch(256, 112, 8, 0, 2, 4096, ("cuda",))[:2] == (8, 4)  # 384 values a head: the floor stays within a tile
    # q and k get a program each in calls of at most split_max_tokens tokens
    assert [launch.rotary_launch(128, 128, 24, 24, 2, tokens, ("cuda",)).split for tokens in (1, 512, 513)] == [True, True, False]
    assert not launch.rotary_launch(128, 128, 24, 0, 2, 128, ("cuda",)).split  # rope_ without k: one program a token
    # norm="layer" takes the entry's layer_norm settings where it has them
    assert launch.rotary_launch(64, 64, 48, 48, 2, 4096, ("cuda",), layer_norm=True)[:2] == (64, 64)  # none: as RMS
    settings["rotary"]["cuda"]["layer_norm"] = {"num_warps": 2, "one_pass_elements": 2048}
    layer = launch.rotary_launch(64, 64, 48, 48, 2, 4096, ("cuda",), layer_norm=True)
    assert (layer.q_block_heads, layer.k_block_heads, layer.num_warps) == (32, 32, 2)  # 64 x 64 > 2048: 2048-value blocks
    rms = launch.rotary_launch(64, 64, 48, 48, 2, 4096, ("cuda",))
    assert (rms.q_block_heads, rms.k_block_heads, rms.num_warps) == (64, 64, 4)
    # a cache hint for the stores of calls in a token range, where the table has one
    assert {launch.rotary_launch(128, 128, 24, 24, 2, tokens, ("cuda",)).store_eviction for tokens in (1, 4096)} == {""}
    settings["rotary"]["cuda"]["evict_first_stores"] = {"min_tokens": 513, "max_tokens": 16384}
    evictions = [launch.rotary_launch(128, 128, 24, 24, 2, tokens, ("cuda",)).store_eviction for tokens in (512, 513, 16384, 16385)]
    assert evictions == ["", "evict_first", "evict_first", ""]


def test_a_device_class_takes_its_own_entries_and_its_vendors_elsewhere(monkeypatch):
    """A GPU whose name holds a device class of the launch settings uses the class's entry of
    a kernel where there is one; other GPUs of the vendor, and kernels without one, the
    vendor's. Each device's settings depend on D, never on the row count, for the reduction."""
    import dataclasses

    from ditops.dispatch.device import parse_arch

    settings = {
        "device_classes": {"cuda": ["H200"]},
        "early_loads_max_rows": {"cuda": 512, "rocm": 512},
        "modulated_norm": {"cuda": [{"max_hidden": 4096, "num_warps": 4, "rows_per_program": 1}],
                           "H200": [{"max_hidden": 4096, "num_warps": 1, "rows_per_program": 2}]},
        "gated_add_norm": {"cuda": [{"max_hidden": 4096, "num_warps": 8, "rows_per_program": 1}]},
    }
    monkeypatch.setattr(launch, "_settings", lambda: settings)
    x = torch.empty(2, 1536)
    owners = {}
    for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3", ""):
        with simulated_device(dataclasses.replace(parse_arch("sm_90"), name=name)):
            owners[name] = launch.settings_of(x)
    assert owners == {"NVIDIA H200": ("H200", "cuda"), "NVIDIA H100 80GB HBM3": ("cuda",), "": ("cuda",)}
    for rows in (1, 100000):
        assert launch.row_launch("modulated_norm", rows, 1536, owners["NVIDIA H200"])[2:4] == (1, 2)
        assert launch.row_launch("modulated_norm", rows, 1536, owners["NVIDIA H100 80GB HBM3"])[2:4] == (4, 1)
        assert launch.row_launch("gated_add_norm", rows, 1536, owners["NVIDIA H200"])[2:4] == (8, 1)
    with simulated_device("gfx942"):
        assert launch.settings_of(x) == ("rocm",)


ROW_OPS = [op for op in OPS if op not in ("qk_norm_rope_", "rope_")]


def test_early_loads_change_no_result():
    """A row's result must not depend on how many rows its call has: the row kernels' two load
    orders (chosen by row count) give the same bits on every row-op conformance case. On the
    CPU this runs in the interpreter (float32, where load order cannot matter anyway); on a
    GPU it checks the compiled kernels in every dtype."""
    on_gpu = torch.cuda.is_available()
    dtypes = conformance.DTYPES if on_gpu else (torch.float32,)
    with contextlib.nullcontext() if on_gpu else simulated_device("sm_90"):
        with launch_table(early_loads_max_rows={"cuda": 2**62, "rocm": 2**62}):
            early = list(_launch_every_case(dtypes, ROW_OPS, "cuda" if on_gpu else "cpu"))
        with launch_table(early_loads_max_rows={"cuda": 0, "rocm": 0}):
            late = list(_launch_every_case(dtypes, ROW_OPS, "cuda" if on_gpu else "cpu"))
    assert len(early) == len(late) > 0
    for (case, dtype, first), (_, _, second) in zip(early, late):
        for a, b in zip(first, second):
            assert conformance._bitwise_equal(a, b), (case.id, dtype)


def test_a_split_rotary_call_changes_no_result():
    """A short call gives a token's q and k a program each (launch.rotary_launch), a long one
    one program for both (and, in a token range, evict_first stores): the same bits on every
    RoPE conformance case, on the CPU in the interpreter (float32, bfloat16) and on a GPU in
    every dtype."""
    on_gpu = torch.cuda.is_available()
    dtypes = conformance.DTYPES if on_gpu else (torch.float32, torch.bfloat16)
    rope_ops = ["qk_norm_rope_", "rope_"]
    with contextlib.nullcontext() if on_gpu else simulated_device("sm_90"):
        split = list(_launch_every_case(dtypes, rope_ops, "cuda" if on_gpu else "cpu"))
        with launch_table(rotary=long_calls()["rotary"]):
            whole = list(_launch_every_case(dtypes, rope_ops, "cuda" if on_gpu else "cpu"))
    assert len(split) == len(whole) > 0 and all(written for *_, written in split)
    for (case, dtype, first), (_, _, second) in zip(split, whole):
        for a, b in zip(first, second):
            assert conformance._bitwise_equal(a, b), (case.id, dtype)


def test_a_row_loop_changes_no_result(monkeypatch):
    """Where a row kernel loops over blocks of rows with the modulation loaded once
    (launch.row_grid: fewer programs, Triton pipelining the loop's loads), every row is computed
    by the same operations as with one program per block: the same bits on every row-op
    conformance case. One program per batch item (as if the GPU had one multiprocessor) loops
    over all of its blocks; on a GPU the compiled kernels run in bfloat16 (every dtype compiles
    each case twice more: minutes on a GPU host)."""
    on_gpu = torch.cuda.is_available()
    dtypes = (torch.bfloat16,) if on_gpu else (torch.float32, torch.bfloat16)
    looped = []

    def recording(row_launch, x, batch, tokens, invariant):
        grid = launch.row_grid(row_launch, x, batch, tokens, invariant)
        looped.append(grid.hoist and grid.grid[0] < -(-tokens // row_launch.rows_per_program))
        return grid

    with contextlib.nullcontext() if on_gpu else simulated_device("sm_90"):
        plain = list(_launch_every_case(dtypes, ROW_OPS, "cuda" if on_gpu else "cpu"))
        monkeypatch.setattr(triton_backend, "row_grid", recording)
        monkeypatch.setattr(launch, "multiprocessors", lambda t: 1)  # conformance calls are shorter than a GPU's programs
        with launch_table(**row_loop_everywhere(1, 2)):
            loop = list(_launch_every_case(dtypes, ROW_OPS, "cuda" if on_gpu else "cpu"))
    assert any(looped), "no case looped over more than one block"
    assert len(plain) == len(loop) > 0
    for (case, dtype, first), (_, _, second) in zip(plain, loop):
        for a, b in zip(first, second):
            assert conformance._bitwise_equal(a, b), (case.id, dtype)


FOLDED_TABLES = ("modulated_norm", "residual_norm", "modulated_norm_fp8", "residual_norm_fp8", "selected_modulation_norm",
                 "selected_modulation_norm_fp8")  # the tables of the kernels that take FOLD


def folded_everywhere() -> dict:
    """Launch-table entries folding the reductions (fold_reductions) in every entry of the
    tables whose kernel takes it, on every device."""
    return every_entry_with(FOLDED_TABLES, fold_reductions=True)


FOLDED_OPS = ("norm_scale_shift", "residual_norm_scale_shift", "norm_scale_shift_select", "residual_norm_scale_shift_select")


@pytest.mark.skipif(torch.cuda.is_available(), reason="an interpreter check: on a GPU, the conformance run covers the tables' folds")
def test_folded_reductions_meet_the_oracle(monkeypatch):
    """fold_reductions (row_math.row_sum) reorders a row's sums: with it in every entry of the
    tables whose kernel takes it, every norm_scale_shift and residual_norm_scale_shift
    conformance case still meets the float64 oracle (float32 and float16 in the interpreter,
    which rounds bfloat16 its own way and converts to FP8 wrongly). The FP8 forms share these
    sums, and their folded amax is the amax (test_folded_amax_is_the_amax); the tables' own
    folds (the H200's) run in the GPU conformance run."""
    seen = []

    def recording(*arguments):
        seen.append(launch.row_launch(*arguments).fold)
        return launch.row_launch(*arguments)

    monkeypatch.setattr(triton_backend, "row_launch", recording)
    failures = []
    with simulated_device("sm_90"), launch_table(**folded_everywhere()):
        for case in conformance.CASES:
            for dtype in (torch.float32, torch.float16) if case.op in FOLDED_OPS else ():
                outcome = conformance.run_case(case, "triton", dtype, "cpu", automatic=False)
                if outcome.status == "fail":
                    failures.append(f"{case.id} {dtype}: {outcome.detail}")
    assert seen and all(seen), "the launches did not fold"
    assert not failures, "\n".join(failures)


@triton.jit
def _amax_kernel(values, out, BLOCK: tl.constexpr, TAIL: tl.constexpr, FOLD: tl.constexpr):
    rows = tl.arange(0, 2)[:, None]
    head = tl.load(values + rows * (BLOCK + TAIL) + tl.arange(0, BLOCK)[None, :])
    tail = tl.load(values + rows * (BLOCK + TAIL) + BLOCK + tl.arange(0, TAIL)[None, :])
    tl.store(out + rows, row_math.row_amax_bits(head, tail, FOLD))


@pytest.mark.parametrize("block, tail", [(64, 32), (64, 16), (32, 32), (16, 1)])
def test_folded_amax_is_the_amax(block, tail):
    """row_amax_bits folded and not: the same bits (a maximum has no order), NaN above Inf above
    every finite magnitude, whichever tile holds them."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    values = torch.randn(2, block + tail, device=device)
    values[0, block + tail - 1] = -float("inf")  # in the tail (the head's last column where tail is 1)
    values[1, 3] = float("nan")
    for fold in (False, True):
        out = torch.empty(2, 1, dtype=torch.int32, device=device)
        _amax_kernel[(1,)](values, out, BLOCK=block, TAIL=tail, FOLD=fold)
        assert out[0].item() == 0x7F800000 and out[1].item() > 0x7F800000, (fold, out)
    finite = torch.randn(2, block + tail, device=device)
    results = []
    for fold in (False, True):
        out = torch.empty(2, 1, dtype=torch.int32, device=device)
        _amax_kernel[(1,)](finite, out, BLOCK=block, TAIL=tail, FOLD=fold)
        results.append(out)
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0].view(torch.float32)[:, 0], finite.abs().amax(dim=1))


def test_row_grid_loops_only_over_invariant_modulation():
    looped = launch.RowLaunch(1024, 1, 4, 1, False, False, programs_per_sm=4, stages=3)
    plain = looped._replace(programs_per_sm=0)
    x = torch.empty(0)  # a CPU tensor counts one multiprocessor
    assert launch.row_grid(plain, x, 2, 100, True) == launch.RowGrid((100, 2), False, 1)
    assert launch.row_grid(looped, x, 2, 100, False) == launch.RowGrid((100, 2), False, 1)
    assert launch.row_grid(looped, x, 2, 100, True) == launch.RowGrid((2, 2), True, 3)  # 4 programs over 2 items
    assert launch.row_grid(looped, x, 1, 3, True) == launch.RowGrid((3, 1), True, 3)  # never more than the blocks
    with pytest.raises(ValueError, match="x: got 65536 batch items"):
        launch.row_grid(plain, x, 65536, 1, False)


def test_a_table_read_through_the_index_is_never_hoisted(monkeypatch):
    """Under a row loop, tables whose rows differ (K > 1) are read per row at the index (TABLE),
    never loaded once per program (HOIST); a table of one row, or of K rows expanded from one,
    is the same for every token: hoisted, and the index left unread."""
    monkeypatch.setattr(launch, "multiprocessors", lambda t: 1)
    x, index = torch.randn(2, 64, 256), torch.randint(0, 4, (64,))
    y = torch.empty_like(x)

    def flags(scale, shift):
        with simulated_device("sm_90"), launch_table(**row_loop_everywhere(1, 2)):
            constexprs = triton_backend.norm_scale_shift_launch(x, scale, shift, None, None, "layer", 1e-6, index, y).constexprs
        return constexprs["TABLE"], constexprs["HOIST"]

    assert flags(torch.randn(4, 256), torch.randn(256)) == (True, False)
    assert flags(torch.randn(()), torch.randn(2, 4, 256)) == (True, False)
    assert flags(torch.randn(1, 256), torch.randn(2, 1, 256)) == (False, True)
    assert flags(torch.randn(1, 256).expand(4, 256), torch.randn(256)) == (False, True)


REGISTRY_MAX_HIDDEN = 16384  # the triton row entries' max_hidden_size in configs/registry.yaml


def test_every_row_table_holds_every_row_the_registry_accepts():
    """Each row kernel's entries rise in max_hidden up to the widest row the registry lets triton
    take, for every device class and vendor: no call it accepts finds no launch setting."""
    settings = launch._settings()
    for kernel in launch.ROW_TABLES:
        for owner, entries in settings[kernel].items():
            limits = [entry["max_hidden"] for entry in entries]
            assert limits == sorted(limits) and limits[-1] >= REGISTRY_MAX_HIDDEN, (kernel, owner)


def test_fp8_calls_take_the_launch_tables_fp8_entries():
    """A call storing FP8 rows is launched by its kernel's `_fp8` entry, a bf16 call by the kernel's own."""
    x = torch.randn(1, 64, 1536, dtype=torch.bfloat16)
    scale, shift = torch.randn(1, 1536, dtype=torch.bfloat16), torch.randn(1, 1536, dtype=torch.bfloat16)
    y, y_scale = torch.empty(x.shape, dtype=torch.float8_e4m3fn), torch.empty(1, 64, 1)
    with simulated_device("sm_90"):
        owners = launch.settings_of(x)
        fp8 = triton_backend.norm_scale_shift_fp8_launch(x, scale, shift, None, None, "layer", 1e-6,
                                                         torch.float8_e4m3fn, None, None, y, y_scale)
        bf16 = triton_backend.norm_scale_shift_launch(x, scale, shift, None, None, "layer", 1e-6, None,
                                                      torch.empty_like(x))
    expected = {name: launch.row_launch(name, 64, 1536, owners).num_warps for name in ("modulated_norm_fp8", "modulated_norm")}
    assert expected["modulated_norm_fp8"] != expected["modulated_norm"]  # else this test tells nothing
    assert fp8.constexprs["num_warps"] == expected["modulated_norm_fp8"]
    assert bf16.constexprs["num_warps"] == expected["modulated_norm"]


FP8_TABLES = {"norm_scale_shift_fp8": "modulated_norm_fp8", "residual_norm_scale_shift_fp8": "residual_norm_fp8",
              "norm_scale_shift_select_fp8": "selected_modulation_norm_fp8",
              "residual_norm_scale_shift_select_fp8": "selected_modulation_norm",  # measured best at its bf16 entries
              "add_gate_norm_scale_fp8": "gated_add_norm_fp8", "quantize_fp8": "row_quantize"}


def test_each_fp8_op_takes_its_launch_table(monkeypatch):
    """Which launch table each FP8 op's Triton call reads (configs/triton_launch.yaml says why)."""
    assert set(FP8_TABLES) == {name for name, spec in SPECS.items() if spec.quantized}
    taken = []

    def recording(kernel, *args):
        taken.append(kernel)
        return launch.row_launch(kernel, *args)

    monkeypatch.setattr(triton_backend, "row_launch", recording)
    with simulated_device("sm_90"):
        for op, table in FP8_TABLES.items():
            arguments, _ = ordered_arguments(op, **example_arguments(op, (1, 64, 3072)))
            getattr(triton_backend, f"{op}_launch")(*arguments, *OPS[op].outputs(*arguments))
            assert taken[-1] == table, op


def test_a_row_loop_runs_only_for_calls_within_its_row_range():
    entry = {"max_hidden": 16384, "num_warps": 2, "rows_per_program": 1,
             "row_loop": {"programs_per_sm": 4, "stages": 3, "min_rows": 513, "max_rows": 16384}}
    with launch_table(modulated_norm={"cuda": [entry]}):
        loops = {rows: launch.row_launch("modulated_norm", rows, 3072, ("cuda",)).programs_per_sm
                 for rows in (512, 513, 16384, 16385)}
    assert loops == {512: 0, 513: 4, 16384: 4, 16385: 0}


def test_the_launch_sweep_sets_every_row_table_to_one_setting():
    """benchmarks/launch_sweep.py's table: each row kernel's entries carry the setting swept
    (its row loop or none, its fold or none), their max_hidden classes kept."""
    sweep = script_module("benchmarks/launch_sweep.py")
    settings = launch._settings()
    for loop, expected, fold in (((4, 3), (4, 3), True), ((0, 1), (0, 1), False)):
        table = sweep.table_with(settings, 2, 1, loop, fold)
        with launch_table(**table):
            for kernel in launch.ROW_TABLES:
                for owner, entries in table[kernel].items():
                    assert [e["max_hidden"] for e in entries] == [e["max_hidden"] for e in settings[kernel][owner]]
                    owners = (owner,) if owner in ("cuda", "rocm") else (owner, "cuda")  # a device class, then its vendor
                    chosen = launch.row_launch(kernel, 100, 3072, owners)
                    assert (chosen.num_warps, chosen.rows_per_program, chosen.programs_per_sm, chosen.stages,
                            chosen.fold) == (2, 1, *expected, fold), (kernel, owner)


def test_the_token_norm_sweep_gives_every_width_the_setting_swept(monkeypatch):
    """benchmarks/launch_sweep.py --token-norm: one rotary_token_norm class, block x items, up to
    the registry's widest token norm."""
    from ditops.backends import compiled

    sweep = script_module("benchmarks/launch_sweep.py")
    settings = compiled._launch_settings()
    table = sweep.token_norm_table(settings, 64, 3)
    monkeypatch.setattr(compiled, "_launch_settings", lambda: table)
    for hidden in (8, 1536, 5120, settings["rotary_token_norm"][-1]["max_hidden"]):
        instance = compiled.rotary_token_norm_instance(torch.bfloat16, True, hidden)
        assert instance.template_arguments[2:4] == (64, 3) and instance.block == 64

"""The benchmark harness's own logic, on the CPU: bytes per op, case filters, derived
columns, output files, timing helpers, an end-to-end run, and the eager baselines
against the reference.

Real model shapes are built under FakeTensorMode (shapes, strides and dtypes, no memory),
so the shape strings and byte counts of the real cases are checked without allocating them.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import toy_backends

import ditops
import ditops.backends.reference as reference
import ditops.bench as bench
from ditops.bench import baselines, report, timing
from ditops import opspec
from ditops.bench.cases import CASES, _distinct_bytes, cpu_case, minimum_bytes
from ditops.conformance import TOLERANCES
from ditops.dispatch import OPS, load_config, simulated_device

BF16, F32 = torch.bfloat16, torch.float32
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape, dtype=BF16) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


def fake_arguments(case, dtype=BF16) -> dict:
    """A case's arguments at its real shape, as fake tensors (no memory, no compute)."""
    with FakeTensorMode():
        return case.build("cpu", dtype, generator())


def clone(arguments: dict) -> dict:
    return {name: v.clone() if isinstance(v, torch.Tensor) else v for name, v in arguments.items()}


# ----------------------------------------------------------------------------------------
# 1. Bytes per op (hand-built arguments: B=2, S=3, D=8; RoPE: T=5, Hq=2, Hk=1, Dh=8)
# ----------------------------------------------------------------------------------------

X_BF16 = 2 * 3 * 8 * 2  # one [B, S, D] bf16 tensor: 96 bytes
VIEW_BF16 = 2 * 8 * 2  # one [B, D] bf16 view of a [B, 6, D] tensor: B*D elements, not B*6*D
VIEW_F32 = 2 * 1 * 8 * 4  # one [B, 1, D] float32 view of a [B, 6, D] tensor (Wan)
D_BF16 = 8 * 2  # a [D] bf16 weight or bias
INDEX = 2 * 3 * 8  # [B, S] int64


def test_distinct_bytes_of_views():
    base = randn(generator(), 4, 6, dtype=F32)
    assert _distinct_bytes(base) == 4 * 6 * 4
    assert _distinct_bytes(base[:, ::2]) == 4 * 3 * 4  # strided: (4, 3) with strides (6, 2)
    assert _distinct_bytes(base.t()) == 6 * 4 * 4  # transposed
    assert _distinct_bytes(base[:, 0].unsqueeze(1).expand(4, 5)) == 4 * 4  # stride 0 along the expanded dim
    assert _distinct_bytes(base[0].expand(7, 6)) == 6 * 4
    assert _distinct_bytes(randn(generator(), 2, 6, 8)[:, 1]) == 2 * 8 * 2
    assert _distinct_bytes(None) == 0


def test_bytes_norm_scale_shift():
    g = generator()
    modulation = randn(g, 2, 6, 8)
    arguments = dict(x=randn(g, 2, 3, 8), scale=modulation[:, 1], shift=modulation[:, 0], weight=randn(g, 8), bias=None, norm="layer")
    x, scale, shift, weight, bias, y = X_BF16, VIEW_BF16, VIEW_BF16, D_BF16, 0, X_BF16
    assert minimum_bytes("norm_scale_shift", arguments) == x + scale + shift + weight + bias + y == 272


def test_bytes_residual_norm_scale_shift_wan_layout_and_no_gate():
    g = generator()
    modulation = randn(g, 2, 6, 8, dtype=F32)  # Wan: float32 modulation, [B, 1, D] views
    arguments = dict(
        x=randn(g, 2, 3, 8), residual=randn(g, 2, 3, 8), gate=None, scale=modulation[:, 4:5], shift=modulation[:, 3:4], norm="layer"
    )
    x, residual, gate, scale, shift = X_BF16, X_BF16, 0, VIEW_F32, VIEW_F32
    y, residual_out = X_BF16, X_BF16
    assert minimum_bytes("residual_norm_scale_shift", arguments) == x + residual + gate + scale + shift + y + residual_out == 512


def test_bytes_quantize_fp8_with_a_prefix():
    """FP8 rows of P + D bytes and a float32 scale per row, after reading x and the prefix."""
    g = generator()
    arguments = dict(x=randn(g, 2, 3, 8), activation="gelu_tanh", prefix=randn(g, 2, 3, 16), fp8_dtype=torch.float8_e4m3fn)
    x, prefix, y, y_scale = X_BF16, 2 * X_BF16, 2 * 3 * (16 + 8), 2 * 3 * 4
    assert minimum_bytes("quantize_fp8", arguments) == x + prefix + y + y_scale == 456
    assert minimum_bytes("quantize_fp8", dict(arguments, prefix=None)) == x + 2 * 3 * 8 + y_scale == 168


def _select_arguments(g, residual: bool) -> dict:
    set0, set1 = randn(g, 2, 6, 8), randn(g, 2, 6, 8)
    index = torch.zeros(2, 3, dtype=torch.int64)
    index[:, 1:] = 1
    arguments = dict(x=randn(g, 2, 3, 8), index=index, scale0=set0[:, 1], shift0=set0[:, 0], gate0=set0[:, 2])
    arguments.update(scale1=set1[:, 1], shift1=set1[:, 0], gate1=set1[:, 2], weight=randn(g, 8), bias=randn(g, 8))
    if residual:
        arguments.update(residual=randn(g, 2, 3, 8), residual_gate=randn(g, 2, 3, 8))
    return arguments


def test_bytes_norm_scale_shift_select():
    arguments = _select_arguments(generator(), residual=False)
    x, index, six_views, weight, bias = X_BF16, INDEX, 6 * VIEW_BF16, D_BF16, D_BF16
    y, gate_out = X_BF16, X_BF16
    assert minimum_bytes("norm_scale_shift_select", arguments) == x + index + six_views + weight + bias + y + gate_out == 560


def test_bytes_residual_norm_scale_shift_select():
    arguments = _select_arguments(generator(), residual=True)
    x, residual, residual_gate, index, six_views, weight, bias = X_BF16, X_BF16, X_BF16, INDEX, 6 * VIEW_BF16, D_BF16, D_BF16
    y, residual_out, gate_out = X_BF16, X_BF16, X_BF16
    expected = x + residual + residual_gate + index + six_views + weight + bias + y + residual_out + gate_out
    assert minimum_bytes("residual_norm_scale_shift_select", arguments) == expected == 848


def test_bytes_add_gate_norm_with_an_expanded_gate():
    g = generator()
    gate = randn(g, 8).expand(2, 8)  # stride 0 over B: 8 distinct elements
    arguments = dict(x=randn(g, 2, 3, 8), branch=randn(g, 2, 3, 8), gate=gate, weight=randn(g, 8), norm="rms", eps=1e-5, gate_act="tanh")
    x, branch, gate, weight, out = X_BF16, X_BF16, 8 * 2, D_BF16, X_BF16
    assert minimum_bytes("add_gate_norm", arguments) == x + branch + gate + weight + out == 320


def test_bytes_add_gate_norm_scale():
    g = generator()
    modulation = randn(g, 2, 6, 8, dtype=F32)
    arguments = dict(
        x=randn(g, 2, 3, 8), branch=randn(g, 2, 3, 8), gate=modulation[:, 2], scale=modulation[:, 1], weight=randn(g, 8), weight2=randn(g, 8)
    )
    x, branch, gate, scale, weight, weight2 = X_BF16, X_BF16, 2 * 8 * 4, 2 * 8 * 4, D_BF16, D_BF16
    out, y = X_BF16, X_BF16
    assert minimum_bytes("add_gate_norm_scale", arguments) == x + branch + gate + scale + weight + weight2 + out + y == 544
    # The harness passes the same tensor as weight and weight2 (Z-Image): its elements are read once.
    arguments["weight2"] = arguments["weight"]
    assert minimum_bytes("add_gate_norm_scale", arguments) == 544 - D_BF16


Q_BF16 = 5 * 2 * 8 * 2  # q [T=5, Hq=2, Dh=8] bf16: 160 bytes
K_BF16 = 5 * 1 * 8 * 2  # k [T=5, Hk=1, Dh=8] bf16: 80 bytes
CACHE_ROW = 8 * 4  # one float32 row of an [P, R=8] cos/sin cache: 32 bytes


def _rope_arguments(g, tokens=5, cache_rows=10, positions=False, with_k=True) -> dict:
    arguments = dict(q=randn(g, tokens, 2, 8), k=randn(g, tokens, 1, 8) if with_k else None, cos_sin_cache=randn(g, cache_rows, 8, dtype=F32))
    if positions:
        arguments["positions"] = torch.randint(0, cache_rows, (tokens,), generator=g)
    return arguments


def test_bytes_rope_one_cache_row_per_token_without_positions():
    arguments = _rope_arguments(generator())
    q_read_write, k_read_write, cache = 2 * Q_BF16, 2 * K_BF16, 5 * CACHE_ROW
    assert minimum_bytes("rope_", arguments) == q_read_write + k_read_write + cache == 640


def test_bytes_rope_with_positions_and_without_k():
    with_positions = _rope_arguments(generator(), positions=True)
    positions = 5 * 8  # int64
    assert minimum_bytes("rope_", with_positions) == 2 * Q_BF16 + 2 * K_BF16 + min(5, 10) * CACHE_ROW + positions == 680
    # More positions than cache rows: at most every cache row is read.
    many = _rope_arguments(generator(), tokens=12, cache_rows=4, positions=True)
    q, k, positions = 12 * 2 * 8 * 2, 12 * 1 * 8 * 2, 12 * 8
    assert minimum_bytes("rope_", many) == 2 * q + 2 * k + min(12, 4) * CACHE_ROW + positions == 1376
    no_k = _rope_arguments(generator(), with_k=False)
    assert minimum_bytes("rope_", no_k) == 2 * Q_BF16 + 5 * CACHE_ROW == 480


def test_bytes_rope_batched_layout():
    g = generator()
    arguments = dict(q=randn(g, 2, 3, 2, 8), k=randn(g, 2, 3, 2, 8), cos_sin_cache=randn(g, 3, 8, dtype=F32))
    q, k, cache = 2 * 3 * 2 * 8 * 2, 2 * 3 * 2 * 8 * 2, (2 * 3) * CACHE_ROW  # one cache row per token: B*S = 6
    assert minimum_bytes("rope_", arguments) == 2 * q + 2 * k + cache == 960


def test_bytes_qk_norm_rope():
    g = generator()
    arguments = _rope_arguments(g, positions=True)
    arguments.update(q_weight=randn(g, 8), k_weight=randn(g, 8))
    q, k, cache, positions, q_weight, k_weight = Q_BF16, K_BF16, 5 * CACHE_ROW, 5 * 8, D_BF16, D_BF16
    assert minimum_bytes("qk_norm_rope_", arguments) == 2 * q + 2 * k + cache + positions + q_weight + k_weight == 712


def test_bytes_of_real_cases():
    """Two real cases, at their real shapes (fake tensors)."""
    wan = next(c for c in CASES if c.op == "norm_scale_shift" and c.model == "Wan2.1-1.3B 480p")
    x, scale, shift = 1 * 32760 * 1536 * 2, 1 * 1536 * 4, 1 * 1536 * 4  # float32 [B, 1, D] modulation views
    assert minimum_bytes(wan.op, fake_arguments(wan)) == x + scale + shift + x

    gqa = next(c for c in CASES if c.op == "rope_" and c.model == "LLM GQA NeoX")
    q, k, positions = 16384 * 32 * 128 * 2, 16384 * 8 * 128 * 2, 16384 * 8
    cache = min(16384, 16384 + 5) * 128 * 4  # a (T + 5)-row table, T positions
    assert minimum_bytes(gqa.op, fake_arguments(gqa)) == 2 * q + 2 * k + cache + positions

    z_image = next(c for c in CASES if c.op == "add_gate_norm_scale" and c.model.startswith("Z-Image"))
    x, gate, scale, weight, weight2 = 4608 * 3840 * 2, 3840 * 4, 3840 * 4, 3840 * 4, 3840 * 4  # both norms' weights
    assert minimum_bytes(z_image.op, fake_arguments(z_image)) == 2 * x + gate + scale + weight + weight2 + 2 * x


# ----------------------------------------------------------------------------------------
# 2. Case filters and shape strings
# ----------------------------------------------------------------------------------------


def test_every_op_has_cases_a_quick_case_and_a_real_case():
    assert {case.op for case in CASES} == set(OPS)
    for op in OPS:
        op_cases = [case for case in CASES if case.op == op]
        assert any(case.quick for case in op_cases), op
        assert any(case.model != "latency" for case in op_cases), op
        assert any(case.quick and case.model != "latency" for case in op_cases), op


def test_select_cases_by_op_with_or_without_underscore():
    rope = [case for case in CASES if case.op == "rope_"]
    assert rope and bench.select_cases(ops=["rope"]) == rope == bench.select_cases(ops=["rope_"])
    kept = bench.select_cases(ops=["add_gate_norm", "qk_norm_rope"])
    assert {case.op for case in kept} == {"add_gate_norm", "qk_norm_rope_"}  # not add_gate_norm_scale
    assert kept == [case for case in CASES if case.op in ("add_gate_norm", "qk_norm_rope_")]
    assert bench.select_cases() == CASES == bench.select_cases(ops=[], shapes=[])
    with pytest.raises(ValueError):
        bench.select_cases(ops=["no_such_op"])


def test_select_cases_by_shape_substring():
    by_model = bench.select_cases(shapes=["HunyuanVideo"])
    assert by_model and all("HunyuanVideo" in case.model for case in by_model)
    assert len(by_model) == sum("HunyuanVideo" in case.model for case in CASES)
    by_shape = bench.select_cases(shapes=["D6144"])  # only in a shape string
    assert [(case.op, case.model) for case in by_shape] == [("norm_scale_shift", "FLUX.2-dev 1024px")]
    either = bench.select_cases(shapes=["S75600", "T75600"])
    assert {(case.op, case.shape) for case in either} == {
        ("norm_scale_shift", "B1 S75600 D5120"),
        ("residual_norm_scale_shift", "B1 S75600 D5120"),
        ("norm_scale_shift_fp8", "B1 S75600 D5120"),
        ("residual_norm_scale_shift_fp8", "B1 S75600 D5120"),
        ("quantize_fp8", "B1 S75600 D13824"),
        ("rope_", "T75600 H40 Dh128"),
        ("qk_norm_rope_", "T75600 H40 Dh128"),
    }
    assert bench.select_cases(shapes=["no such model"]) == []


def test_select_cases_quick_and_combined():
    quick = bench.select_cases(quick=True)
    assert quick == [case for case in CASES if case.quick] and len(quick) < len(CASES)
    combined = bench.select_cases(ops=["rope"], shapes=["latency"], quick=True)
    assert [(case.op, case.model) for case in combined] == [("rope_", "latency")]
    assert bench.select_cases(ops=["rope"], shapes=["LLM"], quick=True) == []  # the LLM rows are not quick


NORM_SHAPE = re.compile(r"B(\d+) S(\d+)(?: P(\d+))? D(\d+)")  # P: quantize_fp8's prefix width
HEADS_SHAPE = re.compile(r"T(\d+) (?:H(\d+)|Hq(\d+) Hk(\d+)) Dh(\d+)( neox)?")


def _check_shape_string(case, arguments):
    if case.op in ("rope_", "qk_norm_rope_"):
        match = HEADS_SHAPE.fullmatch(case.shape)
        assert match, case.shape
        tokens, heads, q_heads, k_heads, head_size, neox = match.groups()
        q_heads, k_heads = (heads, heads) if heads else (q_heads, k_heads)
        q, k = arguments["q"], arguments["k"]
        assert (q.shape[:-2].numel(), q.shape[-2], k.shape[-2], q.shape[-1]) == (int(tokens), int(q_heads), int(k_heads), int(head_size))
        assert arguments["interleaved"] == (neox is None), case.shape
    else:
        match = NORM_SHAPE.fullmatch(case.shape)
        assert match, case.shape
        batch, tokens, prefix, hidden = match.groups()
        assert tuple(arguments["x"].shape) == (int(batch), int(tokens), int(hidden))
        assert (arguments["prefix"].shape[-1] if arguments.get("prefix") is not None else None) == (prefix and int(prefix))


def test_shape_strings_describe_the_built_arguments():
    for case in CASES:
        _check_shape_string(case, fake_arguments(case))
    for case in CASES:
        stand_in = cpu_case(case)
        assert (stand_in.op, stand_in.quick) == (case.op, case.quick)
        assert stand_in.model == case.model + " (CPU stand-in)"
        _check_shape_string(stand_in, fake_arguments(stand_in))
    assert next(c for c in CASES if c.model == "Wan2.1-1.3B 480p").shape == "B1 S32760 D1536"
    assert next(c for c in CASES if c.op == "qk_norm_rope_").shape == "T4608 H24 Dh128"


# ----------------------------------------------------------------------------------------
# 3. Derived columns
# ----------------------------------------------------------------------------------------


def _row(model, candidate, us=None, dtype="bfloat16", op="rope_", shape="T256 H4 Dh64", bytes=1_000_000, note="", copy_us=20.0):
    row = dict(op=op, model=model, shape=shape, dtype=dtype, candidate=candidate, auto_backend="reference", bytes=bytes, note=note)
    row["same_size_copy_us"] = copy_us
    if us is not None:
        row.update(us=us, correct=True, max_error=0.0)
    return row


def _rows_of_two_cases_with_one_shape() -> list:
    return [
        _row("A", "eager", 100.0),
        _row("A", "torch.compile", 50.0),
        _row("A", "reference", 25.0),
        _row("A", "auto", 26.0),
        _row("B", "eager", 400.0, copy_us=50.0),  # another case with the same shape string, and no torch.compile row
        _row("B", "reference", 200.0, copy_us=50.0),
        _row("A", "reference", 10.0, dtype="float16"),  # same case in another dtype: no baselines
        _row("A", "liger", note="missing (ModuleNotFoundError: No module named 'liger_kernel')"),
    ]


def test_add_derived():
    rows = _rows_of_two_cases_with_one_shape()
    report.add_derived(rows, copy_gbps=80.0)
    by = {(row["model"], row["dtype"], row["candidate"]): row for row in rows}

    reference_a = by["A", "bfloat16", "reference"]
    assert reference_a["gbps"] == pytest.approx(1_000_000 / (25.0 * 1e3)) == pytest.approx(40.0)
    assert reference_a["pct_copy"] == pytest.approx(100 * 40.0 / 80.0)
    assert reference_a["pct_same_size_copy"] == pytest.approx(100 * 20.0 / 25.0)  # its case's copy takes 20 us
    assert reference_a["speedup_vs_eager"] == pytest.approx(100.0 / 25.0)
    assert reference_a["speedup_vs_compile"] == pytest.approx(50.0 / 25.0)
    assert by["A", "bfloat16", "eager"]["speedup_vs_eager"] == pytest.approx(1.0)
    assert by["A", "bfloat16", "torch.compile"]["speedup_vs_compile"] == pytest.approx(1.0)

    reference_b = by["B", "bfloat16", "reference"]  # against B's eager (400 us), not A's
    assert reference_b["speedup_vs_eager"] == pytest.approx(400.0 / 200.0)
    assert reference_b["speedup_vs_compile"] is None
    assert reference_b["pct_same_size_copy"] == pytest.approx(100 * 50.0 / 200.0)
    other_dtype = by["A", "float16", "reference"]
    assert other_dtype["speedup_vs_eager"] is None and other_dtype["speedup_vs_compile"] is None
    assert other_dtype["gbps"] == pytest.approx(1_000_000 / (10.0 * 1e3))

    missing = by["A", "bfloat16", "liger"]
    for key in ("us", "gbps", "pct_copy", "pct_same_size_copy", "speedup_vs_eager", "speedup_vs_compile"):
        assert key not in missing


# ----------------------------------------------------------------------------------------
# 4. Table and files
# ----------------------------------------------------------------------------------------


def _derived_rows() -> list:
    rows = _rows_of_two_cases_with_one_shape()
    rows.append(_row("Qwen", "eager", 30.0, op="norm_scale_shift", shape="B1 S256 D512"))
    rows.append(_row("Qwen", "flashinfer", op="add_gate_norm", shape="B1 S256 D512", note="missing"))  # no timed row for this op
    report.add_derived(rows, copy_gbps=80.0)
    return rows


def test_summary_has_one_line_per_case_and_one_column_per_candidate():
    rows = _derived_rows()
    lines = report.summary(rows).splitlines()
    candidates = list(dict.fromkeys(row["candidate"] for row in rows))
    cases = list(dict.fromkeys((row["op"], row["model"], row["shape"], row["dtype"]) for row in rows))
    assert lines[0] == "| op | model | shape | dtype | same-size copy | " + " | ".join(candidates) + " |"
    assert len(lines) == 2 + len(cases)  # header and its separator, then the cases
    for line, case in zip(lines[2:], cases):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert tuple(cells[:4]) == case and len(cells) == 5 + len(candidates)
        assert cells[4] == ("50.00" if case[1] == "B" else "20.00")  # the case's same-size copy, us
        for candidate, cell in zip(candidates, cells[5:]):
            timed = [row for row in rows if (row["op"], row["model"], row["shape"], row["dtype"]) == case and row["candidate"] == candidate and "us" in row]
            picked = " reference" if candidate == "auto" else ""  # the auto cell names the dispatcher's pick
            assert cell == (f"{report._cell(timed[0]['us'])} ({timed[0]['pct_copy']:.0f}%){picked}" if timed else "-")
    assert "| 26.00 (48%) reference |" in lines[2]  # case A's auto cell: 1 MB in 26 us at 80 GB/s copy


def test_charts_from_a_saved_results_file(tmp_path):
    pytest.importorskip("matplotlib", reason="charts need the [bench] extra")
    from ditops import cli

    rows = _derived_rows()
    report.write(rows, dict(device="Test GPU", copy_gbps=80.0), tmp_path, "saved", plots=False)
    assert cli.main(["bench", "--plot-from", str(tmp_path / "saved.json")]) == 0
    assert (tmp_path / "saved_rope_.png").read_bytes().startswith(PNG_MAGIC)


def test_write_json_csv_and_one_png_per_timed_op(tmp_path):
    pytest.importorskip("matplotlib", reason="charts need the [bench] extra")
    rows = _derived_rows()
    metadata = dict(device="Test GPU", copy_gbps=80.0, date="2025-01-01", quick=False)
    paths = report.write(rows, metadata, tmp_path / "results", "test-gpu", plots=True)
    json_path, csv_path = tmp_path / "results" / "test-gpu.json", tmp_path / "results" / "test-gpu.csv"
    pngs = {tmp_path / "results" / f"test-gpu_{op}.png" for op in ("rope_", "norm_scale_shift")}
    assert set(paths) == {json_path, csv_path} | pngs
    for png in pngs:
        assert png.read_bytes().startswith(PNG_MAGIC)
    assert not (tmp_path / "results" / "test-gpu_add_gate_norm.png").exists()

    data = json.loads(json_path.read_text())
    assert data["device"] == "Test GPU" and data["copy_gbps"] == 80.0
    assert len(data["rows"]) == len(rows)
    for written, row in zip(data["rows"], rows):
        assert {key: written[key] for key in ("op", "shape", "dtype", "candidate", "bytes")} == {
            key: row[key] for key in ("op", "shape", "dtype", "candidate", "bytes")
        }
        if "us" in row:
            assert written["us"] == row["us"]
            assert written["gbps"] == pytest.approx(row["gbps"]) and written["pct_copy"] == pytest.approx(row["pct_copy"])
            assert written["pct_same_size_copy"] == pytest.approx(row["pct_same_size_copy"])
        assert written["same_size_copy_us"] == row["same_size_copy_us"] and written["auto_backend"] == row["auto_backend"]

    with csv_path.open(newline="") as file:
        lines = list(csv.reader(file))
    assert lines[0] == list(report.COLUMNS)
    assert len(lines) == 1 + len(rows)
    candidate = report.COLUMNS.index("candidate")
    assert [line[candidate] for line in lines[1:]] == [row["candidate"] for row in rows]


def test_write_without_plots(tmp_path):
    rows = _derived_rows()
    paths = report.write(rows, dict(device="Test GPU", copy_gbps=80.0), tmp_path, "stem", plots=False)
    assert paths == [tmp_path / "stem.json", tmp_path / "stem.csv"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["stem.csv", "stem.json"]


# ----------------------------------------------------------------------------------------
# 5. Timing helpers
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bytes_per_call, l2_bytes, sets",
    [
        (1 << 20, 50 << 20, 16),  # 101 sets would be needed: the limit
        (30 << 20, 50 << 20, 4),  # 4 x 30 MiB = 120 MiB > 100 MiB; 3 x 30 = 90 is not enough
        (25 << 20, 50 << 20, 5),  # 4 x 25 MiB is exactly 2 x L2, not more
        (200 << 20, 50 << 20, 1),
        (0, 50 << 20, 16),
    ],
)
def test_rotation_sets_examples(bytes_per_call, l2_bytes, sets):
    assert timing.rotation_sets(bytes_per_call, l2_bytes) == sets


def test_rotation_sets_exceed_twice_l2_when_the_limit_allows():
    l2 = 40 << 20
    for limit in (1, 4, 16):
        for size in [1, 1000, 1 << 20, 5 << 20, 10 << 20, 20 << 20, 27 << 20, 40 << 20, 80 << 20, 81 << 20, 1 << 30]:
            sets = timing.rotation_sets(size, l2, limit)
            assert 1 <= sets <= limit
            if sets < limit:  # not capped: just enough sets
                assert sets * size > 2 * l2
                assert sets == 1 or (sets - 1) * size <= 2 * l2


def test_host_timing():
    count = []
    x = randn(generator(), 64, 64, dtype=F32)
    calls = [lambda: count.append(1) or x @ x, lambda: count.append(2) or x + x]
    result = timing.host(calls, repeats=5)
    assert result.us > 0 and result.spread_pct >= 0
    assert count.count(1) == count.count(2) >= 5  # every call runs, each round


# ----------------------------------------------------------------------------------------
# 6. End to end on the CPU
# ----------------------------------------------------------------------------------------


def test_copy_us_rotates_over_sets_of_the_given_bytes(monkeypatch):
    """The same-size copy: ``sets`` distinct buffer pairs, each copy reading half the bytes and writing half."""
    timed = []
    monkeypatch.setattr(timing, "host", lambda calls: timed.append(calls) or timing.Timing(2.0, 0.0))
    assert timing.copy_us("cpu", 4000, sets=3) == {"memcpy": 2.0, "kernel": 2.0}
    assert timing.copy_bandwidth("cpu", 1000) == {"memcpy": 2000 / 2e3, "kernel": 2000 / 2e3}  # 1000 read, 1000 written in 2 us
    for calls in timed[:2]:  # the two ways of copy_us
        pairs = {(call.args[0].data_ptr(), call.args[1].data_ptr()) for call in calls}
        assert len(pairs) == 3 and len({pointer for pair in pairs for pointer in pair}) == 6
        for call in calls:
            source, target = call.args
            assert source.numel() * source.element_size() == target.numel() * target.element_size() == 2000
            call()
            assert torch.equal(target, source)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU stand-in run")
def test_run_end_to_end_on_cpu(tmp_path):
    rows, info, paths = bench.run(ops=["rope_"], quick=True, backends=["reference", "eager"], output=tmp_path, plots=False)
    assert {row["candidate"] for row in rows} == {"reference", "eager"}
    assert {row["model"] for row in rows} == {case.model + " (CPU stand-in)" for case in CASES if case.op == "rope_" and case.quick}
    q_or_k = 256 * 4 * 64 * 2  # CPU stand-in: T256 H4 Dh64, bf16
    for row in rows:
        assert row["op"] == "rope_" and row["dtype"] == "bfloat16" and row["shape"] == "T256 H4 Dh64"
        assert row["us"] > 0 and row["correct"] is True
        assert row["bytes"] == 2 * (2 * q_or_k) + 256 * 64 * 4 > 0
        assert row["gbps"] > 0 and row["pct_copy"] > 0
        assert row["same_size_copy_us"] > 0 and row["pct_same_size_copy"] == pytest.approx(100 * row["same_size_copy_us"] / row["us"])
        if row["candidate"] == "eager":
            assert row["speedup_vs_eager"] == pytest.approx(1.0)
    assert info["copy_gbps"] > 0 and info["device"].startswith("CPU")
    assert {path.suffix for path in paths} == {".json", ".csv"}
    assert all(path.parent == tmp_path and path.exists() for path in paths)
    assert not list(tmp_path.glob("*.png"))
    written = json.loads(next(path for path in paths if path.suffix == ".json").read_text())
    assert len(written["rows"]) == len(rows)
    assert [row["same_size_copy_us"] for row in written["rows"]] == [row["same_size_copy_us"] for row in rows]
    for model in {row["model"] for row in rows}:  # one copy per case, on each of its rows
        assert len({row["same_size_copy_us"] for row in rows if row["model"] == model}) == 1


def _auto_rows(rows: list) -> list:
    auto = [row for row in rows if row["candidate"] == "auto"]
    assert auto and all(row["us"] > 0 and row["correct"] is True for row in auto)
    return auto


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU stand-in run")
def test_auto_runs_the_public_call_and_records_the_pick(tmp_path):
    """``auto`` is the call with no backend=: on the CPU the dispatcher picks the reference."""
    rows, _, paths = bench.run(ops=["rope_"], quick=True, backends=["auto", "reference"], output=tmp_path, plots=False)
    assert [row["candidate"] for row in rows] == ["auto", "reference"] * 2  # auto first, in each case
    assert all(row["auto_backend"] == "reference" for row in rows)
    for auto in _auto_rows(rows):
        case = cpu_case(next(c for c in CASES if c.op == "rope_" and c.model + " (CPU stand-in)" == auto["model"]))
        assert auto["auto_backend"] == ditops.explain("rope_", **case.build("cpu", BF16, generator())).selected
    written = json.loads(next(path for path in paths if path.suffix == ".json").read_text())["rows"]
    assert [row["auto_backend"] for row in written] == ["reference"] * len(rows)
    with next(path for path in paths if path.suffix == ".csv").open(newline="") as file:
        assert [line["auto_backend"] for line in csv.DictReader(file)] == ["reference"] * len(rows)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the simulated device dispatches CPU tensors")
def test_auto_goes_through_the_dispatcher_to_the_backend_it_picks():
    """On a simulated sm_90 with a registry whose NVIDIA backend records its calls, auto is that
    backend (explain's pick), and its timed calls reach it without a backend= override."""
    load_config(Path(__file__).parent / "simulated_registry.yaml")
    with simulated_device("sm_90"):
        case = cpu_case(next(c for c in CASES if c.op == "rope_" and c.model == "latency"))
        assert ditops.explain("rope_", **case.build("cpu", BF16, generator())).selected == "nvidia_kernels"
        toy_backends.CALLS.clear()
        rows, _, _ = bench.run(ops=["rope_"], shapes=["latency"], backends=["auto"], write_files=False, progress=lambda line: None)
    (auto,) = _auto_rows(rows)
    assert auto["auto_backend"] == "nvidia_kernels"
    assert toy_backends.CALLS and set(toy_backends.CALLS) == {"rope_"}


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger_kernel is installed here")
def test_run_reports_a_missing_peer(tmp_path):
    rows, _, paths = bench.run(ops=["rope_"], quick=True, backends=["liger"], output=tmp_path, plots=False)
    assert rows and all(row["candidate"] == "liger" for row in rows)
    for row in rows:
        assert "missing" in row["note"]
        assert "us" not in row and "gbps" not in row
    csv_text = next(path for path in paths if path.suffix == ".csv").read_text()
    assert csv_text.count("missing") == len(rows)


# ----------------------------------------------------------------------------------------
# 7. The eager baselines compute the reference's function
# ----------------------------------------------------------------------------------------

BF16_TOLERANCE = dict(rtol=TOLERANCES[BF16], atol=TOLERANCES[BF16])


def _eager_matches_reference(op: str, arguments: dict):
    expected = getattr(reference, op)(**clone(arguments))  # the RoPE ops rotate q and k in place
    inputs = clone(arguments)
    actual = baselines.EAGER[op](**inputs)
    expected = (expected,) if isinstance(expected, torch.Tensor) else expected
    actual = (actual,) if isinstance(actual, torch.Tensor) else actual
    assert len(actual) == len(expected)
    assert [got.dtype for got in actual] == [want.dtype for want in expected]
    quantized = opspec.SPECS[op].quantized
    pairs = zip(bench._dequantized(actual, quantized), bench._dequantized(expected, quantized))
    for position, (got, want) in enumerate(pairs):
        if quantized and position == 0:  # the baseline quantises y as rounded to bf16: one FP8 step apart at most
            assert ((got - want).abs() <= 0.125 * want.abs().amax(-1, keepdim=True)).all()
        else:
            torch.testing.assert_close(got, want, **BF16_TOLERANCE)
    for name, value in arguments.items():  # the baselines are out of place
        if isinstance(value, torch.Tensor):
            assert torch.equal(inputs[name], value), name


@pytest.mark.parametrize("op", OPS)
def test_eager_matches_reference(op):
    case = cpu_case(next(case for case in CASES if case.op == op))
    _eager_matches_reference(op, case.build("cpu", F32, generator(1)))


LAYOUTS = {
    "norm_scale_shift": opspec._rows(2, 16, 64, modulation_dtype=F32, per_batch_3d=True),
    "residual_norm_scale_shift": opspec._rows(2, 16, 64, modulation_dtype=F32, per_batch_3d=True, affine=True),
    "add_gate_norm": opspec._rows(2, 16, 64, norm="rms", affine=True, modulation_dtype=F32),
    "add_gate_norm_scale": opspec._rows(2, 16, 64, norm="rms", affine=True, modulation_dtype=F32),
    "qk_norm_rope_": dataclasses.replace(opspec._heads(16, 4, 2, 32, interleaved=False, positions=True), leading=(2, 16)),
    "rope_": opspec._heads(32, 4, 2, 32, interleaved=False, positions=True),
    "quantize_fp8": dataclasses.replace(opspec._rows(2, 16, 64), activation="gelu_tanh", prefix=32),
}


@pytest.mark.parametrize("op", LAYOUTS)
def test_eager_matches_reference_in_the_real_layouts(op):
    """The layouts the CPU stand-ins leave out: float32 [B, 1, D] modulation, positions, NeoX, GQA, [B, S, H, Dh]."""
    _eager_matches_reference(op, opspec.SPECS[op].build(LAYOUTS[op], F32, "cpu", generator(2)))


TABLE_OPS = ["norm_scale_shift", "residual_norm_scale_shift", "norm_scale_shift_fp8", "residual_norm_scale_shift_fp8"]


@pytest.mark.parametrize("op", TABLE_OPS)
def test_eager_matches_reference_with_modulation_tables(op):
    """The MiniMax-H3 row (K = 6 tables, one [S] index), at its CPU stand-in, and [B, K, D]
    tables with a [B, S] index: the baseline selects rows as models do, the reference gathers."""
    case = cpu_case(next(case for case in CASES if case.op == op and case.model.startswith("MiniMax-H3")))
    arguments = case.build("cpu", F32, generator(3))
    assert arguments["modulation_index"].shape == (256,) and arguments["scale"].shape == (6, 512)
    _eager_matches_reference(op, arguments)
    batched = dataclasses.replace(opspec._rows(2, 16, 64, modulation_dtype=F32), scale="batch_table",
                                  shift="table", gate="batch_table", table_rows=3)
    _eager_matches_reference(op, opspec.SPECS[op].build(batched, F32, "cpu", generator(4)))

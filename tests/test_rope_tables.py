"""The RoPE ops' angles as the tables cos and sin (docs/ops.md, "The tables cos and sin"): the
reference against diffusers' LTX rotations and an independent formulation, bad inputs, aliasing,
dispatch (registry constraint, features), the compiled kernels' table layouts and instances, the
Triton specializations, and the benchmark's bytes and eager baseline. The kernels' results are
checked by the conformance suite (the "tables-*" cases) on every backend."""

from __future__ import annotations

import re

import pytest
import torch

import ditops
from ditops import conformance
from ditops.backends import compiled
from ditops.bench import baselines
from ditops.bench.cases import minimum_bytes
from ditops.dispatch import simulated_device
from ditops.ops import OPS, ordered_arguments
from ditops.opspec import SPECS, TABLE_FORMS
from ditops.inputs import HeadSpec

B, S, H, DH = 2, 5, 3, 16


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def angles(*shape, seed=1):
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 6.3


def ltx_tables(rope_type: str, dtype=torch.float64):
    """diffusers' LTX-2 tables for q [B, S, H, Dh]: interleaved [B, S, H * Dh] (each pair's value
    twice) or split [B, H, S, Dh / 2] (a transposed view of [B, S, H, Dh / 2]), and the views the
    ops take."""
    freqs = angles(B, S, H * DH // 2)
    if rope_type == "interleaved":
        table = tuple(f(freqs).repeat_interleave(2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
        return table, tuple(t.unflatten(-1, (H, DH // 2, 2))[..., 0] for t in table)
    table = tuple(f(freqs).reshape(B, S, H, DH // 2).transpose(1, 2).to(dtype) for f in (torch.cos, torch.sin))
    return table, tuple(t.transpose(1, 2) for t in table)


# ----- the definition ------------------------------------------------------------------------


@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_rope_matches_diffusers_ltx2_rotations(rope_type):
    from diffusers.models.transformers.transformer_ltx2 import apply_interleaved_rotary_emb, apply_split_rotary_emb

    x = randn(B, S, H * DH, dtype=torch.float64)
    table, (cos, sin) = ltx_tables(rope_type)
    apply = apply_interleaved_rotary_emb if rope_type == "interleaved" else apply_split_rotary_emb
    want = apply(x.float(), tuple(t.float() for t in table)).double()  # diffusers rotates in float32
    q = x.clone().unflatten(2, (H, DH))
    ditops.rope_(q, None, cos=cos, sin=sin, interleaved=rope_type == "interleaved")
    torch.testing.assert_close(q.flatten(2), want, rtol=0, atol=1e-6)


def test_tables_are_a_complex_multiplication_per_head_item_and_position():
    """Pair j of head h of token s of item b turns by the angle at [b, positions[b, s], h, j]."""
    q, k = randn(B, S, H, DH, dtype=torch.float64), randn(B, S, H, DH, dtype=torch.float64, seed=1)
    theta = angles(B, 7, H, DH // 2)
    positions = torch.randint(0, 7, (B, S), generator=torch.Generator().manual_seed(2))
    expected = []
    for t in (q, k):
        pairs = torch.view_as_complex(t.unflatten(-1, (-1, 2)).contiguous())  # interleaved pairs as complex numbers
        turn = torch.polar(torch.ones_like(theta), theta)[torch.arange(B)[:, None], positions]
        expected.append(torch.view_as_real(pairs * turn).flatten(-2))
    ditops.rope_(q, k, None, positions, cos=theta.cos(), sin=theta.sin())
    torch.testing.assert_close(q, expected[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(k, expected[1], rtol=0, atol=1e-12)


def test_one_row_for_every_head_is_the_cache():
    """Hc = 1: the tables are a [P, R] cache split in its halves, for GQA too."""
    q, k = randn(S, 4, DH), randn(S, 2, DH, seed=1)
    cache = ditops.rope_cos_sin_cache(9, DH)
    q_cache, k_cache = q.clone(), k.clone()
    ditops.rope_(q_cache, k_cache, cache, position_offset=3, interleaved=False)
    cos, sin = cache.unsqueeze(1).chunk(2, dim=-1)  # [P, 1, R/2] views
    ditops.rope_(q, k, cos=cos, sin=sin, position_offset=3, interleaved=False)
    assert torch.equal(q, q_cache) and torch.equal(k, k_cache)


def test_qk_norm_rope_over_a_token_with_tables_is_the_norm_then_rope_():
    q, k = randn(B, S, H, DH), randn(B, S, H, DH, seed=1)
    weights = randn(H * DH, seed=2), randn(H * DH, seed=3)
    _, (cos, sin) = ltx_tables("split", torch.float32)
    expected = [torch.nn.functional.rms_norm(t.flatten(-2), (H * DH,), w, 1e-6).view(t.shape) for t, w in zip((q, k), weights)]
    ditops.rope_(*expected, cos=cos, sin=sin, interleaved=False)
    ditops.qk_norm_rope_(q, k, *weights, cos=cos, sin=sin, interleaved=False, norm_over="token")
    torch.testing.assert_close(q, expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, expected[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", TABLE_FORMS)
def test_every_table_form_builds_valid_calls(form):
    leading = (2, 5) if form in ("items", "head_major", "expanded") else (5,)
    spec = HeadSpec(leading, 3, 3 if form != "broadcast_heads" else 1, 32, tables=form)
    for op in ("rope_", "qk_norm_rope_"):
        arguments = SPECS[op].build(spec, torch.float32, "cpu", torch.Generator().manual_seed(0))
        assert arguments["cos_sin_cache"] is None and arguments["cos"].stride() == arguments["sin"].stride()
        getattr(ditops, op)(**arguments)
        meta = SPECS[op].build(spec, torch.float32, "meta", torch.Generator())
        assert meta["cos"].stride() == arguments["cos"].stride()


# ----- bad inputs: named, before anything is written ------------------------------------------


def rope_call(**changes):
    _, (cos, sin) = ltx_tables("interleaved", torch.float32)
    arguments = dict(q=randn(B, S, H, DH), k=randn(B, S, H, DH, seed=1), cos_sin_cache=None, cos=cos, sin=sin)
    arguments.update(changes)
    return arguments


TABLE_SHAPES = f"[P, Hc, R/2] or, for q [B, S, H, Dh], [Bc, P, Hc, R/2] with Bc 1 or B = {B}, Hc 1 or Hq = {H}"
BAD_TABLES = [
    ("cache-and-tables", dict(cos_sin_cache=ditops.rope_cos_sin_cache(S, DH)), "cos", "is given with a cos_sin_cache",
     "one of the two forms"),
    ("neither", dict(cos=None, sin=None), "cos_sin_cache", "is None and so are cos and sin",
     "a [P, R] cos_sin_cache, or the tables cos and sin"),
    ("sin-missing", dict(sin=None), "sin", "is a NoneType", "a torch.Tensor"),
    ("cos-2d", dict(cos=randn(S, DH // 2), sin=randn(S, DH // 2)), "cos", "has shape [5, 8]", TABLE_SHAPES),
    ("cos-heads", dict(cos=randn(S, 2, DH // 2), sin=randn(S, 2, DH // 2)), "cos", "has shape [5, 2, 8]", TABLE_SHAPES),
    ("cos-items", dict(cos=randn(3, S, H, DH // 2), sin=randn(3, S, H, DH // 2)), "cos", "has shape [3, 5, 3, 8]",
     TABLE_SHAPES),
    ("R-over-Dh", dict(cos=randn(S, H, DH), sin=randn(S, H, DH)), "cos", "has shape [5, 3, 16]", "1 <= R/2 <= Dh/2 = 8"),
    ("sin-shape", dict(sin=randn(B, S, H, DH // 4)), "sin", "has shape [2, 5, 3, 4]", "the shape of cos, [2, 5, 3, 8]"),
    ("sin-dtype", dict(sin=randn(B, S, H, DH // 2, dtype=torch.bfloat16)), "sin", "has dtype bfloat16",
     "the dtype of cos, float32"),
    ("sin-strides", dict(sin=randn(B, S, H, DH // 2)), "sin", "has strides [120, 24, 8, 1]",
     "the strides of cos, [240, 48, 16, 2]"),
    ("cos-int", dict(cos=torch.ones(B, S, H, DH // 2, dtype=torch.int64)), "cos", "has dtype int64", "one of float16"),
    ("cos-on-meta", dict(cos=torch.empty(B, S, H, DH // 2, device="meta")), "cos", "is on meta", "cpu"),
    ("gqa-with-a-row-per-head", dict(k=randn(B, S, 1, DH)), "k", "has 1 heads with tables of a row per head of q's 3",
     "Hk = Hq = 3"),
    ("rotary_dim", dict(rotary_dim=DH // 2), "rotary_dim", "is 8", "None or 2 * cos.shape[-1] = 16"),
    ("too-few-positions", dict(position_offset=1), "cos", "has 5 rows (positions, its dimension -3)",
     "at least position_offset + S = 1 + 5 rows"),
    ("positions-past-tables", dict(positions=torch.full((B, S), S)), "positions", "has values in [5, 5]",
     "values in [0, 5) (rows of cos and sin)"),
    ("cos-shares-memory-with-q", {}, "cos", "shares memory with q", "a tensor disjoint from q"),
]


@pytest.mark.parametrize("op", ["rope_", "qk_norm_rope_"])
@pytest.mark.parametrize("rule, changes, argument, got, wanted", BAD_TABLES, ids=[rule for rule, *_ in BAD_TABLES])
def test_bad_tables_raise_before_anything_is_written(op, rule, changes, argument, got, wanted):
    arguments = rope_call(**changes)
    if rule == "cos-shares-memory-with-q":
        q = arguments["q"]
        arguments.update(cos=q[..., : DH // 2], sin=arguments["k"].clone()[..., : DH // 2])
    if op == "qk_norm_rope_":
        arguments.update(q_weight=None, k_weight=None)
    q, k = arguments["q"].clone(), arguments["k"].clone()
    pattern = f"^{re.escape(op)}: {re.escape(argument)} .*{re.escape(got)}.*; wanted .*{re.escape(wanted)}"
    with pytest.raises(ValueError, match=pattern):
        getattr(ditops, op)(**arguments)
    assert torch.equal(arguments["q"], q) and torch.equal(arguments["k"], k)


def test_valid_table_edge_forms_pass():
    """Expanded (stride 0) tables, one table for every item, R < Dh, q without k."""
    q = randn(B, S, H, DH)
    ditops.rope_(q, None, cos=randn(1, S, 1, 2).expand(B, S, H, 2), sin=randn(1, S, 1, 2, seed=1).expand(B, S, H, 2))
    ditops.rope_(q, randn(B, S, H, DH, seed=1), cos=randn(1, S + 2, H, 4), sin=randn(1, S + 2, H, 4, seed=1),
                 position_offset=2, rotary_dim=8)


# ----- dispatch ---------------------------------------------------------------------------------


def test_features_say_tables_and_leave_their_strides_out():
    """The tables' strides (pair stride 2) and pointers count neither for unit_stride nor for
    alignment; their dtype is a parameter dtype."""
    arguments, _ = ordered_arguments("rope_", **rope_call())
    features = OPS["rope_"].check(*arguments)
    assert features.rope_tables and features.unit_stride and features.alignment == 16
    assert features.param_dtypes == (torch.float32, torch.float32)
    cache_features = OPS["rope_"].check(*ordered_arguments("rope_", randn(S, H, DH), None, ditops.rope_cos_sin_cache(S, DH))[0])
    assert not cache_features.rope_tables


def test_registry_constraint_rope_tables():
    from ditops.dispatch.constraints import compile_constraints, rope_tables

    arguments, _ = ordered_arguments("rope_", **rope_call())
    features = OPS["rope_"].check(*arguments)
    assert rope_tables(False, features) == "takes a [P, R] cos_sin_cache, not the tables cos and sin"
    assert rope_tables(True, features) is None
    assert rope_tables(False, features._replace(rope_tables=False)) is None
    with pytest.raises(ValueError, match="constraint rope_tables: got 'no', wanted true or false"):
        compile_constraints({"rope_tables": "no"}, "mine.yaml")


def test_every_kernel_backend_takes_the_tables_and_explain_says_so():
    arguments = rope_call()
    with simulated_device("sm_90"):
        explanation = ditops.explain("rope_", **arguments)
        assert "cos/sin tables" in str(explanation)
        assert all(row.refusal is None or "tables" not in row.refusal for row in explanation.candidates)
    for op in ("rope_", "qk_norm_rope_"):
        entries = {implementation.name: implementation for implementation in ditops.dispatch.dispatcher().implementations[op]}
        assert set(entries) == {"rocm", "triton", "cuda", "reference"}


def test_a_backend_that_takes_only_the_cache_is_skipped_for_tables(tmp_path):
    config = tmp_path / "cache_only.yaml"
    config.write_text("ops:\n  rope_:\n    - {backend: triton, rope_tables: false}\n    - reference\n")
    ditops.load_config(str(config))
    with simulated_device("sm_90"):
        explanation = ditops.explain("rope_", **rope_call())
        cache_call = ditops.explain("rope_", randn(S, H, DH), None, ditops.rope_cos_sin_cache(S, DH))
    assert explanation.selected == "reference"
    assert any(row.refusal == "takes a [P, R] cos_sin_cache, not the tables cos and sin" for row in explanation.candidates)
    assert cache_call.selected == "triton"


# ----- the compiled kernels: table layouts and instances ----------------------------------------


def test_compiled_table_layouts():
    """16-byte words at pair stride 1 or 2 with aligned rows (2: only where the value after the
    last pair lies in the storage), a value per load otherwise."""
    def layout(cos, sin):
        return compiled._tables(cos, sin)[3]

    table, (cos, sin) = ltx_tables("interleaved", torch.float32)
    assert layout(cos, sin) == compiled.TABLE_REPEATED
    _, (cos, sin) = ltx_tables("split", torch.float32)
    assert layout(cos, sin) == compiled.TABLE_CONTIGUOUS
    assert layout(cos[..., 1:], sin[..., 1:]) == compiled.TABLE_ELEMENTS  # rows off a 16-byte boundary
    shape, strides = (S, H, DH // 2), (H * DH, DH, 2)
    whole = randn(S * H * DH).as_strided(shape, strides)  # its last pair's neighbour: the storage's last element
    assert compiled._reads_within_storage(whole, 1) and layout(whole, whole) == compiled.TABLE_REPEATED
    tight = randn(S * H * DH - 1).as_strided(shape, strides)  # a storage one element shorter
    assert not compiled._reads_within_storage(tight, 1) and layout(tight, tight) == compiled.TABLE_ELEMENTS
    strided = randn(S, H, 3 * DH // 2)[..., ::3]
    assert layout(strided, strided) == compiled.TABLE_ELEMENTS


@pytest.mark.parametrize("op", ["rope_", "qk_norm_rope_"])
def test_a_plan_reading_pair_repeated_words_checks_each_calls_storage(op):
    """A pre-bound launch that reads the interleaved tables in words (which also read the
    value after the last pair) serves a later call only where that value lies in its tables'
    storage: a storage's size is not in the call signature. The other layouts need no check."""
    from ditops.backends.cuda import KERNELS

    extra = dict(q_weight=None, k_weight=None, norm_over="token") if op == "qk_norm_rope_" else {}
    values, _ = ordered_arguments(op, **rope_call(), **extra)
    launch = getattr(KERNELS, op + "_launch")(*values)
    assert launch.arguments[5][3] == compiled.TABLE_REPEATED and launch.holds(values)
    cos = values[-2]
    last = sum((size - 1) * stride for size, stride in zip(cos.shape, cos.stride()))
    tight = [randn(last + 1, seed=seed).as_strided(cos.shape, cos.stride()) for seed in (1, 2)]
    assert not launch.holds(values[:-2] + tuple(tight))
    _, split = ltx_tables("split", torch.float32)
    values, _ = ordered_arguments(op, **rope_call(cos=split[0], sin=split[1], interleaved=False), **extra)
    assert getattr(KERNELS, op + "_launch")(*values).holds is None


def test_each_tables_call_takes_a_tables_instance_that_is_built():
    """The cuda launch of every conformance case with the tables (built on the CPU, nothing
    launched) takes the TABLES instance of its kernel, which all_instances holds; the cache
    cases take the others."""
    from ditops.backends.cuda import KERNELS

    instances, seen = set(compiled.all_instances()), set()
    for case in conformance.CASES:
        if case.op not in ("rope_", "qk_norm_rope_"):
            continue
        arguments, _ = ordered_arguments(case.op, **case.arguments(torch.bfloat16, "cpu"))
        if OPS[case.op].check(*arguments) is None:
            continue
        launch = getattr(KERNELS, case.op + "_launch")(*arguments)
        tables = arguments[-2] is not None
        assert launch.instance in instances and launch.instance.template_arguments[-1] == ("true" if tables else "false")
        seen.add((launch.instance.kernel, tables, launch.arguments[5][3] if tables else None))
    assert {(kernel, layout) for kernel, tables, layout in seen if tables} >= {
        ("rotary", layout) for layout in (compiled.TABLE_ELEMENTS, compiled.TABLE_CONTIGUOUS, compiled.TABLE_REPEATED)
    } | {("rotary_token_norm", layout) for layout in (compiled.TABLE_ELEMENTS, compiled.TABLE_CONTIGUOUS,
                                                      compiled.TABLE_REPEATED)}


TABLE_INSTANCES = [compiled.rotary_instance(dtype, 128, interleaved, streaming, True)
                   for dtype in (torch.bfloat16, torch.float32) for interleaved in (False, True) for streaming in (False, True)]
TABLE_INSTANCES += [compiled.rotary_token_norm_instance(dtype, interleaved, 4096, True)
                    for dtype in (torch.bfloat16, torch.float32) for interleaved in (False, True)]


@pytest.mark.parametrize("instance", TABLE_INSTANCES, ids=lambda instance: instance.name_expression.replace(" ", ""))
def test_tables_instances_compile_with_nvrtc_without_local_memory(instance):
    """LTX-2's and LTX-Video's instances (Dh 128, D 4096), sm_90: a cubin, no spills, no stack.
    Every instance: tests/test_cuda_compile.py under -m exhaustive."""
    nvrtc = pytest.importorskip("ditops.backends.cuda.nvrtc")
    result = nvrtc.compile_instance(instance, "sm_90")
    assert result.cubin[:4] == b"\x7fELF"
    assert 0 < result.registers <= 255 and result.spill_bytes == 0 and result.stack_bytes == 0


def test_tables_instances_compile_with_hiprtc():
    hiprtc = pytest.importorskip("ditops.backends.rocm.hiprtc")
    try:
        code = hiprtc.compile_instances(TABLE_INSTANCES[:2] + TABLE_INSTANCES[-2:], "gfx90a")
    except (ImportError, OSError) as error:  # hip-python without a loadable hiprtc
        pytest.skip(f"hiprtc: {error}")
    assert len(code.lowered_names) == 4


def test_triton_tables_specializations_compile_ahead_of_time():
    """The rotary kernel's TABLES specializations (interleaved, NeoX, token norm) compile for
    sm_90 (every one of them: tests/test_triton_compile.py under -m exhaustive)."""
    from test_triton_compile import _compile_ahead_of_time, specializations

    chosen = {}
    for specialization in specializations("sm_90"):
        kernel, _, constants, _ = specialization
        constants = dict(constants)
        if kernel == "rotary_kernel" and constants.get("TABLES"):
            chosen.setdefault((constants["INTERLEAVED"], constants["TOKEN_NORM"]), specialization)
    assert set(chosen) == {(interleaved, token_norm) for interleaved in (False, True) for token_norm in (False, True)}
    _compile_ahead_of_time("sm_90", chosen.values())


# ----- the benchmark ---------------------------------------------------------------------------


def test_bytes_of_the_tables():
    """Per distinct (item, position) row, each head's pairs' cos and sin once; a stride-0 head
    axis once for every head; the interleaved tables' repeated values not counted."""
    q, k = randn(B, S, H, DH), randn(B, S, H, DH, seed=1)
    rows = 2 * (q.numel() + k.numel()) * 4
    _, (cos, sin) = ltx_tables("interleaved", torch.float32)
    assert minimum_bytes("rope_", dict(q=q, k=k, cos_sin_cache=None, cos=cos, sin=sin)) == rows + 2 * B * S * H * 8 * 4
    shared = randn(S, 1, 8).expand(S, H, 8)
    assert minimum_bytes("rope_", dict(q=q, k=k, cos_sin_cache=None, cos=shared, sin=shared)) == rows + 2 * S * 8 * 4
    positions = torch.zeros(B, S, dtype=torch.int64)
    arguments = dict(q=q, k=k, cos_sin_cache=None, cos=cos, sin=sin, positions=positions)
    assert minimum_bytes("rope_", arguments) == rows + 2 * B * S * H * 8 * 4 + positions.numel() * 8


@pytest.mark.parametrize("op", ["rope_", "qk_norm_rope_"])
def test_eager_baseline_matches_the_reference_with_tables(op):
    for name, spec in SPECS[op].conformance.items():
        if not name.startswith("tables-") or spec.k_none or not spec.leading[0]:
            continue
        arguments = SPECS[op].build(spec, torch.float32, "cpu", torch.Generator().manual_seed(3))
        eager = baselines.EAGER[op](**arguments)
        reference = getattr(ditops, op)(**{key: value.clone() if isinstance(value, torch.Tensor) and key in ("q", "k")
                                           else value for key, value in arguments.items()}, backend="reference")
        for got, want in zip(eager, reference):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)

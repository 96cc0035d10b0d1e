"""The conformance checker itself must catch wrong implementations (tests/broken_registry.yaml)."""

import functools
import inspect

import pytest
import torch

from conftest import TESTS
from ditops import conformance, dispatch
from ditops.backends import reference
from ditops.examples import example_arguments
from ditops.ops import PUBLIC

CASE = next(case for case in conformance.CASES if case.id == "norm_scale_shift-hunyuan-chunked-mod")


@pytest.fixture
def broken_backends():
    dispatch.load_config(TESTS / "broken_registry.yaml")


@pytest.mark.parametrize("dtype", conformance.DTYPES, ids=str)
def test_unwritten_rows_fail(broken_backends, dtype):
    outcome = conformance.run_case(CASE, "broken", dtype)
    assert outcome.status == "fail"
    assert "NaN where the reference has none (unwritten or wrong)" in outcome.detail


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_small_errors_fail_where_the_tolerance_is_tighter(broken_backends, dtype):
    outcome = conformance.run_case(CASE, "sloppy", dtype)
    assert outcome.status == "fail"
    assert "elements off by more than" in outcome.detail


def test_a_cached_automatic_call_with_other_bits_fails(monkeypatch):
    """Where dispatch picks the backend by itself (the reference, for CPU tensors), the public
    op runs twice without an override (the call that builds its plan, then the cached one) and
    each must give the direct call's bits."""
    automatic = []
    public = PUBLIC[CASE.op]

    @functools.wraps(public)  # its signature too, which conformance binds arguments to
    def second_automatic_call_off(**arguments):
        result = public(**arguments)
        if "backend" not in arguments:
            automatic.append(result)
            if len(automatic) == 2:
                result = torch.nextafter(result, torch.full_like(result, float("inf")))
        return result

    monkeypatch.setitem(conformance.PUBLIC, CASE.op, second_automatic_call_off)
    assert conformance.run_case(CASE, "reference", torch.float32, automatic=False).status == "pass"
    assert automatic == []
    outcome = conformance.run_case(CASE, "reference", torch.float32)
    assert len(automatic) == 2
    assert outcome.status == "fail"
    assert outcome.detail == "y: the second automatic call of the public op is not bitwise equal to the direct call"


def test_every_op_has_cases_with_the_required_variety():
    names = {case.op: set() for case in conformance.CASES}
    for case in conformance.CASES:
        names[case.op].add(case.name)
    assert set(names) == set(dispatch.OPS)
    for op, cases in names.items():
        assert {"misaligned", "empty"} <= cases, op
    assert {"odd-d1000-token-mod", "per-frame", "strided-x", "expanded-mod", "nan-inf"} <= names["norm_scale_shift"]
    assert {"llm-gqa-neox", "dh80-int32-positions", "dh96-mqa-neox", "partial-rotary", "qkv-views"} <= names["rope_"]


def test_oracle_rounds_the_stored_residual_before_the_norm():
    """y must be checked against the norm of residual_out as stored, per docs/ops.md."""
    case = next(c for c in conformance.CASES if c.id == "residual_norm_scale_shift-wan1.3b-fp32-mod")
    arguments = case.arguments(torch.bfloat16, "cpu")
    y, residual_out = conformance.oracle(case.op, arguments, torch.bfloat16)
    rounded = residual_out.to(torch.bfloat16).double()
    assert not torch.equal(rounded, residual_out)
    expected_y = reference.norm_scale_shift(rounded, arguments["scale"].double(), arguments["shift"].double(),
                                            arguments["weight"].double(), arguments["bias"].double())
    torch.testing.assert_close(y, expected_y, rtol=0, atol=0)


@pytest.mark.parametrize("op", ["add_gate_norm_scale_fp8", "residual_norm_scale_shift"])
def test_the_outputs_of_a_stored_intermediate_are_expected_from_the_backends_intermediate(op):
    """A backend whose float32 sum rounds one element of the stored intermediate to the
    neighbouring bfloat16 value (one bf16 ulp) is judged by the norm of what it stored: y's
    expectation follows the changed element, the intermediate's own stays the float64 one."""
    case = next(c for c in conformance.CASES if c.op == op)
    arguments = case.arguments(torch.bfloat16, "cpu")
    expected = conformance.oracle(op, arguments, torch.bfloat16)
    names = conformance.SPECS[op].result_names
    where = names.index(conformance.SPECS[op].intermediate)
    flipped = expected[where].to(torch.bfloat16)
    flipped.view(-1)[3] = torch.nextafter(flipped.view(-1)[3:4], torch.tensor([1e30], dtype=torch.bfloat16))[0]
    actual = tuple(flipped if i == where else t for i, t in enumerate(expected))
    rederived = conformance.as_stored(op, arguments, torch.bfloat16, expected, actual)
    assert torch.equal(rederived[where], expected[where])
    y = names.index("y")
    assert not torch.equal(rederived[y], expected[y])  # the flipped element changed its row's norm
    widened = {name: value.double() if torch.is_tensor(value) and value.is_floating_point() else value
               for name, value in arguments.items()}
    if op == "residual_norm_scale_shift":
        wanted = reference.norm_scale_shift(flipped.double(), widened["scale"], widened["shift"], widened["weight"],
                                            widened["bias"])
    else:  # add_gate_norm_scale's y has no shift
        wanted = reference.norm_scale_shift_fp8(flipped.double(), widened["scale"], torch.zeros((), dtype=torch.float64),
                                                widened["weight2"], widened["bias2"], norm=widened["norm"],
                                                eps=widened["eps"])[0]
    torch.testing.assert_close(rederived[y], wanted, rtol=0, atol=0)
    unstored = next(c for c in conformance.CASES if c.op == "norm_scale_shift").arguments(torch.bfloat16, "cpu")
    plain = conformance.oracle("norm_scale_shift", unstored, torch.bfloat16)
    assert conformance.as_stored("norm_scale_shift", unstored, torch.bfloat16, plain, plain) is plain


@pytest.mark.parametrize("op", [op for op, spec in conformance.SPECS.items() if spec.intermediate])
def test_as_stored_equals_the_oracle_run_again_on_the_stored_intermediate(op):
    """as_stored hands the spec's oracle the expectation in place of the reference's results:
    bit for bit what the oracle gives when the reference runs again, for every such op."""
    case = next(c for c in conformance.CASES if c.op == op)
    arguments = case.arguments(torch.bfloat16, "cpu")
    expected = conformance.oracle(op, arguments, torch.bfloat16)
    where = conformance.SPECS[op].result_names.index(conformance.SPECS[op].intermediate)
    stored = expected[where].to(torch.bfloat16)
    stored.view(-1)[::5] = torch.nextafter(stored.view(-1)[::5], torch.full_like(stored.view(-1)[::5], 1e30))
    actual = tuple(stored if i == where else t for i, t in enumerate(expected))
    shortcut = conformance.as_stored(op, arguments, torch.bfloat16, expected, actual)
    again = conformance.oracle(op, arguments, torch.bfloat16, stored)
    assert len(shortcut) == len(again)
    for name, got, wanted in zip(conformance.SPECS[op].result_names, shortcut, again):
        assert torch.equal(got.isnan(), wanted.isnan()) and torch.equal(got.nan_to_num(), wanted.nan_to_num()), name


@pytest.mark.parametrize("op", [op for op in PUBLIC if "eps" in inspect.signature(PUBLIC[op]).parameters])
def test_oracle_normalises_with_the_calls_eps(op):
    """Every norm of the oracle must use the call's eps (the second norm of the fused ops once
    took the default): with eps = 0.5 the oracle agrees with the reference backend, not with eps = 1e-6."""
    arguments = {**example_arguments(op, (1, 8, 16), torch.float32, seed=4), "eps": 0.5}
    expected = conformance.oracle(op, arguments, torch.float32)
    outputs = PUBLIC[op](**{name: value.double() if torch.is_tensor(value) and value.is_floating_point() else value
                            for name, value in arguments.items()}, backend="reference")
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert len(outputs) == len(expected)
    if conformance.SPECS[op].quantized:  # FP8 values: within half a step of the oracle's unrounded ones
        assert conformance.compare_fp8("y", outputs[0], expected[0]) is None
        outputs, expected = outputs[1:], expected[1:]
    for output, oracle_output in zip(outputs, expected):
        torch.testing.assert_close(output.double(), oracle_output, rtol=1e-6, atol=1e-6)
    default_eps = conformance.oracle(op, {**arguments, "eps": 1e-6}, torch.float32)
    assert any(not torch.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in zip(default_eps, expected))


def test_compare_fp8_takes_the_nearest_step_and_refuses_the_next_one():
    expected = torch.tensor([1.0, 3.3, -100.0, 0.004, float("nan")], dtype=torch.float64)
    rounded = expected.to(torch.float8_e4m3fn)
    assert conformance.compare_fp8("y", rounded, expected) is None
    off = rounded.clone()
    off[1] = 3.5  # 3.3 rounds to 3.25; 3.5 is a step further
    assert "1 elements beyond half an FP8 step" in conformance.compare_fp8("y", off, expected)
    unwritten = rounded.clone()
    unwritten[4] = 0.0
    assert "NaN in one of actual and reference" in conformance.compare_fp8("y", unwritten, expected)
    assert "wanted [5] FP8" in conformance.compare_fp8("y", expected.float(), expected)

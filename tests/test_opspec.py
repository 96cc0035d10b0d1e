"""An op added through a spec entry and a reference function alone gets everything the
built-in ops have: its public function, its torch.library op, ``explain``, a conformance case
and a benchmark case (docs/extending.md walks through the same steps)."""

from typing import Optional

import pytest
import torch
from torch import Tensor

import ditops
from ditops import conformance, ops, opspec, validation
from ditops.bench import cases as bench_cases
from ditops.dispatch import describe, dispatcher, registry
from ditops.dispatch.contract import Kernel
from ditops.inputs import RowSpec, activation, random

OP = "toy_rms_scale"


def toy_rms_scale(x: Tensor, weight: Tensor, *, bias: Optional[Tensor] = None, eps: float = 1e-6) -> Tensor:
    """``y = x / rms(x) * weight + bias`` over the last dimension."""


def _reference(x, weight, bias=None, eps=1e-6, y=None):
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.to(compute)
    result = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps) * weight.to(compute)
    if bias is not None:
        result = result + bias.to(compute)
    return result.to(x.dtype) if y is None else y.copy_(result)


def _check(x, weight, bias, eps, describe_call=True):
    validation.tensor(OP, "x", x)
    shape = validation.rows(OP, "x", x)
    if weight is None:
        validation.fail(OP, "weight", "is None", f"a tensor of shape [{shape.hidden}]")
    validation.affine(OP, "weight", weight, shape.hidden, x.device)
    validation.affine(OP, "bias", bias, shape.hidden, x.device)
    validation.eps(OP, eps)
    if describe_call and x.numel():
        return describe((x,), (weight, bias), hidden_size=shape.hidden, batch_size=shape.batch, norm="rms")


def _build(inputs: RowSpec, dtype, device, generator) -> dict:
    shape = (inputs.batch, inputs.tokens, inputs.hidden)
    return dict(x=activation(generator, device, dtype, shape, inputs.layout),
                weight=random(generator, device, inputs.param_dtype or dtype, inputs.hidden),
                bias=random(generator, device, inputs.param_dtype or dtype, inputs.hidden) if inputs.affine else None)


SPEC = opspec.OpSpec(
    toy_rms_scale, _check, _reference, _build, outputs=("y",),
    conformance={"odd-d": RowSpec(2, 5, 100), "strided": RowSpec(1, 4, 64, layout="strided", affine=False)},
    bench=(opspec.BenchShape("toy", "B1 S64 D128", RowSpec(1, 64, 128)),),
    default_shape=(1, 16, 64), typical=lambda shape, param_dtype: RowSpec(*shape),
)


@pytest.fixture(scope="module")
def toy():
    """The toy op, added once per process (torch.library keeps a definition for the process);
    the tables that list ops forget it afterwards, so that other tests see the built-in ops alone."""
    public = ops.add_op(SPEC)
    yield public
    for table in (ops.OPS, ops.PUBLIC, registry.OPS, opspec.SPECS):
        table.pop(OP, None)
    dispatcher().reload()


def test_the_spec_gives_a_public_function_with_its_signature_and_backend(toy):
    assert toy.__name__ == OP and toy.__doc__ == toy_rms_scale.__doc__
    parameters = list(ops.inspect.signature(toy).parameters)
    assert parameters == ["x", "weight", "bias", "eps", "backend"]
    x, weight = torch.randn(2, 3, 8), torch.randn(8)
    expected = _reference(x.double(), weight.double()).float()
    torch.testing.assert_close(toy(x, weight), expected)
    torch.testing.assert_close(toy(x, weight, backend="reference"), expected)
    with pytest.raises(ValueError, match="weight"):
        toy(x, torch.randn(7))
    with pytest.raises(TypeError):
        toy(x, weight, 0.5)  # bias and eps are keyword-only, as the spec's signature says


def test_the_spec_gives_a_torch_library_op_that_passes_opcheck(toy):
    assert str(getattr(torch.ops.ditops, OP).default._schema) == (
        f"ditops::{OP}(Tensor x, Tensor weight, Tensor? bias, float eps, str? backend) -> Tensor")
    x, weight, bias = torch.randn(2, 3, 8), torch.randn(8), torch.randn(8)
    torch.library.opcheck(getattr(torch.ops.ditops, OP), (x, weight, bias, 1e-6, None))
    compiled = torch.compile(lambda x, w, b: toy(x, w, bias=b) * 2, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, weight, bias), toy(x, weight, bias=bias) * 2)


def test_the_spec_gives_explain_and_runs_on_the_reference_alone(toy):
    explanation = ditops.explain(OP, torch.randn(2, 3, 8), torch.randn(8))
    assert explanation.selected == "reference"
    assert [row[0] for row in explanation.candidates] == ["reference"]


def test_the_spec_gives_conformance_cases_that_pass_on_the_reference(toy):
    cases = [case for case in conformance._cases() if case.op == OP]
    assert [case.name for case in cases] == ["odd-d", "strided"]
    for case in cases:
        for dtype in conformance.DTYPES:
            assert conformance.run_case(case, "reference", dtype) == conformance.Outcome("pass")


def test_the_conformance_checker_catches_a_wrong_toy_kernel(toy, monkeypatch):
    """The toy's conformance is a real check: a reference off by 1e-2 fails it."""
    case = next(case for case in conformance._cases() if case.op == OP)
    implementation = conformance.implementations_of(OP, "reference")[0]
    wrong = Kernel(lambda x, w, b, eps, y: y.copy_(_reference(x, w, b, eps) * 1.01))
    monkeypatch.setattr(type(implementation), "kernel", property(lambda self: wrong))
    assert conformance.run_case(case, "reference", torch.float32).status == "fail"


def test_the_spec_gives_a_bench_case(toy):
    (case,) = [bench_cases.case(OP, shape) for shape in SPEC.bench]
    arguments = case.build("cpu", torch.float32, torch.Generator().manual_seed(0))
    assert arguments["x"].shape == (1, 64, 128)
    # x and weight and bias read once, y written once
    assert bench_cases.minimum_bytes(OP, arguments) == (2 * 64 * 128 + 2 * 128) * 4
    torch.testing.assert_close(toy(**arguments), _reference(**arguments))

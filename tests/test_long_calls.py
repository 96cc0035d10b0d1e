"""Calls with more rows than a GPU runs at once: blocks (cuda) and programs (triton) come in
several waves, and the last is partly empty. Conformance cases are a few rows long, so these
check every row of every row op against the float64 oracle at lengths of real models. GPU
only: the CPU has no compiled kernels, and the Triton interpreter would take minutes here."""

import pytest
import torch

from ditops import conformance
from ditops.dispatch.registry import OPS
from ditops.examples import HEAD_OPS, RowSpec, build

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels need a GPU")

ROW_OPS = [op for op in OPS if op not in HEAD_OPS]
# 24000 rows of 256 with per-token modulation (an H100 or H200 runs at most 2048 threads on each
# of its 132 SMs: 8448 such rows at 32 threads a row), and 2 x 6000 rows of 3072.
SPECS = {
    "short-rows": RowSpec(2, 12000, 256, "token", "token1", "token"),
    "flux-rows": RowSpec(2, 6000, 3072),
}


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("op", ROW_OPS)
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_calls_of_many_waves_match_the_oracle(backend, op, spec):
    case = conformance.Case(op, spec, lambda dtype, device, g: build(op, SPECS[spec], dtype, device, g))
    outcome = conformance.run_case(case, backend, torch.bfloat16, "cuda")
    assert outcome.status == "pass", outcome.detail

"""Every backend of the registry against the float64 oracle (ditops.conformance).

One parametrized test: op x backend x dtype x case. Runs on the GPU when there is one;
without one, the Triton kernels run in Triton's interpreter on a simulated sm_90 (see
conftest.py). A backend that cannot run here, or refuses a case, is skipped with its reason.

The interpreter takes seconds per case, so on the CPU the default run gives each Triton case
one dtype, rotating float32, float16, bfloat16 over an op's cases: every case and, per op,
every dtype still runs; the long cases (conformance.LONG_CASES) run on a GPU only. The rest of the grid is marked ``exhaustive`` (``pytest -m
exhaustive``). On a GPU, and for every other backend, the whole grid runs by default.
"""

import contextlib
import os

import pytest
import torch

from ditops import conformance
from ditops.dispatch import simulated_device

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"

# The interpreter rounds float32 to bfloat16 toward zero (triton/runtime/interpreter.py,
# cast_impl), where GPUs round to nearest even. Ops that normalise a stored bfloat16
# intermediate amplify that one-ulp difference past the tolerance, so they are checked in
# bfloat16 on the GPU only.
STORED_INTERMEDIATE = {"residual_norm_scale_shift", "residual_norm_scale_shift_select", "add_gate_norm_scale"}


def _rotated_dtype(case) -> torch.dtype:
    """The one dtype a case runs in, by default, in the interpreter: its position among its op's cases."""
    same_op = [other for other in conformance.CASES if other.op == case.op]
    dtypes = conformance.DTYPES
    if case.op in STORED_INTERMEDIATE:  # bfloat16 is skipped there (above): rotate the other two
        dtypes = tuple(dtype for dtype in dtypes if dtype != torch.bfloat16)
    return dtypes[same_op.index(case) % len(dtypes)]


def _grid() -> list:
    parameters = []
    # the long cases on a GPU only: their rows would take the interpreter minutes
    for case in conformance.CASES + (conformance.LONG_CASES if DEVICE == "cuda" else []):
        for backend in conformance.backends():
            for dtype in conformance.DTYPES:
                beyond_rotation = INTERPRETED and backend == "triton" and dtype != _rotated_dtype(case)
                marks = (pytest.mark.exhaustive,) if beyond_rotation else ()
                test_id = f"{case.id}-{backend}-{str(dtype).removeprefix('torch.')}"
                parameters.append(pytest.param(case, backend, dtype, marks=marks, id=test_id))
    return parameters


@pytest.mark.parametrize("case, backend, dtype", _grid())
def test_conformance(case, backend, dtype):
    interpreted = INTERPRETED and backend == "triton"
    if interpreted and dtype == torch.bfloat16 and case.op in STORED_INTERMEDIATE:
        pytest.skip("the Triton interpreter rounds to bfloat16 toward zero: checked on the GPU")
    if interpreted and conformance.SPECS[case.op].quantized:
        pytest.skip("the Triton interpreter converts float32 to FP8 wrongly (Triton 3.9: -7.87 -> -4, NaN -> 384): "
                    "checked on the GPU; tests/test_fp8.py checks these kernels up to the final rounding")
    with simulated_device("sm_90") if interpreted else contextlib.nullcontext():
        reason = conformance.unavailable_reason(backend, DEVICE)
        if reason:
            pytest.skip(f"{backend} cannot run on {DEVICE}: {reason}")
        # The automatic calls run where dispatch picks this backend, but not in the interpreter:
        # two more interpreted calls per case would double the CPU run; on a GPU they run.
        outcome = conformance.run_case(case, backend, dtype, DEVICE, automatic=not interpreted)
    if outcome.status == "skip":
        pytest.skip(f"{backend} refuses {case.id}: {outcome.detail}")
    assert outcome.status == "pass", outcome.detail


def test_the_default_run_covers_every_case_and_every_dtype_of_each_op_in_the_interpreter():
    """The rotation drops dtypes per case, never a case, nor a dtype of an op."""
    for op in {case.op for case in conformance.CASES}:
        cases = [case for case in conformance.CASES if case.op == op]
        dtypes = {_rotated_dtype(case) for case in cases}
        wanted = set(conformance.DTYPES) - ({torch.bfloat16} if op in STORED_INTERMEDIATE else set())
        assert dtypes == wanted, op

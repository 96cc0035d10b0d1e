"""Every backend of the registry against the float64 oracle (ditops.conformance).

One parametrized test: op x backend x dtype x case. Runs on the GPU when there is one.
A backend that cannot run here, or refuses a case, is skipped with its reason.
"""

import pytest
import torch

from ditops import conformance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", conformance.DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("backend", conformance.backends())
@pytest.mark.parametrize("case", conformance.CASES, ids=lambda case: case.id)
def test_conformance(case, backend, dtype):
    reason = conformance.unavailable_reason(backend, DEVICE)
    if reason:
        pytest.skip(f"{backend} cannot run on {DEVICE}: {reason}")
    outcome = conformance.run_case(case, backend, dtype, DEVICE)
    if outcome.status == "skip":
        pytest.skip(f"{backend} refuses {case.id}: {outcome.detail}")
    assert outcome.status == "pass", outcome.detail

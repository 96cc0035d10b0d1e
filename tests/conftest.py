import os
import pathlib

import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors (under a simulated
# GPU device). It must be chosen before Triton compiles anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ditops import dispatch  # noqa: E402
TESTS = pathlib.Path(__file__).parent


@pytest.fixture(autouse=True)
def fresh_dispatcher(monkeypatch):
    """Every test starts from the built-in registry and a clean environment."""
    for variable in ("DITOPS_BACKEND", "DITOPS_CONFIG", "DITOPS_DEBUG"):
        monkeypatch.delenv(variable, raising=False)
    dispatch.reset()
    yield
    monkeypatch.undo()
    dispatch.reset()


@pytest.fixture
def toy_registry():
    dispatch.load_config(TESTS / "toy_registry.yaml")
    return TESTS / "toy_registry.yaml"


# What the default run leaves to `pytest -m exhaustive` (the marker is registered in
# pyproject.toml): the ahead-of-time compiles of other archs of the same vendor. Every kernel
# instance and specialization still compiles by default for one NVIDIA arch (sm_90) and, for
# Triton, one AMD arch (gfx942); the full arch list costs about 10 CPU-minutes more and runs
# when kernels change. The Triton interpreter's conformance grid is thinned in
# tests/conformance/test_conformance.py, next to its parameters.
EXHAUSTIVE_PARAMETERS = {
    "test_ahead_of_time_compile": ("target_name", {"sm_80", "gfx90a", "gfx950"}),  # tests/test_triton_compile.py
    "test_instance_compiles_to_cubin_without_local_memory": ("arch", {"sm_80"}),  # tests/test_cuda_compile.py
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        rule = EXHAUSTIVE_PARAMETERS.get(item.originalname)
        callspec = getattr(item, "callspec", None)
        if rule and callspec is not None and callspec.params.get(rule[0]) in rule[1]:
            item.add_marker(pytest.mark.exhaustive)

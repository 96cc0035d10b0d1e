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
# pyproject.toml): the ahead-of-time compiles for more than one arch per vendor and kernel
# language. By default every kernel instance and specialization still compiles: Triton for
# sm_90 and gfx942, the C++ kernels for sm_90 (NVRTC) and gfx90a (hiprtc, the rocm backend's
# own path). The other archs (Triton sm_80, gfx90a, gfx950; NVRTC sm_80; clang gfx942) cost
# about 5 CPU-minutes more on a warm Triton cache and run when kernels change. The Triton
# interpreter's conformance grid is thinned in tests/conformance/test_conformance.py.
EXHAUSTIVE_PARAMETERS = {  # test function -> (parameter, values left to -m exhaustive)
    "test_ahead_of_time_compile": ("target_name", {"sm_80", "gfx90a", "gfx950"}),  # tests/test_triton_compile.py
    "test_instance_compiles_to_cubin_without_local_memory": ("arch", {"sm_80"}),  # tests/test_cuda_compile.py
}
EXHAUSTIVE_TESTS = {"test_clang_compiles_every_instance_for_gfx942"}  # tests/test_rocm_compile.py


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        rule = EXHAUSTIVE_PARAMETERS.get(item.originalname)
        callspec = getattr(item, "callspec", None)
        if item.originalname in EXHAUSTIVE_TESTS or rule and callspec is not None and callspec.params.get(rule[0]) in rule[1]:
            item.add_marker(pytest.mark.exhaustive)

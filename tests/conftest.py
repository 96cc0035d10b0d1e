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


def script_module(relative_path: str):
    """A script of the repository (scripts/, benchmarks/: folders that are not packages) as a module."""
    import importlib.util

    path = TESTS.parent / relative_path
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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

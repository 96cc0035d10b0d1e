import pathlib

import pytest

from ditops import dispatch

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

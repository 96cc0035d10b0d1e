"""Running a tiny diffusers model, and recording what a model patched by ditops calls."""

import pytest
import torch

integration = pytest.importorskip("ditops.integrations.diffusers")

# What one op's output may differ by (docs/ops.md); a patched model's output may differ from
# diffusers' by as much per block the signal goes through (the dtype-taking builders' third value)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}


def run(model, inputs) -> torch.Tensor:
    """The model's output sample for ``inputs`` in float32, computed without autograd."""
    with torch.no_grad():
        sample = model(**inputs).sample
    return torch.stack(sample).float() if isinstance(sample, list) else sample.float()  # Z-Image: one per image


def recorded_calls(monkeypatch, names) -> list:
    """The names of the ops among `names` that the integration calls, in call order."""
    calls = []
    for name in names:
        original = getattr(integration.ops, name)
        monkeypatch.setattr(integration.ops, name,
                            lambda *a, _original=original, _name=name, **k: calls.append(_name) or _original(*a, **k))
    return calls


def block_call(model, inputs, block) -> tuple:
    """The positional and keyword arguments `block` gets in one forward of the model."""
    captured = []
    handle = block.register_forward_pre_hook(lambda module, args, kwargs: captured.append((args, kwargs)),
                                             with_kwargs=True)
    run(model, inputs)
    handle.remove()
    return captured[0]


def assert_traces_as_one_graph(block, arguments, ops, keywords=None) -> None:
    """torch.compile(fullgraph=True) of `block`: one graph with the ditops `ops` as nodes, and
    the eager output within one op's tolerance."""
    keywords = keywords or {}
    with torch.no_grad():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(block)(*arguments, **keywords)
        expected = block(*arguments, **keywords)
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(*arguments, **keywords)
    assert explained.graph_break_count == 0 and len(explained.graphs) == 1
    for op in ops:
        assert f"torch.ops.ditops.{op}" in explained.graphs[0].code, f"{op} is not a node of the traced graph"
    torch.testing.assert_close(compiled, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])

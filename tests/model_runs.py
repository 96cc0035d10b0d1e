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

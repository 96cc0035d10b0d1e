"""Every patched diffusers family in a CUDA graph: the tiny model of each family (bf16, and
with ``quantize="fp8"`` where the GPU has an FP8 GEMM) captured once, then replayed on new
activations copied into the captured inputs, gives what the same patched model computes
eagerly on them. A family whose unpatched diffusers model cannot be captured is skipped with
diffusers' error; the patched one must capture wherever the unpatched one does."""

import os
import sys
import warnings

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
diffusers = pytest.importorskip("diffusers")
sys.path.insert(0, os.path.dirname(__file__))
from fp8_checks import TINY  # noqa: E402

from ditops.integrations import diffusers as integration  # noqa: E402


def to_cuda(value):
    if isinstance(value, (list, tuple)):  # lists of per-image tensors; (cos, sin) rotary tables
        return type(value)(to_cuda(item) for item in value)
    return value.cuda() if isinstance(value, torch.Tensor) else value


def activations(inputs) -> list:
    """The captured inputs a new step changes: the hidden states of every stream (not ids,
    timesteps or masks)."""
    found = []
    for key, value in inputs.items():
        if "hidden_states" in key:
            found += value if isinstance(value, list) else [value]
    return [tensor for tensor in found if isinstance(tensor, torch.Tensor) and tensor.is_floating_point()]


def sample(output) -> torch.Tensor:
    output = output.sample if hasattr(output, "sample") else output[0]
    return torch.stack(output) if isinstance(output, list) else output  # Z-Image: one per image


def captured(model, inputs):
    """(graph, its output) of one forward, after two warm-up forwards on a side stream (the
    kernels compiled and the call plans cached before capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(2):
            model(**inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        output = sample(model(**inputs))
    return graph, output


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("name", TINY)
def test_every_family_replays_in_a_cuda_graph_as_it_runs_eagerly(name, quantize):
    if quantize and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm_89 or newer")
    model, inputs, _ = TINY[name](torch.bfloat16)
    model, inputs = model.cuda(), {key: to_cuda(value) for key, value in inputs.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' notes during capture
        try:
            captured(model, inputs)
        except Exception as error:  # noqa: BLE001  diffusers' own code refuses capture: nothing of ditops to test
            pytest.skip(f"the unpatched {name} model does not capture: {type(error).__name__}: {str(error)[:200]}")
        integration.apply(model, quantize=quantize)
        graph, output = captured(model, inputs)
        first = output.clone()  # not output.float(): a float32 output (MiniMax-H3's) would be output itself
        generator = torch.Generator("cuda").manual_seed(7)
        for tensor in activations(inputs):
            tensor.copy_(torch.randn(tensor.shape, generator=generator, device="cuda", dtype=tensor.dtype))
        graph.replay()
        with torch.no_grad():
            expected = sample(model(**inputs)).float()
    got = output.float()
    assert torch.isfinite(got).all() and not torch.equal(output, first)  # the replay read the new activations
    assert (got - expected).norm() / expected.norm() < 1e-3

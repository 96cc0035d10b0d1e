"""CUDA-graph capture and replay give the eager results, for every op and every backend that
runs on this GPU (kernels launch on the current stream and allocate nothing host-side), and
for the automatic choice: its captured call is a cached call (the warm-up built its plan),
which reads the capturing stream in C (dispatch/cached_call.c)."""

import pytest
import torch

from ditops import conformance
from ditops.dispatch import OPS
from ditops.examples import example_arguments
from ditops.ops import PUBLIC

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

SHAPES = {op: (2, 40, 1000) for op in OPS} | {"qk_norm_rope_": (2, 17, 6, 128), "rope_": (33, 4, 80)}


def outputs(op, arguments, result):
    if op in ("qk_norm_rope_", "rope_"):
        return [arguments["q"], arguments["k"]]
    return [result] if isinstance(result, torch.Tensor) else list(result)


def fresh(op, seed):
    # float32 modulation and weights with bfloat16 activations (Wan): every kernel backend takes it
    return example_arguments(op, SHAPES[op], torch.bfloat16, "cuda", seed=seed, param_dtype=torch.float32)


@pytest.mark.parametrize("backend", [*conformance.backends(), None], ids=lambda backend: backend or "auto")
@pytest.mark.parametrize("op", OPS)
def test_graph_replay_matches_eager(op, backend):
    if backend is not None and conformance.unavailable_reason(backend, "cuda"):
        pytest.skip(conformance.unavailable_reason(backend, "cuda"))
    static = fresh(op, seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        PUBLIC[op](**{name: value.clone() if isinstance(value, torch.Tensor) else value for name, value in static.items()}, backend=backend)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = outputs(op, static, PUBLIC[op](**static, backend=backend))
    for seed in (2, 3):  # the same graph, replayed on new values copied into its input buffers
        values = fresh(op, seed)
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                static[name].copy_(value)
        graph.replay()
        eager_arguments = fresh(op, seed)
        expected = outputs(op, eager_arguments, PUBLIC[op](**eager_arguments, backend=backend))
        torch.cuda.synchronize()
        for got, want in zip(captured, expected):
            assert torch.equal(got, want)

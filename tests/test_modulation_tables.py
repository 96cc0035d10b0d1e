"""Modulation tables read through a per-token modulation_index (docs/ops.md, "Modulation
tensors"): the reference and the Triton kernels (in Triton's interpreter on the CPU) against
the same call with each token's row selected beforehand, index values clamped into [0, K),
and the op as torch.library holds it (fake implementation, opcheck, torch.compile)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ditops
from ditops.conformance import _bitwise_equal
from ditops.dispatch import simulated_device

B, S, D, K = 2, 7, 96, 5
FP8 = dict(fp8_dtype=torch.float8_e4m3fn)
OPS = ["norm_scale_shift", "residual_norm_scale_shift", "norm_scale_shift_fp8", "residual_norm_scale_shift_fp8"]
INTERPRETED = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def table_call(op, dtype=torch.float32, index=None, x_shape=(B, S, D)):
    """A call of op with a [K, D] scale, a [B, K, D] shift and a [1, K, D] gate (the residual
    ops), an index [B, S] of values in [-2, K + 2) (some clamped) unless given."""
    tokens = x_shape[-2]
    if index is None:
        index = torch.randint(-2, K + 2, (x_shape[0] if len(x_shape) == 3 else 1, tokens),
                              generator=torch.Generator().manual_seed(9))
    arguments = dict(x=randn(*x_shape, seed=1, dtype=dtype), scale=randn(K, D, seed=2) * 0.5,
                     shift=randn(B if len(x_shape) == 3 else 1, K, D, seed=3), weight=randn(D, seed=4),
                     norm="rms", modulation_index=index)
    if op.startswith("residual"):
        arguments.update(residual=randn(*x_shape, seed=5, dtype=dtype), gate=randn(1, K, D, seed=6))
    return dict(arguments, **FP8) if op.endswith("_fp8") else arguments


def selected(arguments: dict) -> dict:
    """The same call with each token's row selected into per-token tensors (and no index), the
    index clamped by hand: min(max(value, 0), K - 1)."""
    index = arguments["modulation_index"]
    index = index if index.dim() == 2 else index.unsqueeze(0)
    out = {name: value for name, value in arguments.items() if name != "modulation_index"}
    for name in ("scale", "shift", "gate"):
        table = arguments.get(name)
        if table is None or table.dim() < 2:
            continue
        table = table if table.dim() == 3 else table.unsqueeze(0)
        batch = max(table.shape[0], index.shape[0])
        rows = torch.stack([torch.stack([table[b % table.shape[0], min(max(int(index[b % index.shape[0], s]), 0), K - 1)]
                                         for s in range(index.shape[1])]) for b in range(batch)])
        out[name] = rows  # [B, S, D], or [1, S, D] for a 2-D x
    return out


def results(op, arguments, backend):
    result = getattr(ditops, op)(**arguments, backend=backend)
    return result if isinstance(result, tuple) else (result,)


def on_triton():
    if not INTERPRETED:
        pytest.skip("Triton's interpreter on the CPU (on a GPU the conformance suite checks the table cases)")
    return simulated_device("sm_90")


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("op", OPS)
def test_a_table_call_equals_the_call_with_each_tokens_row_selected(op, backend):
    """Bitwise: reading the rows through the index is the same math as reading them per token."""
    with on_triton() if backend == "triton" else contextlib.nullcontext():
        for arguments in (table_call(op), table_call(op, torch.bfloat16),
                          table_call(op, x_shape=(S, D)),
                          table_call(op, index=torch.tensor([4, 0, 9, -7, 1, 2, 3], dtype=torch.int32))):
            for got, want in zip(results(op, arguments, backend), results(op, selected(arguments), backend)):
                assert _bitwise_equal(got, want), (op, backend)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("op", OPS)
def test_index_values_outside_the_table_are_clamped(op, backend):
    """Below 0 reads row 0, K or more reads row K - 1: no read leaves the table."""
    index = torch.tensor([[-1, 0, K, K - 1, -100, 1000, 2], [3, K + 1, -2, 0, K - 1, 1, 2 ** 31 - 1]])
    with on_triton() if backend == "triton" else contextlib.nullcontext():
        clamped = results(op, table_call(op, index=index.clamp(0, K - 1)), backend)
        for got, want in zip(results(op, table_call(op, index=index), backend), clamped):
            assert _bitwise_equal(got, want), (op, backend)


def test_triton_matches_the_reference_on_tables():
    arguments = table_call("residual_norm_scale_shift")
    with on_triton():
        triton = results("residual_norm_scale_shift", arguments, "triton")
    for got, want in zip(triton, results("residual_norm_scale_shift", arguments, "reference")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", OPS)
def test_the_fake_implementation_gives_the_outputs_shapes(op):
    arguments = table_call(op)
    ordered, _ = ditops.ops.ordered_arguments(op, **arguments)
    real = results(op, arguments, None)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = getattr(torch.ops.ditops, op)(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                               for a in ordered), None)
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_opcheck_with_tables(op, dtype):
    arguments, _ = ditops.ops.ordered_arguments(op, **table_call(op, dtype))
    torch.library.opcheck(getattr(torch.ops.ditops, op).default, (*arguments, None))


def minimax_block(x, residual, tables, index, weight):
    """MiniMax-H3's two norms: [K, D] chunks of one [K, 6 * D] table, rows picked through index."""
    shift, scale, gate, shift_mlp, scale_mlp, _ = tables.chunk(6, dim=-1)
    h = ditops.norm_scale_shift(x, scale, shift, weight=weight, norm="rms", modulation_index=index)
    return ditops.residual_norm_scale_shift(h, residual, gate, scale_mlp, shift_mlp, weight=weight, norm="rms",
                                            modulation_index=index)


def test_compile_fullgraph_keeps_table_calls_as_nodes_and_matches_eager():
    inputs = (randn(B, S, D, seed=1), randn(B, S, D, seed=2), randn(K, 6 * D, seed=3), torch.randint(0, K, (S,)),
              randn(D, seed=4))
    eager = minimax_block(*inputs)
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    traced = torch.compile(minimax_block, backend=record, fullgraph=True)(*inputs)
    assert len(graphs) == 1
    targets = {node.target for node in graphs[0].graph.nodes if node.op == "call_function"}
    assert {torch.ops.ditops.norm_scale_shift, torch.ops.ditops.residual_norm_scale_shift} <= targets
    inducted = torch.compile(minimax_block, fullgraph=True)(*inputs)
    for expected, graph_result, inductor_result in zip(eager, traced, inducted):
        torch.testing.assert_close(graph_result, expected, rtol=0, atol=0)
        torch.testing.assert_close(inductor_result, expected, rtol=1e-5, atol=1e-5)


def test_a_table_call_differentiates_its_tables():
    """Inputs that require grad run the reference, whose gather autograd differentiates."""
    x, table = randn(B, S, D, seed=1), randn(K, D, seed=2).requires_grad_()
    index = torch.randint(0, K, (B, S), generator=torch.Generator().manual_seed(3))
    ditops.norm_scale_shift(x, table, table, modulation_index=index).sum().backward()
    expected = torch.zeros(K, D)
    normed = torch.nn.functional.layer_norm(x, (D,), eps=1e-6)
    expected.index_add_(0, index.flatten(), (normed + 1).reshape(-1, D))
    torch.testing.assert_close(table.grad, expected, rtol=1e-5, atol=1e-5)

"""torch.library registration: opcheck of every op, and torch.compile(fullgraph=True) of a
DiT-block-like function that keeps the ops as graph nodes and matches eager."""

import pytest
import torch

import ditops
from ditops.dispatch import OPS
from ditops.examples import example_arguments
from ditops.ops import ordered_arguments

SMALL_SHAPES = {op: (2, 6, 48) for op in OPS} | {"qk_norm_rope_": (2, 6, 3, 32), "rope_": (10, 4, 64)}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_opcheck(op, dtype):
    arguments, _ = ordered_arguments(op, **example_arguments(op, SMALL_SHAPES[op], dtype))
    torch.library.opcheck(getattr(torch.ops.ditops, op).default, (*arguments, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_opcheck_quantize_fp8_with_a_prefix(dtype):
    """y [..., P + D]: the fake implementation's shapes must be the real one's."""
    x, prefix = torch.randn(2, 6, 48, dtype=dtype), torch.randn(2, 6, 16, dtype=dtype)
    arguments, _ = ordered_arguments("quantize_fp8", x, activation="gelu_tanh", prefix=prefix, fp8_dtype=torch.float8_e4m3fn)
    torch.library.opcheck(torch.ops.ditops.quantize_fp8.default, (*arguments, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_opcheck_qk_norm_rope_over_a_token(dtype):
    """norm_over="token": weights [H * Dh], GQA (Hk < Hq), the mode a string of the schema."""
    q, k = torch.randn(2, 6, 4, 32, dtype=dtype), torch.randn(2, 6, 2, 32, dtype=dtype)
    cache = ditops.rope_cos_sin_cache(6, 32)
    arguments, _ = ordered_arguments("qk_norm_rope_", q, k, torch.randn(128), torch.randn(64), cache, norm_over="token")
    torch.library.opcheck(torch.ops.ditops.qk_norm_rope_.default, (*arguments, None))


def test_compile_fullgraph_quantizes_a_prefix_and_x_in_one_node():
    """FLUX's single block: the attention output and the GELU MLP hidden state as one FP8 input."""

    def single_block(attention, mlp):
        return ditops.quantize_fp8(mlp, activation="gelu_tanh", prefix=attention * 2, fp8_dtype=torch.float8_e4m3fn)

    generator = torch.Generator().manual_seed(3)
    attention, mlp = torch.randn(2, 6, 32, generator=generator), torch.randn(2, 6, 64, generator=generator)
    eager = single_block(attention, mlp)
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    traced = torch.compile(single_block, backend=record, fullgraph=True)(attention, mlp)
    assert len(graphs) == 1
    assert torch.ops.ditops.quantize_fp8 in {node.target for node in graphs[0].graph.nodes if node.op == "call_function"}
    inducted = torch.compile(single_block, fullgraph=True)(attention, mlp)
    for result in (traced, inducted):
        assert result[0].shape == (2, 6, 96)
        assert torch.equal(result[0].view(torch.uint8), eager[0].view(torch.uint8)) and torch.equal(result[1], eager[1])


def test_in_place_ops_declare_their_mutations():
    for op in ("qk_norm_rope_", "rope_"):
        schema = getattr(torch.ops.ditops, op).default._schema
        mutated = [argument.name for argument in schema.arguments if argument.alias_info and argument.alias_info.is_write]
        assert mutated == ["q", "k"]


@pytest.mark.parametrize("op", OPS)
def test_the_traced_op_takes_the_public_ops_argument_types(op):
    """A GPU graph holds ``<op>_traced``, whose schema triton_op infers from a Python signature
    built from the op's: each argument keeps its type (a ScalarType must not become an int),
    then traced_state, the settings its traced choice read."""
    public = getattr(torch.ops.ditops, op).default._schema
    traced = getattr(torch.ops.ditops, op + "_traced").default._schema
    assert [(a.name, str(a.real_type)) for a in traced.arguments] == [
        (a.name, str(a.real_type)) for a in public.arguments] + [("traced_state", "str")]


def dit_block(x, residual, q, k, modulation, weight, cache, gate_index):
    """Norm, attention-side QK-norm + RoPE, gated residual, per-token selected modulation."""
    shift, scale, gate = modulation[:, 0], modulation[:, 1], modulation[:, 2]
    h = ditops.norm_scale_shift(x, scale, shift, weight=weight)
    ditops.qk_norm_rope_(q, k, weight[:32], weight[32:64], cache, position_offset=2)
    ditops.qk_norm_rope_(q, k, weight, weight.flip(0), cache, norm_over="token")  # Wan's norms: weights [H * Dh]
    attention = (q.flatten(-2) + k.flatten(-2)).repeat(1, 1, 1)[..., : x.shape[-1]]
    y, residual_out = ditops.residual_norm_scale_shift(h + attention, residual, gate, scale, shift, norm="rms")
    z, gate_out = ditops.norm_scale_shift_select(y, gate_index, scale, shift, gate, shift, scale, gate)
    out, w = ditops.add_gate_norm_scale(z, y, gate_out, scale, gate_act="tanh")
    ditops.rope_(q, k, cache, interleaved=False, position_offset=2)
    return out + w.sin(), residual_out, q, k


def block_inputs():
    generator = torch.Generator().manual_seed(7)
    randn = lambda *shape: torch.randn(shape, generator=generator)  # noqa: E731
    cache = ditops.rope_cos_sin_cache(16, 32)
    index = (torch.rand((2, 6), generator=generator) > 0.5).long()
    return (randn(2, 6, 96), randn(2, 6, 96), randn(2, 6, 3, 32), randn(2, 6, 3, 32), randn(2, 6, 96) * 0.1, randn(96), cache, index)


def test_compile_fullgraph_matches_eager_with_no_graph_break():
    eager = dit_block(*block_inputs())
    graphs = []

    def record(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    graph_result = torch.compile(dit_block, backend=record, fullgraph=True)(*block_inputs())
    assert len(graphs) == 1
    targets = {node.target for node in graphs[0].graph.nodes if node.op == "call_function"}
    for op in ("norm_scale_shift", "qk_norm_rope_", "residual_norm_scale_shift", "norm_scale_shift_select", "add_gate_norm_scale", "rope_"):
        assert getattr(torch.ops.ditops, op) in targets, f"{op} is not one node of the graph"
    inductor_result = torch.compile(dit_block, fullgraph=True)(*block_inputs())
    for expected, traced, inducted in zip(eager, graph_result, inductor_result):
        torch.testing.assert_close(traced, expected, rtol=0, atol=0)
        torch.testing.assert_close(inducted, expected, rtol=1e-5, atol=1e-5)


def test_compiled_call_validates_its_inputs():
    compiled = torch.compile(lambda x, s: ditops.norm_scale_shift(x, s, s), fullgraph=True)
    with pytest.raises(Exception, match="scale has shape \\[7\\]"):
        compiled(torch.randn(2, 3, 8), torch.randn(7))


def test_compile_differentiates_inputs_that_require_grad_as_eager_does():
    """Both paths run the reference math when gradients are needed (the registered op has no
    autograd formula): the compiled gradients equal the eager ones."""

    def loss(x, residual, q, k, modulation, weight, cache, index):
        out, residual_out, q_out, k_out = dit_block(x, residual, q * 1, k * 1, modulation, weight, cache, index)
        return out.square().sum() + residual_out.sum() + q_out.square().sum() + k_out.cos().sum()

    def gradients(function):
        inputs = block_inputs()
        for t in inputs[:6]:
            t.requires_grad_(True)
        function(*inputs).backward()
        return [t.grad for t in inputs[:6]]

    eager = gradients(loss)
    compiled = gradients(torch.compile(loss, fullgraph=True))
    for expected, actual in zip(eager, compiled):
        assert expected is not None and expected.abs().sum() > 0
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)

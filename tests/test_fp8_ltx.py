"""``apply(model, quantize="fp8")`` on LTX-Video and LTX-2 (ditops/integrations/diffusers/ltx2.py):
which Linears the blocks' norms feed FP8 rows, which quantise their own input, and the FP8
blocks under torch.compile; on CPU with the reference backend, as tests/test_fp8.py."""

import re
import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from fp8_checks import FP8_OPS, TINY, state_copy  # noqa: E402
from model_runs import block_call, recorded_calls, run  # noqa: E402
from tiny_models import built, in_dtype, tiny_ltx2  # noqa: E402

from ditops.fp8 import Float8Linear, Float8Rows  # noqa: E402
from ditops.integrations import diffusers as integration  # noqa: E402


def _tiny_ltx23_wide():
    """LTX-2.3's options (tiny_ltx2(ltx23=True)) with 16 heads per stream, so that the per-head
    gate logits (D -> heads) can be FP8 GEMMs."""
    model = built(diffusers.LTX2VideoTransformer3DModel, in_channels=8, out_channels=8, num_attention_heads=16,
                  attention_head_dim=8, cross_attention_dim=128, audio_in_channels=4, audio_out_channels=4,
                  audio_num_attention_heads=16, audio_attention_head_dim=4, audio_cross_attention_dim=64,
                  num_layers=2, caption_channels=24, rope_type="split", cross_attn_mod=True,
                  audio_cross_attn_mod=True, gated_attn=True, audio_gated_attn=True, perturbed_attn=True)
    return model, tiny_ltx2("split", ltx23=True)[1]


MODELS = {"ltx-video": TINY["ltx-video"], "ltx-2": TINY["ltx-2"], "ltx-2.3": in_dtype(_tiny_ltx23_wide)}

_LTX2_FED = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "audio_attn1.to_v", "audio_to_video_attn.to_q",
             "audio_to_video_attn.to_k", "video_to_audio_attn.to_v", "attn2.to_q", "audio_attn2.to_q", "ff.net.0.proj",
             "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")
_LTX2_OWN = ("attn1.to_out.0", "attn2.to_k", "attn2.to_v", "audio_attn2.to_k", "audio_to_video_attn.to_out.0")
# per model: (norm_scale_shift_fp8, residual_norm_scale_shift_fp8) calls per block, the Linears of
# each block fed FP8 rows, and those quantising their own input
EXPECTED = {
    "ltx-video": ((1, 1), ("attn1.to_q", "attn1.to_k", "attn1.to_v", "ff.net.0.proj", "ff.net.2"),
                  ("attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v")),
    "ltx-2": ((4, 6), _LTX2_FED, _LTX2_OWN),
    "ltx-2.3": ((4, 6), _LTX2_FED + ("attn1.to_gate_logits", "attn2.to_gate_logits",
                                     "video_to_audio_attn.to_gate_logits"), _LTX2_OWN),
}


def _inputs_seen(model) -> dict:
    """path -> the types of the inputs each Float8Linear of the blocks gets (hooks registered
    after apply, on the FP8 modules themselves)."""
    seen = {}
    for path, module in model.named_modules():
        if isinstance(module, Float8Linear) and path.startswith("transformer_blocks."):
            module.register_forward_pre_hook(lambda _, arguments, path=path: seen.setdefault(path, set()).add(
                type(arguments[0])))
    return seen


@pytest.mark.parametrize("name", EXPECTED)
def test_ltx_norms_feed_their_projections_fp8_rows(name, monkeypatch):
    """Each block's norms are the FP8 ops, once per norm output; the Linears they feed get FP8
    rows and are reported as fed, the others get tensors and quantise their own input; remove
    gives the bf16 model back bit for bit."""
    model, inputs, _ = MODELS[name](torch.bfloat16)
    before, expected = state_copy(model), run(model, inputs)
    report = integration.apply(model, quantize="fp8")
    calls = recorded_calls(monkeypatch, FP8_OPS)
    seen = _inputs_seen(model)
    patched = run(model, inputs)
    (norms, residual_norms), fed, own = EXPECTED[name]
    blocks = len(model.transformer_blocks)
    assert calls.count("norm_scale_shift_fp8") == norms * blocks
    assert calls.count("residual_norm_scale_shift_fp8") == residual_norms * blocks
    feed_forwards = [path for path, op in report.replaced if op == "quantize_fp8 (GELU)"]
    assert len(feed_forwards) == blocks * (1 if name == "ltx-video" else 2)
    kinds = dict(report.linears)
    for index in range(blocks):
        for linear in fed:
            path = f"transformer_blocks.{index}.{linear}"
            assert kinds[path].startswith("fp8") and "own input" not in kinds[path], (path, kinds[path])
            assert seen[path] == {Float8Rows}, path
        for linear in own:
            path = f"transformer_blocks.{index}.{linear}"
            assert kinds[path].startswith("fp8") and "own input" in kinds[path], (path, kinds[path])
            assert seen[path] == {torch.Tensor}, path
    assert not any("its norms give bf16" in line for line in report.skipped)
    if name == "ltx-video":
        assert "transformer_blocks.0.attn2.to_q: quantises its own input (its query is the residual stream, which no " \
               "norm precedes)" in report.skipped
    assert 0 < (patched - expected).norm() / expected.norm() < 0.15  # FP8 GEMMs on random weights
    integration.remove(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[key], before[key]) for key in before)
    assert torch.equal(run(model, inputs), expected)


def test_ltx23_gate_logits_no_fp8_gemm_takes_keep_the_blocks_norms_bf16(monkeypatch):
    """With 2 heads the gate logits (D -> 2) cannot be FP8: FP8 rows would reach a bf16 Linear,
    so every block's norms give bf16 and the report names the gates; the other Linears still
    run FP8, quantising their own input."""
    model, inputs, _ = in_dtype(lambda: tiny_ltx2("split", ltx23=True))(torch.bfloat16)
    expected = run(model, inputs)
    report = integration.apply(model, quantize="fp8")
    calls = recorded_calls(monkeypatch, FP8_OPS)
    patched = run(model, inputs)
    assert "norm_scale_shift_fp8" not in calls and "residual_norm_scale_shift_fp8" not in calls
    for index in range(2):
        line, = [line for line in report.skipped if line.startswith(f"transformer_blocks.{index}: its norms give bf16")]
        assert f"transformer_blocks.{index}.attn1.to_gate_logits" in line
    kinds = dict(report.linears)
    assert "own input" in kinds["transformer_blocks.0.attn1.to_q"]
    assert kinds["transformer_blocks.0.attn1.to_gate_logits"].startswith("bf16")
    assert not any(op.endswith("_fp8") for _, op in report.replaced)
    assert 0 < (patched - expected).norm() / expected.norm() < 0.15


def test_a_hooked_norm_runs_diffusers_block_on_tensors_and_the_other_block_keeps_fp8_rows():
    """A hook on a norm the block fuses: that block runs diffusers' code (the hook runs), its FP8
    Linears quantise the tensors they get; the other block's are still fed FP8 rows."""
    model, inputs, _ = MODELS["ltx-video"](torch.bfloat16)
    integration.apply(model, quantize="fp8")
    hooked = []
    model.transformer_blocks[0].norm1.register_forward_hook(lambda *arguments: hooked.append(True))
    seen = _inputs_seen(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ditops' note that the block runs diffusers' code
        run(model, inputs)
    assert hooked
    assert seen["transformer_blocks.0.attn1.to_q"] == {torch.Tensor}
    assert seen["transformer_blocks.1.attn1.to_q"] == {Float8Rows}


@pytest.mark.parametrize("name", MODELS)
def test_compiled_fp8_ltx_block_is_one_graph_and_matches_eager(name, monkeypatch):
    """A block with FP8 norms under torch.compile(fullgraph=True): one graph, the FP8 ops its
    nodes, as many quantize_fp8 as eager (the fed projections still take the rows: the rotary
    attentions do not hand them to diffusers' processor, which would quantise again)."""
    model, inputs, _ = MODELS[name](torch.bfloat16)
    integration.apply(model, quantize="fp8")
    block = model.transformer_blocks[0]
    arguments, keywords = block_call(model, inputs, block)
    with torch.no_grad():
        calls = recorded_calls(monkeypatch, FP8_OPS)
        eager = block(*arguments, **keywords)
        monkeypatch.undo()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(block)(*arguments, **keywords)
        assert explained.graph_break_count == 0 and len(explained.graphs) == 1
        traced = re.findall(r"torch\.ops\.ditops\.(\w+)\(", explained.graphs[0].code)
        for op in ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "quantize_fp8"):
            assert traced.count(op) == calls.count(op), (op, traced.count(op), calls.count(op))
        compiled = torch.compile(block, fullgraph=True)(*arguments, **keywords)
    eager, compiled = (eager, compiled) if isinstance(eager, tuple) else ((eager,), (compiled,))
    for got, want in zip(compiled, eager):
        assert (got.float() - want.float()).norm() / want.float().norm() < 0.05

"""``apply(model, quantize="fp8")`` on HiDream-I1 (ditops/integrations/diffusers/hidream.py):
which Linears the norms feed FP8 rows, which quantise their own input, the FP8 processor
against diffusers', the FP8 blocks under torch.compile; and on Cosmos (cosmos.py; its fed
Linears and fused calls are tests/test_fp8.py's): the report on norm2, 2.5's block compiled.
On CPU with the reference backend, as tests/test_fp8.py."""

import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from fp8_checks import FP8_OPS, fed_and_own_input, in_graph_and_matches_eager  # noqa: E402
from model_runs import block_call, recorded_calls, run  # noqa: E402
from tiny_models import in_dtype, tiny_cosmos, tiny_hidream  # noqa: E402

from ditops.fp8 import Float8Rows  # noqa: E402
from ditops.integrations import diffusers as integration  # noqa: E402
from ditops.integrations.diffusers import hidream  # noqa: E402

FUSED = FP8_OPS + ("norm_scale_shift", "residual_norm_scale_shift")


def _tiny_hidream(experts):
    return in_dtype(lambda: tiny_hidream(experts))(torch.bfloat16)


def test_hidream_norm1_feeds_q_k_v_and_norm3_the_dense_ffns_not_the_mixtures_of_experts(monkeypatch):
    """norm1_i / norm1_t feed q/k/v of their stream (ditops' processor takes FP8 rows); norm3_t
    feeds the dense text FFN's w1 and w3; norm3_i gives bf16 to the mixture-of-experts image FFN
    (its router reads the rows in bf16), whose experts quantise their own input, as w2 does."""
    model, inputs, _ = _tiny_hidream(experts=2)
    calls = recorded_calls(monkeypatch, FUSED)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    # per double block: norm1_i, norm1_t, norm3_t FP8, norm3_i bf16; per single block: norm1_i FP8, norm3_i bf16
    assert calls.count("norm_scale_shift_fp8") == 2 * 2 + 2 and "norm_scale_shift" not in calls
    assert calls.count("residual_norm_scale_shift_fp8") == 2
    assert calls.count("residual_norm_scale_shift") == 2 + 2
    fed, own_input = fed_and_own_input(report)
    double, single = "double_stream_blocks.1.block", "single_stream_blocks.0.block"
    assert {f"{double}.attn1.{name}" for name in ("to_q", "to_k", "to_v", "to_q_t", "to_k_t", "to_v_t")} <= fed
    assert {f"{double}.ff_t.w1", f"{double}.ff_t.w3", f"{single}.attn1.to_v"} <= fed
    assert {f"{double}.ff_t.w2", f"{double}.attn1.to_out", f"{double}.ff_i.shared_experts.w1",
            f"{double}.ff_i.experts.1.w3", f"{single}.ff_i.shared_experts.w3",
            f"{single}.ff_i.experts.0.w1"} <= own_input
    assert not any(".ff_i." in path for path in fed)
    assert (f"{double}.norm3_i", "residual_norm_scale_shift") in report.replaced
    assert (f"{double}.norm3_t", "residual_norm_scale_shift_fp8") in report.replaced
    assert any(line.startswith(f"{single}.norm3_i: gives bf16 (ff_i is a MOEFeedForwardSwiGLU")
               for line in report.skipped)


def test_hidream_swiglu_ffns_run_w1_and_w3_as_one_gemm_on_rows_quantised_once(monkeypatch):
    """Every SwiGLU FFN (dense, routed and shared experts) runs w1 and w3 as one FP8 GEMM: an
    expert quantises its input once for both (then w2's), and computes what diffusers' forward
    computes with the same FP8 Linears; remove() takes the joint away."""
    model, inputs, _ = _tiny_hidream(experts=2)
    report = integration.apply(model, quantize="fp8")
    joined = [path for path, op in report.replaced if op == "one FP8 GEMM for w1, w3"]
    double, single = "double_stream_blocks.1.block", "single_stream_blocks.0.block"
    assert {f"{double}.ff_t.w13", f"{double}.ff_i.shared_experts.w13", f"{single}.ff_i.experts.1.w13"} <= set(joined)
    assert len(joined) == 2 * (1 + 1 + 2) + 2 * (1 + 2)  # double: ff_t, ff_i's shared and 2 experts; single: ff_i's
    expert = model.single_stream_blocks[0].block.ff_i.experts[1]
    x = torch.randn(7, expert.w1.in_features, dtype=torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    got = expert(x)
    assert calls == ["quantize_fp8", "quantize_fp8"]
    expected = type(expert).forward(expert, x)  # w1 and w3 each quantising x
    assert calls.count("quantize_fp8") == 2 + 3
    assert torch.allclose(got.float(), expected.float(), rtol=1e-2, atol=1e-3)
    integration.remove(model)
    assert not hasattr(expert, "w13") and "forward" not in vars(expert)
    assert type(expert.w1) is torch.nn.Linear


def test_hidream_dense_ffns_take_fp8_rows_from_every_norm(monkeypatch):
    model, inputs, _ = _tiny_hidream(experts=0)
    calls = recorded_calls(monkeypatch, FUSED)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    assert calls.count("norm_scale_shift_fp8") == calls.count("residual_norm_scale_shift_fp8") == 2 * 2 + 2
    assert "norm_scale_shift" not in calls and "residual_norm_scale_shift" not in calls
    fed, own_input = fed_and_own_input(report)
    for block in ("double_stream_blocks.0.block", "single_stream_blocks.1.block"):
        assert {f"{block}.ff_i.w1", f"{block}.ff_i.w3", f"{block}.attn1.to_k"} <= fed
        assert {f"{block}.ff_i.w2", f"{block}.attn1.to_out"} <= own_input
    assert not any("gives bf16" in line or "give bf16" in line for line in report.skipped)


def test_a_hooked_hidream_norm_runs_diffusers_block_and_processor_on_tensors(monkeypatch):
    """A hook on a norm sends the block to diffusers' forward: tensors reach diffusers'
    processor and the FP8 Linears quantise their own input, close to the fed block."""
    model, inputs, _ = _tiny_hidream(experts=0)
    integration.apply(model, quantize="fp8")
    fed = run(model, inputs)
    for blocks in (model.double_stream_blocks, model.single_stream_blocks):
        blocks[0].block.norm1_i.register_forward_hook(lambda *_: None)
    calls = recorded_calls(monkeypatch, FUSED)
    with pytest.warns(UserWarning, match="hook"):
        deferred = run(model, inputs)
    assert calls.count("norm_scale_shift_fp8") == 2 + 1  # block 1 of each kind
    assert 0 < ((deferred - fed).norm() / fed.norm()).item() < 0.05


@pytest.mark.parametrize("single", [False, True], ids=["double", "single"])
@pytest.mark.parametrize("axes_dim", [(4, 6, 6), (2, 2, 4)], ids=["whole-head-rope", "half-head-rope"])
def test_hidream_fp8_processor_computes_diffusers_processor(single, axes_dim):
    """The processor on FP8 rows and a key mask against diffusers' on the same rows as tensors
    (its FP8 Linears quantise them again, which may round a value the other way)."""
    from diffusers.models.transformers.transformer_hidream_image import HiDreamImageEmbedND

    model, _, _ = _tiny_hidream(experts=0)
    integration.apply(model, quantize="fp8")
    attn = (model.single_stream_blocks if single else model.double_stream_blocks)[0].block.attn1
    assert type(attn.processor) is hidream.HiDreamFP8RowsProcessor
    generator = torch.Generator().manual_seed(7)
    image, text = 12, 5
    ids = torch.cat([torch.randint(0, 4, (2, image, 3), generator=generator).float(), torch.zeros(2, text, 3)], dim=1)
    tables = HiDreamImageEmbedND(theta=10000, axes_dim=list(axes_dim))(ids)
    masks = (torch.rand(2, image + text if single else image, generator=generator) > 0.2).to(torch.bfloat16)
    rows = [Float8Rows(*integration.ops.quantize_fp8(torch.randn(2, tokens, 32, generator=generator,
                                                                 dtype=torch.bfloat16) * 3))
            for tokens in ((image + text,) if single else (image, text))]
    arguments = (rows[0], masks, None if single else rows[1], tables)
    with torch.no_grad():
        got, expected = attn.processor(attn, *arguments), attn.processor.defer(attn, *arguments)
    for got_stream, expected_stream in zip((got,) if single else got, (expected,) if single else expected):
        assert got_stream.shape == expected_stream.shape
        error = (got_stream.float() - expected_stream.float()).norm() / expected_stream.float().norm()
        assert error < 0.01, error.item()


@pytest.mark.parametrize("blocks", ["double_stream_blocks", "single_stream_blocks"])
def test_compiled_hidream_fp8_block_is_one_graph_and_matches_eager(blocks):
    """Dense FFNs: diffusers' mixture-of-experts inference loops over data-dependent counts."""
    model, inputs, _ = _tiny_hidream(experts=0)
    integration.apply(model, quantize="fp8")
    block = getattr(model, blocks)[0]
    arguments, keywords = block_call(model, inputs, block)
    in_graph_and_matches_eager(block, arguments, keywords, ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8",
                                                            "quantize_fp8"))


@pytest.mark.parametrize("image_context", [False, True], ids=["cosmos-1.0", "cosmos-2.5"])
def test_cosmos_report_says_norm2_gives_bf16_and_why(image_context):
    model, _, _ = in_dtype(lambda: tiny_cosmos(image_context))(torch.bfloat16)
    report = integration.apply(model, quantize="fp8")
    assert [line for line in report.skipped if ".norm2:" in line] == [
        f"transformer_blocks.{index}.norm2: gives bf16 (it feeds the cross-attention, diffusers' processor, which "
        "takes tensors)" for index in range(2)]
    assert "own input" in dict(report.linears)["transformer_blocks.0.attn2.to_q"]


def test_compiled_cosmos_25_fp8_block_is_one_graph_and_matches_eager():
    """Cosmos 2.5's blocks: per-frame [B, S, D] modulation and the image-context cross-attention."""
    model, inputs, _ = in_dtype(lambda: tiny_cosmos(image_context=True))(torch.bfloat16)
    integration.apply(model, quantize="fp8")
    block = model.transformer_blocks[0]
    arguments, keywords = block_call(model, inputs, block)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ditops")  # no hook fallback: the fused block is what is compiled
        in_graph_and_matches_eager(block, arguments, keywords, ("norm_scale_shift_fp8",
                                                                "residual_norm_scale_shift_fp8",
                                                                "residual_norm_scale_shift", "qk_norm_rope_"))

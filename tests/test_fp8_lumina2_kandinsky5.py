"""``apply(model, quantize="fp8")`` on Lumina2 (ditops/integrations/diffusers/lumina2.py) and
Kandinsky 5 (kandinsky5.py), beyond tests/test_fp8.py's (which Linears the norms feed, the FP8
norms' calls, Lumina2's and Kandinsky 5's visual block compiled): every fused call of a forward,
FP8 and bf16, against the report; a hook on a fed Linear or on a norm; Kandinsky 5's text block
and Lumina2's noise refiner compiled. On CPU with the reference backend, as tests/test_fp8.py."""

import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
from fp8_checks import FP8_OPS, TINY, fed_and_own_input, in_graph_and_matches_eager, state_copy  # noqa: E402
from model_runs import block_call, recorded_calls, run  # noqa: E402

from ditops.integrations import diffusers as integration  # noqa: E402

FUSED = FP8_OPS + ("norm_scale_shift", "residual_norm_scale_shift", "add_gate_norm_scale", "add_gate_norm")
LUMINA2_MODULATED = ("noise_refiner.0", "layers.0", "layers.1")
KANDINSKY5_BLOCKS = ("text_transformer_blocks.0", "text_transformer_blocks.1", "visual_transformer_blocks.0",
                     "visual_transformer_blocks.1")


def _bf16_norm_lines(report) -> list:
    return [line for line in report.skipped if "bf16" in line or "stay as diffusers wrote them" in line]


def test_lumina2_fused_calls_and_what_each_linear_takes(monkeypatch):
    """Per modulated block: the first norm and the gated norm FP8, the FFN's gated add (no
    Linear after it) bf16; each Linear that quantises its own input is one quantize_fp8, the fed
    ones none; the context refiner's plain norms are reported as left alone."""
    model, inputs, _ = TINY["lumina2"](torch.bfloat16)
    calls = recorded_calls(monkeypatch, FUSED)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    fed, own_input = fed_and_own_input(report)
    assert calls.count("norm_scale_shift_fp8") == calls.count("add_gate_norm_scale_fp8") == len(LUMINA2_MODULATED)
    assert calls.count("add_gate_norm") == len(LUMINA2_MODULATED)
    assert "norm_scale_shift" not in calls and "add_gate_norm_scale" not in calls
    assert calls.count("quantize_fp8") == len(own_input)
    assert fed == {f"{block}.{linear}" for block in LUMINA2_MODULATED
                   for linear in ("attn.to_q", "attn.to_k", "attn.to_v", "feed_forward.linear_1",
                                  "feed_forward.linear_3")}
    assert {"layers.1.feed_forward.linear_2", "layers.1.attn.to_out.0", "layers.1.norm1.linear",
            "context_refiner.0.attn.to_k", "context_refiner.0.feed_forward.linear_1"} <= own_input
    assert _bf16_norm_lines(report) == [("context_refiner.0: no modulation (plain RMSNorms, no scale or gate to fuse); "
                                         "its norms stay as diffusers wrote them")]


def test_kandinsky5_fused_calls_and_what_each_linear_takes(monkeypatch):
    """Per block: the first norm and feed_forward_norm FP8; per visual block
    cross_attention_norm bf16 (diffusers' cross-attention), which the report says; each Linear
    that quantises its own input is one quantize_fp8, the fed ones none."""
    model, inputs, _ = TINY["kandinsky5"](torch.bfloat16)
    calls = recorded_calls(monkeypatch, FUSED)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    fed, own_input = fed_and_own_input(report)
    assert calls.count("norm_scale_shift_fp8") == calls.count("residual_norm_scale_shift_fp8") == len(KANDINSKY5_BLOCKS)
    assert calls.count("residual_norm_scale_shift") == 2 and "norm_scale_shift" not in calls
    assert calls.count("quantize_fp8") == len(own_input)
    assert fed == {f"{block}.{linear}" for block in KANDINSKY5_BLOCKS
                   for linear in ("self_attention.to_query", "self_attention.to_key", "self_attention.to_value",
                                  "feed_forward.in_layer")}
    assert {"visual_transformer_blocks.1.cross_attention.to_query", "visual_transformer_blocks.1.feed_forward.out_layer",
            "text_transformer_blocks.0.self_attention.out_layer", "out_layer.out_layer"} <= own_input
    assert _bf16_norm_lines(report) == [
        f"visual_transformer_blocks.{index}.cross_attention_norm: gives bf16 (it feeds the cross-attention, diffusers' "
        "processor, which takes tensors)" for index in range(2)]


def test_without_quantize_no_fp8_op_runs_and_no_report_line_names_bf16(monkeypatch):
    for name in ("lumina2", "kandinsky5"):
        model, inputs, _ = TINY[name](torch.bfloat16)
        calls = recorded_calls(monkeypatch, FUSED)
        report = integration.apply(model)
        run(model, inputs)
        assert calls and not any(call.endswith("_fp8") for call in calls)
        assert not report.linears and not any("bf16" in line for line in report.skipped)


# (a Linear a norm would feed FP8 rows, its block, another block, {norm op: its bf16 and FP8 calls in a forward})
HOOKED_FED_LINEAR = {
    "lumina2": ("layers.0.feed_forward.linear_3", "layers.0", "layers.1",
                {"norm_scale_shift": (1, 2), "add_gate_norm_scale": (1, 2)}),
    "kandinsky5": ("visual_transformer_blocks.0.feed_forward.in_layer", "visual_transformer_blocks.0",
                   "visual_transformer_blocks.1",  # the cross_attention_norms give bf16 in every block
                   {"norm_scale_shift": (1, 3), "residual_norm_scale_shift": (1 + 2, 3)}),
}


@pytest.mark.parametrize("name", HOOKED_FED_LINEAR)
def test_a_hook_on_a_fed_linear_keeps_its_blocks_norms_bf16_and_remove_restores_the_model(name, monkeypatch):
    """FP8 rows never reach a bf16 Linear: where a Linear the norms feed keeps its hook (bf16),
    none of the block's become FP8-fed and its norms give bf16; the other blocks keep FP8 rows."""
    model, inputs, _ = TINY[name](torch.bfloat16)
    linear, block, other, norm_calls = HOOKED_FED_LINEAR[name]
    seen = []
    model.get_submodule(linear).register_forward_hook(lambda *arguments: seen.append(True))
    before, expected = state_copy(model), run(model, inputs)
    calls = recorded_calls(monkeypatch, FUSED)
    report = integration.apply(model, quantize="fp8")
    assert any(line.startswith(f"{block}: its norms give bf16") and linear in line for line in report.skipped)
    kinds = dict(report.linears)
    assert kinds[linear].startswith("bf16: it has a torch forward hook")
    fed, _ = fed_and_own_input(report)
    assert not any(path.startswith(block + ".") for path in fed) and any(path.startswith(other + ".") for path in fed)
    assert not any(path.startswith(block + ".") and op.endswith("_fp8") for path, op in report.replaced)
    seen.clear()
    patched = run(model, inputs)
    assert seen
    for op, (bf16, fp8) in norm_calls.items():
        assert (calls.count(op), calls.count(op + "_fp8")) == (bf16, fp8), op
    assert 0 < (patched - expected).norm() / expected.norm() < 0.15
    integration.remove(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[key], before[key]) for key in before)
    assert torch.equal(run(model, inputs), expected)


# (model, a block, one of the norms its ditops forward computes, FP8 norm calls of a forward without it)
HOOKED_NORM = {
    "lumina2": ("layers.0", "ffn_norm1", "norm_scale_shift_fp8", len(LUMINA2_MODULATED) - 1),
    "kandinsky5": ("text_transformer_blocks.0", "feed_forward_norm", "norm_scale_shift_fp8", len(KANDINSKY5_BLOCKS) - 1),
}


@pytest.mark.parametrize("name", HOOKED_NORM)
def test_a_hooked_norm_runs_diffusers_block_whose_fp8_linears_quantise_tensors(name, monkeypatch):
    """A hook on a norm sends the block to diffusers' forward (patching.hooked): the hook runs,
    the block's FP8 Linears get tensors and quantise them, close to the fed block."""
    model, inputs, _ = TINY[name](torch.bfloat16)
    integration.apply(model, quantize="fp8")
    fed = run(model, inputs)
    block, norm, op, fp8_calls = HOOKED_NORM[name]
    seen = []
    model.get_submodule(f"{block}.{norm}").register_forward_hook(lambda *arguments: seen.append(True))
    calls = recorded_calls(monkeypatch, FUSED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # patching.hooked warns once a process: not asserted here
        deferred = run(model, inputs)
    assert seen and calls.count(op) == fp8_calls
    assert 0 < ((deferred - fed).norm() / fed.norm()).item() < 0.05


@pytest.mark.parametrize("name, block, ops", [
    ("kandinsky5", "text_transformer_blocks.0",
     ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "qk_norm_rope_", "quantize_fp8")),
    ("lumina2", "noise_refiner.0", ("norm_scale_shift_fp8", "add_gate_norm_scale_fp8", "add_gate_norm", "quantize_fp8")),
], ids=["kandinsky5-text", "lumina2-noise-refiner"])
def test_compiled_fp8_block_is_one_graph_and_matches_eager(name, block, ops):
    """The blocks test_fp8's test of the same name leaves out: one graph, the ditops ops in it,
    the compiled block's output close to eager's."""
    model, inputs, _ = TINY[name](torch.bfloat16)
    integration.apply(model, quantize="fp8")
    module = model.get_submodule(block)
    arguments, keywords = block_call(model, inputs, module)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ditops")  # no hook fallback: the fused block is what is compiled
        in_graph_and_matches_eager(module, arguments, keywords, ops)

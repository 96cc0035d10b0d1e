"""ditops.integrations.diffusers on the families past the first four (Chroma, the FLUX.1 copies,
...): tiny random-weight float32 models built from their configs, on CPU (no download).

Per family: the patched output equals diffusers' within what one float32 op may differ by per
block the signal goes through (docs/ops.md: atol = rtol = 1e-5, relative error of the whole
tensor <= 1e-5), the report counts the sites replaced, the ops run where the report says,
``remove`` restores the bits, and a block that looks alike but computes differently is left
alone and named in the report.
"""

import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
integration = pytest.importorskip("ditops.integrations.diffusers")

from model_runs import assert_traces_as_one_graph, block_call, recorded_calls, run  # noqa: E402
from tiny_models import (WAN_SHAPE, built, tiny_bria, tiny_bria_fibo, tiny_chroma, tiny_chronoedit, tiny_helios,  # noqa: E402
                         tiny_cosmos, tiny_flux2, tiny_hidream, tiny_hunyuan_image, tiny_hunyuan_video,
                         tiny_hunyuan_video15, tiny_hunyuan_video_framepack, tiny_kandinsky5, tiny_longcat_image,
                         tiny_ltx, tiny_ltx2, tiny_lumina2, tiny_minimax_h3, tiny_ovis_image, tiny_sd3, tiny_skyreels_v2,
                         tiny_wan_animate, tiny_wan_i2v, tiny_wan_vace, wan_inputs)

TOLERANCE = 1e-5  # float32, per op (docs/ops.md)


def patched_calls(monkeypatch, build, names) -> list:
    """apply, then the ops among `names` that one forward of the built model calls, sorted."""
    model, inputs = build()
    integration.apply(model)
    calls = recorded_calls(monkeypatch, names)
    run(model, inputs)
    return sorted(calls)


def assert_patched_matches(model, inputs, blocks, sites: int, ops: set) -> integration.Report:
    """apply: `sites` places replaced by `ops`, output as diffusers' within `blocks` ops'
    tolerance; remove: diffusers' output bit for bit. Returns the report."""
    expected = run(model, inputs)
    assert expected.abs().max() > 0.1  # the tiny model computes something
    report = integration.apply(model)
    assert {op for _, op in report.replaced} == ops and len(report.replaced) == sites, str(report)
    patched = run(model, inputs)
    torch.testing.assert_close(patched, expected, atol=TOLERANCE * blocks, rtol=TOLERANCE * blocks)
    assert (patched - expected).norm() / expected.norm() <= TOLERANCE
    integration.remove(model)
    assert torch.equal(run(model, inputs), expected)
    return report


# ----- FLUX.1-shaped: Chroma and the copies ------------------------------------------------------

FLUX_OPS = {"norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"}


# name: (build, sites replaced, ops, blocks the signal goes through)
FLUX_LIKE = {
    # per double block: norm1, norm1_context, the block (norm2 and norm2_context), attn; per single block: norm, attn
    "chroma": (tiny_chroma, 2 * 4 + 2 * 2, FLUX_OPS),
    "longcat-image": (tiny_longcat_image, 2 * 4 + 2 * 2, FLUX_OPS),
    "ovis-image": (tiny_ovis_image, 2 * 4 + 2 * 2, FLUX_OPS),
    "bria": (tiny_bria, 2 * 4 + 2 * 2, FLUX_OPS),
    # FIBO's single blocks run diffusers' generic Attention with diffusers' RMSNorm for q and k
    "bria-fibo": (tiny_bria_fibo, 2 * 4 + 2 * 2, FLUX_OPS),
}


@pytest.mark.parametrize("name", FLUX_LIKE)
def test_flux_like_patched_matches_diffusers_and_remove_restores_it(name):
    build, sites, ops = FLUX_LIKE[name]
    model, inputs = build()
    report = assert_patched_matches(model, inputs, 4, sites, ops)
    assert not report.skipped


@pytest.mark.parametrize("name", FLUX_LIKE)
def test_flux_like_runs_the_ops(monkeypatch, name):
    calls = patched_calls(monkeypatch, FLUX_LIKE[name][0], sorted(FLUX_OPS))
    # 2 double blocks: 2 AdaLN + 2 residual norms + 2 RoPE calls (text, image); 2 single blocks: 1 + 1
    assert calls == sorted(["norm_scale_shift"] * 6 + ["residual_norm_scale_shift"] * 4 + ["qk_norm_rope_"] * 6)


@pytest.mark.parametrize("name", FLUX_LIKE)
def test_flux_like_blocks_trace_as_one_graph(name):
    """A patched double and single block under torch.compile(fullgraph=True): one graph each,
    the ditops ops its nodes."""
    build, _, _ = FLUX_LIKE[name]
    model, inputs = build()
    integration.apply(model)
    for block, ops in ((model.transformer_blocks[0], FLUX_OPS),
                       (model.single_transformer_blocks[0], {"norm_scale_shift", "qk_norm_rope_"})):
        arguments, keywords = block_call(model, inputs, block)
        assert_traces_as_one_graph(block, arguments, ops, keywords)


def test_chroma_attention_mask_reaches_attention():
    """Chroma's mask changes the second prompt's output (the first keeps every token), so the
    comparison with diffusers above covers the mask's way through the ditops processor."""
    model, inputs = tiny_chroma()
    integration.apply(model)
    masked, unmasked = run(model, inputs), run(model, dict(inputs, attention_mask=None))
    torch.testing.assert_close(masked[0], unmasked[0], atol=TOLERANCE, rtol=TOLERANCE)
    assert (masked[1] - unmasked[1]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["chroma", "longcat-image"])
def test_flux_like_block_with_an_affine_norm2_is_left_alone_and_reported(name):
    """A double block whose norm2 has an affine LayerNorm looks like the others but computes
    something else: its norms stay diffusers', its attention is still patched."""
    model, inputs = FLUX_LIKE[name][0]()
    block = model.transformer_blocks[1]
    block.norm2 = torch.nn.LayerNorm(block.norm2.normalized_shape, eps=1e-6)
    torch.nn.init.normal_(block.norm2.weight)
    report = assert_patched_matches(model, inputs, 4, 2 * 4 + 2 * 2 - 3, FLUX_OPS)
    assert report.skipped == ["transformer_blocks.1: another block type, or norms with affine parameters"
                              + (", an embedding or of another type" if name == "chroma" else " or of another type")]
    assert not any(path.startswith("transformer_blocks.1.norm") for path, _ in report.replaced)


# ----- the Wan family, matched by block structure ------------------------------------------------

WAN_OPS = {"norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_ (norm_over=token)"}


WAN_LIKE = {
    # per Wan block: norm1, norm2, norm3, attn1; the VACE control block: attn1 only
    "wan-vace": (tiny_wan_vace, 2 * 4 + 1),
    "wan-i2v": (tiny_wan_i2v, 2 * 4),
    "wan-animate": (tiny_wan_animate, 2 * 4),
    "chronoedit": (tiny_chronoedit, 2 * 4),
    "skyreels-v2": (tiny_skyreels_v2, 2 * 4),
    "helios": (tiny_helios, 2 * 4),
}
# Helios's norm3: after a residual of the video tokens alone where history tokens come first
HELIOS_OPS = WAN_OPS | {"residual_norm_scale_shift (norm_scale_shift where history tokens come first)"}


@pytest.mark.parametrize("name", WAN_LIKE)
def test_wan_like_patched_matches_diffusers_and_remove_restores_it(name):
    build, sites = WAN_LIKE[name]
    model, inputs = build()
    report = assert_patched_matches(model, inputs, 3 if name == "wan-vace" else 2, sites,
                                    HELIOS_OPS if name == "helios" else WAN_OPS)
    if name == "wan-vace":
        assert report.skipped == ["vace_blocks.0: WanVACETransformerBlock has Wan's block layout but another forward; "
                                  "its norms stay as diffusers wrote them"]
        assert ("vace_blocks.0.attn1.processor", "qk_norm_rope_ (norm_over=token)") in report.replaced
    else:
        assert not report.skipped


@pytest.mark.parametrize("name", WAN_LIKE)
def test_wan_like_runs_the_ops(monkeypatch, name):
    calls = patched_calls(monkeypatch, WAN_LIKE[name][0],
                          ("norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_", "rope_"))
    # per Wan block: norm1; norm2 and norm3 with their residuals; the self-attention's q/k norm +
    # RoPE (I2V's image-context k/v in the cross-attention stays diffusers'); the VACE control
    # block: its self-attention's. Helios with history tokens: norm3 after a residual of the
    # video tokens alone
    vace = 1 if name == "wan-vace" else 0
    norm3 = "norm_scale_shift" if name == "helios" else "residual_norm_scale_shift"
    assert calls == sorted((["norm_scale_shift", "residual_norm_scale_shift", norm3, "qk_norm_rope_"]) * 2
                           + ["qk_norm_rope_"] * vace)


@pytest.mark.parametrize("name", WAN_LIKE)
def test_wan_like_block_traces_as_one_graph(name):
    model, inputs = WAN_LIKE[name][0]()
    integration.apply(model)
    block = model.blocks[0]
    arguments, keywords = block_call(model, inputs, block)
    assert_traces_as_one_graph(block, arguments, {"norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"},
                               keywords)


def test_skyreels_v2_runs_per_token_modulation_and_the_causal_mask(monkeypatch):
    """Diffusion forcing hands the ops [B, S, D] modulation, and the causal mask reaches
    attention (without it, the first frames would see the last ones)."""
    model, inputs = tiny_skyreels_v2()
    integration.apply(model)
    scales = []
    original = integration.ops.norm_scale_shift
    monkeypatch.setattr(integration.ops, "norm_scale_shift",
                        lambda x, scale, *a, **k: scales.append(tuple(scale.shape)) or original(x, scale, *a, **k))
    first = run(model, inputs)
    assert (2, 4 * 4 * 4, 32) in scales  # [B, frames x 4 x 4 tokens, D]
    changed = dict(inputs, hidden_states=inputs["hidden_states"].clone())
    changed["hidden_states"][:, :, 2:] += 1.0  # the second block of frames
    second = run(model, changed)
    assert torch.equal(first[:, :, :2], second[:, :, :2]) and not torch.allclose(first[:, :, 2:], second[:, :, 2:])


def test_a_wan_block_with_another_forward_is_left_alone_and_reported():
    """A block with Wan's layout whose forward differs (here: Wan's block with the modulation
    of norm3 dropped) keeps its norms; the other blocks are patched."""
    model, inputs = tiny_chronoedit()

    class Altered(type(model.blocks[1])):
        def forward(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
            shift_msa, scale_msa, gate_msa, _, _, c_gate_msa = (self.scale_shift_table + temb.float()).chunk(6, dim=1)
            norm_hidden_states = (self.norm1(hidden_states.float()) * (1 + scale_msa) + shift_msa).type_as(hidden_states)
            hidden_states = (hidden_states.float() + self.attn1(norm_hidden_states, None, None, rotary_emb) * gate_msa
                             ).type_as(hidden_states)
            hidden_states = hidden_states + self.attn2(self.norm2(hidden_states.float()).type_as(hidden_states),
                                                       encoder_hidden_states, None, None)
            ff_output = self.ffn(self.norm3(hidden_states.float()).type_as(hidden_states))
            return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)

    model.blocks[1].__class__ = Altered
    report = assert_patched_matches(model, inputs, 2, 2 * 4 - 3, WAN_OPS)
    assert report.skipped == ["blocks.1: Altered has Wan's block layout but another forward; its norms stay as "
                              "diffusers wrote them"]


def _norms(norm_class, width, **options):
    return norm_class(width, **options), norm_class(width, **options)


WAN_QK_NORMS = {
    # blocks.1.attn1's norm_q, norm_k -> (norms, the reason the report gives)
    "eps": (lambda width: (torch.nn.RMSNorm(width, eps=1e-6), torch.nn.RMSNorm(width, eps=1e-5)),
            "q/k norms of eps 1e-06 and 1e-05, not one eps (qk_norm_rope_ takes one)"),
    "eps-none": (lambda width: _norms(torch.nn.RMSNorm, width, eps=None),
                 "q/k norms with eps=None (the activations' dtype's machine epsilon), not a number"),
    "layer-norm": (lambda width: _norms(torch.nn.LayerNorm, width, eps=1e-6),
                   "q/k norms LayerNorm/LayerNorm, not torch.nn.RMSNorm with weights"),
    "no-weight": (lambda width: _norms(torch.nn.RMSNorm, width, eps=1e-6, elementwise_affine=False),
                  "q/k norms RMSNorm/RMSNorm, not torch.nn.RMSNorm with weights"),
    "none": (lambda width: (torch.nn.Identity(), torch.nn.Identity()),
             "q/k norms Identity/Identity, not torch.nn.RMSNorm with weights"),
}


@pytest.mark.parametrize("name", WAN_QK_NORMS)
def test_a_wan_self_attention_with_other_q_k_norms_keeps_diffusers_processor_and_is_reported(name):
    """qk_norm_rope_ takes RMSNorm weights and one eps for q and k; a self-attention whose norms
    are otherwise runs diffusers' processor, and the report says why."""
    model, inputs = tiny_chronoedit()
    attn = model.blocks[1].attn1
    norms, reason = WAN_QK_NORMS[name]
    attn.norm_q, attn.norm_k = norms(attn.inner_dim)
    for norm in (attn.norm_q, attn.norm_k):
        if getattr(norm, "weight", None) is not None:
            torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    report = assert_patched_matches(model, inputs, 2, 2 * 4 - 1, WAN_OPS)
    assert report.skipped == [f"blocks.1.attn1: {reason}; its q/k norms and RoPE stay as diffusers wrote them"]
    assert ("blocks.0.attn1.processor", "qk_norm_rope_ (norm_over=token)") in report.replaced


def test_wan_heads_qk_norm_rope_does_not_take_keep_diffusers_processor_and_are_reported():
    """A head size over the op's 512 (one head of 516): every self-attention keeps its processor."""
    model = built(diffusers.WanTransformer3DModel, **dict(WAN_SHAPE, num_attention_heads=1, attention_head_dim=516))
    report = assert_patched_matches(model, wan_inputs(), 2, 2 * 3, {"norm_scale_shift", "residual_norm_scale_shift"})
    assert report.skipped == [f"blocks.{index}.attn1: head size 516, not an even one up to 512 (qk_norm_rope_'s); its "
                              "q/k norms and RoPE stay as diffusers wrote them" for index in range(2)]


def test_wan_q_k_norm_weights_of_a_dtype_qk_norm_rope_does_not_take_are_reported():
    model, _ = tiny_chronoedit()
    norm = model.blocks[0].attn1.norm_k
    norm.weight = torch.nn.Parameter(norm.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    report = integration.apply(model)
    assert report.skipped == ["blocks.0.attn1: q/k norm weights of dtype torch.float32/torch.float8_e4m3fn, not one "
                              "qk_norm_rope_ takes; its q/k norms and RoPE stay as diffusers wrote them"]
    integration.remove(model)


# ----- SD3 / SD3.5 -------------------------------------------------------------------------------


def test_sd3_patched_matches_diffusers_and_remove_restores_it():
    model, inputs = tiny_sd3()
    # per block: norm1, norm1_context, the block's residual norms; SD3's attention has nothing to fuse
    report = assert_patched_matches(model, inputs, 2, 2 * 3, {"norm_scale_shift", "residual_norm_scale_shift"})
    assert report.skipped == [f"transformer_blocks.{i}.attn: no q/k norm (SD3); attention stays as diffusers wrote it"
                              for i in range(2)]


def test_sd35_patched_matches_diffusers_and_remove_restores_it():
    model, inputs = tiny_sd3(sd35=True)
    # per block: norm1, norm1_context, the block's residual norms, attn; the first block's attn2
    report = assert_patched_matches(model, inputs, 2, 2 * 4 + 1,
                                    {"norm_scale_shift", "residual_norm_scale_shift", "norm_scale_shift (rms)"})
    assert not report.skipped


def test_sd35_runs_the_ops(monkeypatch):
    calls = patched_calls(monkeypatch, lambda: tiny_sd3(sd35=True), ("norm_scale_shift", "residual_norm_scale_shift"))
    # block 0: norm1 modulated twice (dual attention), norm1_context, q/k/added q/k, attn2's q/k; two residual norms
    # block 1: norm1, norm1_context (continuous), q/k/added q/k; one residual norm (its text stream ends)
    assert calls == sorted(["norm_scale_shift"] * (2 + 1 + 4 + 2 + 1 + 1 + 4) + ["residual_norm_scale_shift"] * 3)


def test_sd35_block_traces_as_one_graph():
    """SD3.5's dual-attention block: its norms and per-head q/k RMSNorms are the graph's nodes."""
    model, inputs = tiny_sd3(sd35=True)
    integration.apply(model)
    block = model.transformer_blocks[0]
    arguments, keywords = block_call(model, inputs, block)
    assert_traces_as_one_graph(block, arguments, {"norm_scale_shift", "residual_norm_scale_shift"}, keywords)


def test_sd3_block_with_an_affine_norm2_is_left_alone_and_reported():
    model, inputs = tiny_sd3(sd35=True)
    block = model.transformer_blocks[0]
    block.norm2 = torch.nn.LayerNorm(block.norm2.normalized_shape, eps=1e-6)
    torch.nn.init.normal_(block.norm2.weight)
    report = assert_patched_matches(model, inputs, 2, 2 * 4 + 1 - 3,
                                    {"norm_scale_shift", "residual_norm_scale_shift", "norm_scale_shift (rms)"})
    assert report.skipped == ["transformer_blocks.0: another block type, or norms with affine parameters or of "
                              "another type"]


# ----- FLUX.2 ------------------------------------------------------------------------------------


def test_flux2_patched_matches_diffusers_and_remove_restores_it():
    model, inputs = tiny_flux2()
    # per double block: norm1s, norm2s, attn; per single block: norm, attn
    report = assert_patched_matches(model, inputs, 4, 2 * 3 + 2 * 2, FLUX_OPS)
    assert not report.skipped


def test_flux2_runs_the_ops(monkeypatch):
    calls = patched_calls(monkeypatch, tiny_flux2, sorted(FLUX_OPS))
    # double blocks: 2 modulated norms, 2 residual norms, 2 RoPE calls (text, image); single blocks: 1 + 1
    assert calls == sorted(["norm_scale_shift"] * 6 + ["residual_norm_scale_shift"] * 4 + ["qk_norm_rope_"] * 6)


def test_flux2_blocks_trace_as_one_graph():
    model, inputs = tiny_flux2()
    integration.apply(model)
    for block, ops in ((model.transformer_blocks[0], FLUX_OPS),
                       (model.single_transformer_blocks[0], {"norm_scale_shift", "qk_norm_rope_"})):
        arguments, keywords = block_call(model, inputs, block)
        assert_traces_as_one_graph(block, arguments, ops, keywords)


def test_flux2_kv_cache_processors_are_left_alone_and_reported():
    """FLUX.2 klein's KV-cache processors look like the plain ones and attend differently
    (reference tokens attend only to themselves): their attentions stay, the norms are patched."""
    from diffusers.models.transformers.transformer_flux2 import Flux2KVAttnProcessor, Flux2KVParallelSelfAttnProcessor

    model, inputs = tiny_flux2()
    model.transformer_blocks[0].attn.set_processor(Flux2KVAttnProcessor())
    model.single_transformer_blocks[1].attn.set_processor(Flux2KVParallelSelfAttnProcessor())
    report = assert_patched_matches(model, inputs, 4, 2 * 3 + 2 * 2 - 2, FLUX_OPS)
    assert report.skipped == [
        "transformer_blocks.0.attn: processor Flux2KVAttnProcessor or its q/k norms are not the ones checked",
        "single_transformer_blocks.1.attn: processor Flux2KVParallelSelfAttnProcessor or its q/k norms are not the "
        "ones checked"]


# ----- the HunyuanVideo family: 1.0, Framepack, 1.5, HunyuanImage 2.1 --------------------------

HUNYUAN_OPS = {"norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_, norm_scale_shift (rms)"}


# name: (build, sites replaced, blocks the signal goes through)
HUNYUAN_LIKE = {
    # per double block: norm1, norm1_context, the block (norm2s), attn; per single block: norm, attn
    "hunyuan-video": (tiny_hunyuan_video, 2 * 4 + 2 * 2, 4),
    "hunyuan-video-framepack": (tiny_hunyuan_video_framepack, 2 * 4 + 2 * 2, 4),
    "hunyuan-video-1.5": (tiny_hunyuan_video15, 2 * 4, 2),
    "hunyuan-image-2.1": (tiny_hunyuan_image, 2 * 4 + 2 * 2, 4),
}


@pytest.mark.parametrize("name", HUNYUAN_LIKE)
def test_hunyuan_like_patched_matches_diffusers_and_remove_restores_it(name):
    build, sites, blocks = HUNYUAN_LIKE[name]
    model, inputs = build()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    report = assert_patched_matches(model, inputs, blocks, sites, HUNYUAN_OPS)
    assert not report.skipped
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


@pytest.mark.parametrize("name", HUNYUAN_LIKE)
def test_hunyuan_like_runs_the_ops(monkeypatch, name):
    calls = patched_calls(monkeypatch, HUNYUAN_LIKE[name][0],
                          ("norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"))
    # per double block: norm1, norm1_context, the text q and k RMSNorms; two residual norms; the video q/k
    # per single block: norm, the text q and k RMSNorms; the video q/k
    single = 0 if name == "hunyuan-video-1.5" else 2
    assert calls == sorted((["norm_scale_shift"] * 4 + ["residual_norm_scale_shift"] * 2
                                    + ["qk_norm_rope_"]) * 2 + (["norm_scale_shift"] * 3 + ["qk_norm_rope_"]) * single)


def test_hunyuan_video_token_replace_blocks_are_left_alone_and_reported():
    """HunyuanVideo's image-to-video blocks (image_condition_type="token_replace") look like the
    others and modulate the first frame's tokens apart: their forwards and their token-replace
    norms stay diffusers'; their plain norm1_context and their attention are patched."""
    model, inputs = tiny_hunyuan_video("token_replace")
    report = assert_patched_matches(model, inputs, 4, 2 * 2 + 2 * 1, HUNYUAN_OPS - {"residual_norm_scale_shift"})
    norm = "HunyuanVideoTokenReplaceAdaLayerNormZero"
    assert report.skipped == [
        *[entry for i in range(2) for entry in (
            f"transformer_blocks.{i}.norm1: {norm}, not AdaLayerNormZero over a LayerNorm without affine parameters; "
            "left as it is",
            f"transformer_blocks.{i}: HunyuanVideoTokenReplaceTransformerBlock has another forward than HunyuanVideo's "
            "double block; its norm2s stay as diffusers wrote them")],
        *[f"single_transformer_blocks.{i}.norm: {norm}Single, not AdaLayerNormZeroSingle over a LayerNorm without "
          "affine parameters; left as it is" for i in range(2)]]


@pytest.mark.parametrize("name", ["hunyuan-video", "hunyuan-video-1.5"])
def test_hunyuan_like_blocks_trace_as_one_graph(name):
    """torch.compile(fullgraph=True) of a patched double block (and of 1.0's single block): one
    graph, with the ditops ops as its nodes."""
    model, inputs = HUNYUAN_LIKE[name][0]()
    integration.apply(model)
    blocks = [model.transformer_blocks[0]] + list(getattr(model, "single_transformer_blocks", [])[:1])
    for block in blocks:
        ops = ("norm_scale_shift", "qk_norm_rope_") + (("residual_norm_scale_shift",) if block is blocks[0] else ())
        arguments, keywords = block_call(model, inputs, block)
        assert_traces_as_one_graph(block, arguments, ops, keywords)


# ----- Lumina2 ----------------------------------------------------------------------------------

LUMINA2_OPS = {"norm_scale_shift", "add_gate_norm_scale", "add_gate_norm", "qk_norm_rope_"}


def test_lumina2_patched_matches_diffusers_and_remove_restores_it():
    """Per modulated block (noise refiner, layers): norm1, norm2 + ffn_norm1, ffn_norm2, attn;
    the context refiner's attention; its plain norms are left alone and reported."""
    model, inputs = tiny_lumina2()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    report = assert_patched_matches(model, inputs, 4, 3 * 4 + 1, LUMINA2_OPS)
    assert report.skipped == ["context_refiner.0: no modulation (plain RMSNorms, no scale or gate to fuse); its norms "
                              "stay as diffusers wrote them"]
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


def test_lumina2_runs_the_ops(monkeypatch):
    calls = patched_calls(monkeypatch, tiny_lumina2, sorted(LUMINA2_OPS))
    assert calls == sorted(["norm_scale_shift", "add_gate_norm_scale", "add_gate_norm", "qk_norm_rope_"] * 3
                           + ["qk_norm_rope_"])


def test_lumina2_block_traces_as_one_graph():
    model, inputs = tiny_lumina2()
    integration.apply(model)
    block = model.layers[0]
    arguments, keywords = block_call(model, inputs, block)
    assert_traces_as_one_graph(block, arguments, LUMINA2_OPS, keywords)


# ----- Cosmos ------------------------------------------------------------------------------------

COSMOS_OPS = {"norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"}


COSMOS_LIKE = {"cosmos": tiny_cosmos, "cosmos-2.5": lambda: tiny_cosmos(image_context=True)}


@pytest.mark.parametrize("name", COSMOS_LIKE)
def test_cosmos_patched_matches_diffusers_and_remove_restores_it(name):
    """Per block: norm1, norm2, norm3, attn1; the cross-attention is left alone and reported."""
    model, inputs = COSMOS_LIKE[name]()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    report = assert_patched_matches(model, inputs, 2, 2 * 4, COSMOS_OPS)
    assert report.skipped == [f"transformer_blocks.{i}.attn2: cross-attention, q/k RMSNorm without RoPE; left as it is"
                              for i in range(2)]
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


@pytest.mark.parametrize("name", COSMOS_LIKE)
def test_cosmos_runs_the_ops(monkeypatch, name):
    calls = patched_calls(monkeypatch, COSMOS_LIKE[name], sorted(COSMOS_OPS))
    assert calls == sorted(["norm_scale_shift", "residual_norm_scale_shift", "residual_norm_scale_shift",
                            "qk_norm_rope_"] * 2)


@pytest.mark.parametrize("name", COSMOS_LIKE)
def test_cosmos_block_traces_as_one_graph(name):
    model, inputs = COSMOS_LIKE[name]()
    integration.apply(model)
    block = model.transformer_blocks[0]
    arguments, keywords = block_call(model, inputs, block)
    assert_traces_as_one_graph(block, arguments, COSMOS_OPS, keywords)


# ----- Kandinsky 5 -------------------------------------------------------------------------------

KANDINSKY5_OPS = {"norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"}


def test_kandinsky5_patched_matches_diffusers_and_remove_restores_it():
    """Per text block: 2 norms and the self-attention; per visual block: 3 norms and the
    self-attention; the cross-attentions and the out_layer are left alone and reported."""
    model, inputs = tiny_kandinsky5()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    report = assert_patched_matches(model, inputs, 4, 2 * 3 + 2 * 4, KANDINSKY5_OPS)
    assert report.skipped == [f"visual_transformer_blocks.{i}.cross_attention: q/k RMSNorm without RoPE; left as it "
                              "is" for i in range(2)] + [
        "out_layer: its modulated norm over the unflattened video; left as it is"]
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


def test_kandinsky5_runs_the_ops(monkeypatch):
    calls = patched_calls(monkeypatch, tiny_kandinsky5, sorted(KANDINSKY5_OPS))
    assert calls == sorted(["norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"] * 2
                           + ["norm_scale_shift", "residual_norm_scale_shift", "residual_norm_scale_shift",
                              "qk_norm_rope_"] * 2)


@pytest.mark.parametrize("blocks", ["text_transformer_blocks", "visual_transformer_blocks"])
def test_kandinsky5_block_traces_as_one_graph(blocks):
    model, inputs = tiny_kandinsky5()
    integration.apply(model)
    block = getattr(model, blocks)[0]
    arguments, keywords = block_call(model, inputs, block)
    assert_traces_as_one_graph(block, arguments, KANDINSKY5_OPS, keywords)


# ----- HiDream-I1 -------------------------------------------------------------------------------

HIDREAM_OPS = {"norm_scale_shift", "residual_norm_scale_shift"}


def test_hidream_patched_matches_diffusers_and_remove_restores_it():
    """Per double-stream block: 4 norms; per single-stream block: 2; the attentions and the
    final layer are left alone and reported."""
    model, inputs = tiny_hidream()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    report = assert_patched_matches(model, inputs, 4, 2 * 4 + 2 * 2, HIDREAM_OPS)
    assert report.skipped == [f"{blocks}.{i}.block.attn1: q/k RMSNorm over all heads together, not per head; left "
                              "as it is" for blocks in ("double_stream_blocks", "single_stream_blocks")
                              for i in range(2)] + ["final_layer: its modulated norm; left as it is"]
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


def test_hidream_runs_the_ops(monkeypatch):
    calls = patched_calls(monkeypatch, tiny_hidream, sorted(HIDREAM_OPS))
    assert calls == sorted(["norm_scale_shift", "residual_norm_scale_shift"] * (2 * 2 + 2))


@pytest.mark.parametrize("blocks", ["double_stream_blocks", "single_stream_blocks"])
def test_hidream_block_traces_as_one_graph(blocks):
    """Dense FFNs: diffusers' mixture-of-experts inference loops over data-dependent counts."""
    model, inputs = tiny_hidream(experts=0)
    integration.apply(model)
    block = getattr(model, blocks)[0]
    arguments, keywords = block_call(model, inputs, block)  # the model calls its blocks with keywords
    assert_traces_as_one_graph(block, arguments, HIDREAM_OPS, keywords)


# ----- LTX-Video and LTX-2 ---------------------------------------------------------------------

LTX_OPS = {"norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_", "rope_"}  # the ops a forward may call
QK_NORM_ROPE = "qk_norm_rope_ (norm_over=token)"  # the report's op for a self-attention
LTX_SITES = {"norm_scale_shift", "residual_norm_scale_shift", QK_NORM_ROPE}
# the audio-video attentions' rope_, and the norm whose output two attentions take
LTX2_SITES = LTX_SITES | {"rope_", "residual_norm_scale_shift, norm_scale_shift"}


LTX_LIKE = {"ltx-video": (tiny_ltx, 3, LTX_SITES), "ltx-2": (tiny_ltx2, 12, LTX2_SITES),
            "ltx-2-split-rope": (lambda: tiny_ltx2("split"), 12, LTX2_SITES),
            "ltx-2.3": (lambda: tiny_ltx2("split", ltx23=True), 12, LTX2_SITES)}
AUDIO_VIDEO_NORMS = ("the audio-video attentions' q/k RMSNorm: diffusers' norm_q / norm_k, then rope_ on q and on k "
                     "(their tokens and tables differ; qk_norm_rope_ takes q and k of one table)")


def audio_sample(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).audio_sample.float()


@pytest.mark.parametrize("name", LTX_LIKE)
def test_ltx_like_patched_matches_diffusers_and_remove_restores_it(name):
    """Per LTX-Video block: norm1, norm2, attn1; per LTX-2 block: 8 norms and the self- and
    audio-video attentions. The text cross-attentions, the audio-video attentions' q/k norms and
    the output norms are left alone and reported; LTX-2's audio output matches too."""
    build, sites, ops = LTX_LIKE[name]
    model, inputs = build()
    state = {key: value.clone() for key, value in model.state_dict().items()}
    audio = audio_sample(model, inputs) if name != "ltx-video" else None
    report = assert_patched_matches(model, inputs, 2, 2 * sites, ops)
    texts = ("attn2",) if name == "ltx-video" else ("attn2", "audio_attn2")
    assert report.skipped == [f"transformer_blocks.{i}.{text}: text cross-attention, q/k RMSNorm without RoPE; left as "
                              "it is" for i in range(2) for text in texts] + ([] if name == "ltx-video" else [
        AUDIO_VIDEO_NORMS]) + [
        f"{'norm_out' if name == 'ltx-video' else 'norm_out, audio_norm_out'}: the output LayerNorm and its "
        "modulation; left as it is"]
    if audio is not None:
        integration.apply(model)
        patched = audio_sample(model, inputs)
        assert (patched - audio).norm() / audio.norm() <= TOLERANCE
        integration.remove(model)
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())


@pytest.mark.parametrize("name", LTX_LIKE)
def test_ltx_like_runs_the_ops(monkeypatch, name):
    """Per LTX-2 block: 4 norm_scale_shift (norm1s, the second modulation of the two audio-video
    norms), 6 residual_norm_scale_shift, qk_norm_rope_ once per self-attention (its q/k norms
    and RoPE) and rope_ twice (q, k: tables of their own) per audio-video attention."""
    calls = patched_calls(monkeypatch, LTX_LIKE[name][0], sorted(LTX_OPS))
    per_block = (["norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"] if name == "ltx-video" else
                 ["norm_scale_shift"] * 4 + ["residual_norm_scale_shift"] * 6 + ["qk_norm_rope_"] * 2 + ["rope_"] * 4)
    assert calls == sorted(per_block * 2)


def test_ltx2_isolated_modalities_stg_and_a_self_attention_mask_match_diffusers(monkeypatch):
    """isolate_modalities (no audio-video attention: the text attention's residual goes into
    norm3), STG on block 0 (its self-attentions go to diffusers' processor) and a video
    self-attention mask (diffusers' processor too): as diffusers computes them."""
    model, inputs = tiny_ltx2("split", ltx23=True)
    inputs.update(isolate_modalities=True, spatio_temporal_guidance_blocks=[0],
                  video_self_attention_mask=torch.rand(2, 32, 32, generator=torch.Generator().manual_seed(2)))
    expected, expected_audio = run(model, inputs), audio_sample(model, inputs)
    integration.apply(model)
    calls = recorded_calls(monkeypatch, sorted(LTX_OPS))
    patched, audio = run(model, inputs), audio_sample(model, inputs)
    assert (patched - expected).norm() / expected.norm() <= TOLERANCE
    assert (audio - expected_audio).norm() / expected_audio.norm() <= TOLERANCE
    # per forward: block 1's audio self-attention; per block: norm1s, norm2s and norm3s
    assert sorted(calls) == sorted((["qk_norm_rope_"] + ["norm_scale_shift"] * 2 * 2 + ["residual_norm_scale_shift"] * 4 * 2)
                                   * 2)


@pytest.mark.parametrize("name", LTX_LIKE)
def test_ltx_like_block_traces_as_one_graph(name):
    """The norms are the graph's ditops nodes; the q/k norms and RoPE are diffusers' there (ltx2.py
    says why)."""
    build, _, ops = LTX_LIKE[name]
    model, inputs = build()
    integration.apply(model)
    block = model.transformer_blocks[0]
    arguments, keywords = block_call(model, inputs, block)
    assert_traces_as_one_graph(block, arguments, LTX_OPS - {"qk_norm_rope_", "rope_"}, keywords)
    torch._dynamo.reset()
    code = torch._dynamo.explain(block)(*arguments, **keywords).graphs[0].code
    assert "torch.ops.ditops.rope_" not in code and "torch.ops.ditops.qk_norm_rope_" not in code


def test_ltx2_self_attention_with_a_hooked_or_other_norm_keeps_diffusers_norms(monkeypatch):
    """A hook on a self-attention's norm_q (block 0's video attn1), or q/k norms of two eps (block
    1's audio attn1, built so here): diffusers' norm_q / norm_k run, then rope_; the other
    self-attentions still take qk_norm_rope_, and the output is diffusers'."""
    model, inputs = tiny_ltx2("split")
    model.transformer_blocks[1].audio_attn1.norm_k.eps = 1e-5
    expected = run(model, inputs)
    report = integration.apply(model)
    assert ("transformer_blocks.1.audio_attn1.processor", "rope_") in report.replaced
    assert ("transformer_blocks.1.audio_attn1: q/k norms not torch.nn.RMSNorms of one eps over all heads of a token: "
            "diffusers' norm_q / norm_k, then rope_") in report.skipped
    hooked = []
    model.transformer_blocks[0].attn1.norm_q.register_forward_hook(lambda *arguments: hooked.append(True))
    calls = recorded_calls(monkeypatch, sorted(LTX_OPS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ditops' note that the hooked norm runs as diffusers' module
        patched = run(model, inputs)
    assert hooked
    # qk_norm_rope_: block 0's audio and block 1's video self-attention; rope_: the other two
    # (q and k in one call), and q and k of each audio-video attention
    assert sorted(call for call in calls if "rope" in call) == ["qk_norm_rope_"] * 2 + ["rope_"] * (2 + 2 * 2 * 2)
    assert (patched - expected).norm() / expected.norm() <= TOLERANCE


def test_ltx2_self_attentions_under_autograd_match_diffusers():
    """With grad (fine-tuning): qk_norm_rope_ writes the projections' outputs in place under
    autograd; the output and a q projection's weight gradient are diffusers'."""
    model, inputs = tiny_ltx2("split")
    weight = model.transformer_blocks[0].attn1.to_q.weight

    def output_and_gradient():
        model.zero_grad()
        sample = model(**inputs).sample
        sample.square().mean().backward()
        return sample.detach(), weight.grad.clone()

    expected, expected_gradient = output_and_gradient()
    integration.apply(model)
    patched, gradient = output_and_gradient()
    assert (patched - expected).norm() / expected.norm() <= TOLERANCE
    assert (gradient - expected_gradient).norm() / expected_gradient.norm() <= TOLERANCE


# ----- MiniMax-H3 ---------------------------------------------------------------------------------

MINIMAX_OPS = {"norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"}


def test_minimax_h3_patched_matches_diffusers_and_remove_restores_it():
    model, inputs = tiny_minimax_h3()
    report = assert_patched_matches(model, inputs, 2, 2 * 3, MINIMAX_OPS)
    assert report.skipped == ["token_refiner: unmodulated pre-norm blocks, left as diffusers wrote them"]


def test_minimax_h3_without_refiner_blocks_reports_no_refiner():
    model, inputs = tiny_minimax_h3(refiner_layers=0)
    report = assert_patched_matches(model, inputs, 2, 2 * 3, MINIMAX_OPS)
    assert report.skipped == []


def test_minimax_h3_runs_the_ops_on_each_rows_modulation(monkeypatch):
    """Per block: norm1, norm2 with the attention's residual, the q/k norms + RoPE; the ops
    take the block's [K, D] modulation tables and each row's table row as modulation_index,
    as the rows' tags and timesteps select it."""
    calls = patched_calls(monkeypatch, tiny_minimax_h3, sorted(MINIMAX_OPS))
    assert calls == sorted(["norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"] * 2)
    model, inputs = tiny_minimax_h3()
    integration.apply(model)
    scales = []
    original = integration.ops.norm_scale_shift
    monkeypatch.setattr(integration.ops, "norm_scale_shift",
                        lambda x, scale, *a, **k: scales.append((scale, k["modulation_index"])) or original(x, scale, *a, **k))
    run(model, inputs)
    rows = inputs["timestep_indices"] * 3 + inputs["token_tags"]
    table = model.transformer_blocks[0].adaln_proj(model.time_embedder(model.time_proj(inputs["timestep"])))[1]
    scale, index = scales[0]
    assert scale.shape == (6, 32) and torch.equal(scale, table) and torch.equal(index, rows)


def test_minimax_h3_block_traces_as_one_graph():
    model, inputs = tiny_minimax_h3()
    integration.apply(model)
    block = model.transformer_blocks[0]
    arguments, keywords = block_call(model, inputs, block)
    assert_traces_as_one_graph(block, arguments, MINIMAX_OPS, keywords)


# ----- bfloat16: every family above within the documented bound ----------------------------------

BUILDERS = {**{name: entry[0] for name, entry in FLUX_LIKE.items()}, **{name: entry[0] for name, entry in WAN_LIKE.items()},
            "sd3": tiny_sd3, "sd3.5": lambda: tiny_sd3(sd35=True), "flux2": tiny_flux2,
            **{name: entry[0] for name, entry in HUNYUAN_LIKE.items()},
            "hunyuan-video-1.5": lambda: bfloat16_timestep(*tiny_hunyuan_video15()),
            "hunyuan-image-2.1": lambda: bfloat16_timestep(*tiny_hunyuan_image()), "lumina2": tiny_lumina2,
            **COSMOS_LIKE, "kandinsky5": tiny_kandinsky5, "hidream": tiny_hidream,
            **{name: entry[0] for name, entry in LTX_LIKE.items()}, "minimax-h3": tiny_minimax_h3}
KEEP_IN_FLOAT32 = {"kandinsky5"}  # its time embedding cannot run in bfloat16


def bfloat16_timestep(model, inputs):
    """HunyuanVideo 1.5's and HunyuanImage's pipelines pass the timestep in the latents' dtype
    (their time embeddings run in the timestep's dtype)."""
    return model, dict(inputs, timestep=inputs["timestep"].to(torch.bfloat16))


def bfloat16(value, name=""):
    """Activations and conditions in bfloat16; position ids and timesteps as the pipelines pass them."""
    if isinstance(value, (list, tuple)):  # tuple: Cosmos 2.5's (text, image context)
        return type(value)(bfloat16(item) for item in value)
    if torch.is_tensor(value) and value.is_floating_point() and name not in ("img_ids", "txt_ids", "timestep"):
        return value.to(torch.bfloat16)
    return value


@pytest.mark.parametrize("name", BUILDERS)
def test_bfloat16_patched_within_the_documented_bound(name):
    """docs/ops.md: atol = rtol = 1.6e-2 and a relative error of the whole tensor of at most
    4 eps, per block the signal goes through (at most 4 here)."""
    model, inputs = BUILDERS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' note about casting with .to()
        model = model.to(torch.bfloat16)
    if name in KEEP_IN_FLOAT32:  # as from_pretrained(torch_dtype=torch.bfloat16) keeps them
        for path, module in model.named_modules():
            if set(path.split(".")) & set(model._keep_in_fp32_modules):
                module.float()
    inputs = {key: bfloat16(value, key) for key, value in inputs.items()}
    expected = run(model, inputs)
    integration.apply(model)
    patched = run(model, inputs)
    torch.testing.assert_close(patched, expected, atol=1.6e-2 * 4, rtol=1.6e-2 * 4)
    assert (patched - expected).norm() / expected.norm() <= 4 * torch.finfo(torch.bfloat16).eps * 4


# ----- blocks matched by their class ------------------------------------------------------------

EXACT_CLASS_BLOCKS = {  # family: (builder, a block's path in the model)
    "lumina2": (tiny_lumina2, "layers.0"), "cosmos": (tiny_cosmos, "transformer_blocks.0"),
    "kandinsky5": (tiny_kandinsky5, "visual_transformer_blocks.0"), "hidream": (tiny_hidream, "double_stream_blocks.0.block"),
    "ltx-2": (tiny_ltx2, "transformer_blocks.0"),
}


@pytest.mark.parametrize("family", EXACT_CLASS_BLOCKS)
def test_a_block_of_a_subclass_is_left_as_it_is_and_named(family):
    """Where a module matches its blocks by class (patching.is_block), a subclass, which may
    compute otherwise, is not patched: the report names it, the model still gives diffusers'
    output and the other blocks are patched."""
    build, path = EXACT_CLASS_BLOCKS[family]
    model, inputs = build()
    block = model.get_submodule(path)
    original = type(block)
    block.__class__ = type(f"Custom{original.__name__}", (original,), {})
    expected = run(model, inputs)
    report = integration.apply(model)
    assert f"{path}: Custom{original.__name__}, not {original.__name__}; left as it is" in report.skipped
    assert not any(site.startswith(f"{path}.") for site, _ in report.replaced)
    assert report.replaced and "forward" not in vars(block)
    torch.testing.assert_close(run(model, inputs), expected, rtol=1e-5, atol=1e-5)

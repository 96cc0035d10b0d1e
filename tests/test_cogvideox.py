"""ditops.integrations.diffusers on CogVideoX (1.0 and 1.5) and ConsisID (cogvideox.py): tiny
random-weight models on CPU (no download), with the rotary tables the pipelines build.

Float32: the patched output equals diffusers' within what one op may differ by per block
(docs/ops.md: atol = rtol = 1e-5, relative error of the whole tensor <= 1e-5), the report counts
the sites, the ops run where the report says, ``remove`` restores the bits, and what is left
alone is named in the report; bfloat16 within the bound of the other families' tests; a patched
block under torch.compile(fullgraph=True) is one graph; ``quantize="fp8"`` feeds the norms' FP8
rows to q/k/v and the FFN (the reference backend computes the FP8 ops on CPU, as in
tests/test_fp8.py).
"""

import warnings

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
integration = pytest.importorskip("ditops.integrations.diffusers")

from fp8_checks import FP8_OPS, fed_and_own_input, in_graph_and_matches_eager, state_copy  # noqa: E402
from model_runs import assert_traces_as_one_graph, block_call, recorded_calls, run  # noqa: E402
from tiny_models import COGVIDEOX_HEAD_DIM, COGVIDEOX_TEXT, in_dtype, tiny_cogvideox, tiny_cogvideox15, tiny_consisid  # noqa: E402

from ditops.fp8 import Float8Linear  # noqa: E402
from ditops.integrations.diffusers import cogvideox, patching  # noqa: E402

TOLERANCE = 1e-5  # float32, per op (docs/ops.md)
OPS = {"norm_scale_shift", "residual_norm_scale_shift", cogvideox.QK_NORM_ROPE}
OUTPUT_NORMS = "norm_final, norm_out: the output LayerNorm and its modulated norm (once per forward); left as it is"


BUILDERS = {"cogvideox": tiny_cogvideox, "cogvideox-1.5": tiny_cogvideox15, "consisid": tiny_consisid,
            "consisid-face": lambda: tiny_consisid(face=True)}


def _sites(blocks=2):
    return sorted((f"transformer_blocks.{i}.{site}", op) for i in range(blocks) for site, op in (
        ("attn1.processor", cogvideox.QK_NORM_ROPE), ("norm1", "norm_scale_shift"),
        ("norm2", "residual_norm_scale_shift")))


def assert_patched_matches(model, inputs, sites: list) -> integration.Report:
    """apply: the `sites` (path, op) replaced, the output as diffusers' within two blocks' tolerance;
    remove: diffusers' output bit for bit and the state untouched. Returns the report."""
    state = state_copy(model)
    expected = run(model, inputs)
    assert expected.abs().max() > 0.1  # the tiny model computes something
    report = integration.apply(model)
    assert sorted(report.replaced) == sorted(sites), str(report)
    patched = run(model, inputs)
    torch.testing.assert_close(patched, expected, atol=TOLERANCE * 2, rtol=TOLERANCE * 2)
    assert (patched - expected).norm() / expected.norm() <= TOLERANCE
    integration.remove(model)
    assert torch.equal(run(model, inputs), expected)
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())
    assert not any("forward" in vars(module) for module in model.modules())
    assert all(type(block.attn1.processor).__module__.startswith("diffusers") for block in model.transformer_blocks)
    return report


@pytest.mark.parametrize("name", BUILDERS)
def test_patched_matches_diffusers_and_remove_restores_it(name):
    """Per block: norm1, norm2 (with the attention's residual) and the attention's q/k norm + RoPE."""
    model, inputs = BUILDERS[name]()
    report = assert_patched_matches(model, inputs, _sites())
    faces = ["local_facial_extractor, perceiver_cross_attention: ConsisID's face modules; left as diffusers wrote "
             "them"] if name == "consisid-face" else []
    assert report.skipped == [OUTPUT_NORMS] + faces


@pytest.mark.parametrize("name", BUILDERS)
def test_the_patched_model_runs_the_ops(monkeypatch, name):
    """Per block: norm1 of each stream, norm2 of each stream with its residual, one
    qk_norm_rope_ on the video tokens (the text tokens' q/k: diffusers' LayerNorm); the ops get
    the norms' weights and biases, one rotary row per video token."""
    model, inputs = BUILDERS[name]()
    integration.apply(model)
    calls = recorded_calls(monkeypatch, ("norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"))
    seen = []
    original = integration.ops.qk_norm_rope_
    monkeypatch.setattr(integration.ops, "qk_norm_rope_",
                        lambda q, k, *a, **kw: seen.append((q.shape, a[2].shape, kw)) or original(q, k, *a, **kw))
    run(model, inputs)
    assert sorted(calls) == sorted(["norm_scale_shift", "norm_scale_shift", "residual_norm_scale_shift",
                                    "residual_norm_scale_shift", "qk_norm_rope_"] * 2)
    video = inputs["image_rotary_emb"][0].shape[0]
    heads = model.config.num_attention_heads
    shape, cache, options = seen[0]
    assert shape == (2, video, heads, COGVIDEOX_HEAD_DIM) and cache == (video, COGVIDEOX_HEAD_DIM)
    attn = model.transformer_blocks[0].attn1
    assert options["norm"] == "layer" and options["interleaved"] is True and options["eps"] == attn.norm_q.eps
    assert options["q_bias"] is attn.norm_q.bias and options["k_bias"] is attn.norm_k.bias


@pytest.mark.parametrize("name", BUILDERS)
def test_bfloat16_patched_within_the_documented_bound(name):
    """docs/ops.md: atol = rtol = 1.6e-2 and a relative error of the whole tensor of at most
    4 eps, per block the signal goes through (2 here; the bound of 4 blocks, as
    tests/test_diffusers_coverage.py's)."""
    model, inputs, _ = in_dtype(BUILDERS[name])(torch.bfloat16)
    expected = run(model, inputs)
    integration.apply(model)
    patched = run(model, inputs)
    torch.testing.assert_close(patched, expected, atol=1.6e-2 * 4, rtol=1.6e-2 * 4)
    assert (patched - expected).norm() / expected.norm() <= 4 * torch.finfo(torch.bfloat16).eps * 4


@pytest.mark.parametrize("name", ["cogvideox", "consisid"])
def test_a_patched_block_traces_as_one_graph(name):
    """torch.compile(fullgraph=True) of a patched block: one graph, the ditops ops its nodes,
    the compiled output as eager's."""
    model, inputs = BUILDERS[name]()
    integration.apply(model)
    block = model.transformer_blocks[0]
    arguments, keywords = block_call(model, inputs, block)
    assert_traces_as_one_graph(block, arguments, ("norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"),
                               keywords)


def test_gradients_through_the_patched_model_are_diffusers():
    """With autograd (training, LoRA): the in-place q/k norm + RoPE on the video rows runs before
    the text rows' norms save their input, so the backward sees no modified tensor."""
    model, inputs = tiny_cogvideox()
    inputs["hidden_states"].requires_grad_(True)

    def gradients():
        model.zero_grad()
        inputs["hidden_states"].grad = None
        model(**inputs).sample.square().mean().backward()
        return {"input": inputs["hidden_states"].grad.clone(),
                **{name: parameter.grad.clone() for name, parameter in model.named_parameters()
                   if parameter.grad is not None}}

    expected = gradients()
    integration.apply(model)
    got = gradients()
    assert got.keys() == expected.keys()
    for name, gradient in expected.items():
        assert (got[name] - gradient).norm() <= 1e-4 * gradient.norm() + 1e-9, name


# ----- what is left alone, and reported -----------------------------------------------------------


def test_without_rotary_embeddings_the_attentions_stay_diffusers_and_are_reported():
    """CogVideoX-2b's layout (sincos positions in the patch embedding, no RoPE): the norms are
    patched, the processors are diffusers'."""
    model, inputs = tiny_cogvideox(rope=False)
    report = assert_patched_matches(model, inputs, [site for site in _sites() if "attn1" not in site[0]])
    reason = ("the model has no rotary embeddings (use_rotary_positional_embeddings=False: its positions are in the "
              "patch embedding), so no q/k norm + RoPE to fuse; its q/k norms and RoPE stay as diffusers wrote them")
    assert report.skipped == [f"transformer_blocks.{i}.attn1: {reason}" for i in range(2)] + [OUTPUT_NORMS]


@pytest.mark.parametrize("change", ["no-qk-norm", "fused-processor"])
def test_an_attention_ditops_does_not_cover_keeps_diffusers_processor_and_is_reported(change):
    """No q/k norms (qk_norm=False), or diffusers' fused-projection processor: block 1's attention
    stays diffusers'; its norms and block 0 are patched."""
    from diffusers.models.attention_processor import FusedCogVideoXAttnProcessor2_0

    model, inputs = tiny_cogvideox()
    attn = model.transformer_blocks[1].attn1
    if change == "no-qk-norm":
        attn.norm_q = attn.norm_k = None
        reason = "no q/k norms (qk_norm=False)"
    else:
        attn.fuse_projections(fuse=True)
        attn.set_processor(FusedCogVideoXAttnProcessor2_0())
        reason = "processor FusedCogVideoXAttnProcessor2_0, not diffusers' CogVideoXAttnProcessor2_0"
    report = assert_patched_matches(model, inputs, [site for site in _sites()
                                                    if site[0] != "transformer_blocks.1.attn1.processor"])
    assert report.skipped == [f"transformer_blocks.1.attn1: {reason}; its q/k norms and RoPE stay as diffusers wrote "
                              "them", OUTPUT_NORMS]


def test_a_block_with_another_forward_is_left_alone_and_reported():
    """A block with CogVideoX's layout whose forward differs (here: the text stream's FFN gate
    dropped) keeps its norms; its attention, whose processor is diffusers', is still patched."""
    model, inputs = tiny_cogvideox()

    class Altered(type(model.transformer_blocks[1])):
        def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, attention_kwargs=None):
            hidden_states, new_encoder_hidden_states = super().forward(hidden_states, encoder_hidden_states, temb,
                                                                       image_rotary_emb, attention_kwargs)
            return hidden_states, 0.5 * (encoder_hidden_states + new_encoder_hidden_states)

    model.transformer_blocks[1].__class__ = Altered
    report = assert_patched_matches(model, inputs, [site for site in _sites()
                                                    if not site[0].startswith("transformer_blocks.1.norm")])
    assert report.skipped == ["transformer_blocks.1: Altered has another forward than CogVideoX's block; its norms "
                              "stay as diffusers wrote them", OUTPUT_NORMS]


def test_cogview3plus_which_shares_the_processor_is_not_patched():
    """CogView3-Plus runs CogVideoX's processor (no RoPE, q/k LayerNorms without affine
    parameters) in blocks that compute otherwise: not a supported model, left untouched."""
    model = diffusers.CogView3PlusTransformer2DModel(patch_size=2, in_channels=4, num_layers=1, attention_head_dim=16,
                                                     num_attention_heads=2, out_channels=4, text_embed_dim=32,
                                                     time_embed_dim=32, condition_dim=8, pos_embed_max_size=16,
                                                     sample_size=16)
    with pytest.warns(UserWarning, match="CogView3PlusTransformer2DModel: not a supported model"):
        report = integration.apply(model)
    assert not report.replaced


# ----- hooks: diffusers' code runs where a hook is on a module whose call an op replaces ----------


@pytest.mark.parametrize("hooked", ["norm1.norm", "norm2.norm", "attn1.norm_q"])
def test_a_hook_on_a_fused_norm_runs_diffusers_code_there(hooked, monkeypatch):
    """The block (norm2's), norm1 or the processor runs diffusers' code, so that the hook runs;
    one warning names it."""
    monkeypatch.setattr(patching, "_warned", set())  # patching warns once per (class, module, hook)
    model, inputs = tiny_cogvideox()
    expected = run(model, inputs)
    integration.apply(model)
    seen = []
    model.transformer_blocks[0].get_submodule(hooked).register_forward_hook(lambda *arguments: seen.append(True))
    with pytest.warns(UserWarning, match="has a torch forward hook"):
        patched = run(model, inputs)
    assert seen  # the hook ran
    assert (patched - expected).norm() / expected.norm() <= TOLERANCE


def test_a_call_with_an_attention_mask_goes_to_diffusers_processor():
    """diffusers' processor takes a mask through attention_kwargs; ditops' hands such calls to it."""
    model, inputs = tiny_cogvideox()
    mask = torch.ones(2, COGVIDEOX_TEXT + inputs["image_rotary_emb"][0].shape[0], dtype=torch.bool)
    mask[1, 3:COGVIDEOX_TEXT] = False  # the second prompt's padding
    unmasked = run(model, inputs)
    inputs = dict(inputs, attention_kwargs={"attention_mask": mask})
    assert_patched_matches(model, inputs, _sites())
    masked = run(model, inputs)
    assert torch.equal(masked[0], unmasked[0]) and (masked[1] - unmasked[1]).abs().max() > 1e-3  # the mask counts


# ----- quantize="fp8" --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILDERS)
def test_fp8_norms_feed_q_k_v_and_the_ffn_fp8_rows_and_remove_restores_the_bf16_model(name, monkeypatch):
    """norm1 gives FP8 rows to q/k/v (both streams joined), norm2 to the GELU-tanh FFN (its GELU
    and quantisation one quantize_fp8); the attention output and the modulations quantise their
    own input; remove gives the bf16 model back bit for bit."""
    model, inputs, _ = in_dtype(BUILDERS[name])(torch.bfloat16)
    linears = [path for path, module in model.named_modules() if type(module) is torch.nn.Linear]
    before, expected = state_copy(model), run(model, inputs)
    calls = recorded_calls(monkeypatch, FP8_OPS + ("norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"))
    report = integration.apply(model, quantize="fp8")
    assert sorted(dict(report.linears)) == sorted(linears)  # every Linear, once
    for path, kind in report.linears:
        assert kind.startswith("fp8") == isinstance(model.get_submodule(path), Float8Linear), (path, kind)
    sites = [(path, op + "_fp8" if op != cogvideox.QK_NORM_ROPE else op) for path, op in _sites()]
    assert sorted(report.replaced) == sorted(sites + [(f"transformer_blocks.{i}.ff", "quantize_fp8 (GELU)")
                                                      for i in range(2)]), str(report)
    fed, own_input = fed_and_own_input(report)
    for i in range(2):
        block = f"transformer_blocks.{i}"
        assert {f"{block}.attn1.to_q", f"{block}.attn1.to_k", f"{block}.attn1.to_v", f"{block}.ff.net.0.proj",
                f"{block}.ff.net.2"} <= fed
        assert {f"{block}.attn1.to_out.0", f"{block}.norm1.linear", f"{block}.norm2.linear"} <= own_input
    assert not any("give bf16" in line for line in report.skipped)
    patched = run(model, inputs)
    # per block: norm1 and norm2 of each stream, the video q/k; no bf16 norm
    assert calls.count("norm_scale_shift_fp8") == calls.count("residual_norm_scale_shift_fp8") == 2 * 2
    assert calls.count("qk_norm_rope_") == 2 and "norm_scale_shift" not in calls
    assert "residual_norm_scale_shift" not in calls
    error = ((patched - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.15, error  # FP8 GEMMs on random weights
    integration.remove(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[key], before[key]) for key in before)
    assert torch.equal(run(model, inputs), expected)


def test_fp8_with_a_processor_that_is_not_ditops_norm1_gives_bf16_and_is_reported():
    model, inputs, _ = in_dtype(tiny_cogvideox)(torch.bfloat16)
    model.transformer_blocks[1].attn1.norm_k.eps = 1e-3  # q/k norms of two eps: diffusers' processor stays
    report = integration.apply(model, quantize="fp8")
    assert "transformer_blocks.1.norm1: its norms give bf16 (the attention processor is not ditops')" in report.skipped
    assert ("transformer_blocks.1.norm1", "norm_scale_shift") in report.replaced
    assert ("transformer_blocks.1.norm2", "residual_norm_scale_shift_fp8") in report.replaced
    assert "own input" in dict(report.linears)["transformer_blocks.1.attn1.to_q"]
    run(model, inputs)


def test_fp8_rows_reach_a_processor_set_after_apply_as_tensors():
    """A processor set after apply (diffusers' own) takes tensors: the block dequantises norm1's rows."""
    from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0

    model, inputs, _ = in_dtype(tiny_cogvideox)(torch.bfloat16)
    expected = run(model, inputs)
    integration.apply(model, quantize="fp8")
    model.transformer_blocks[0].attn1.set_processor(CogVideoXAttnProcessor2_0())
    patched = run(model, inputs)
    assert 0 < ((patched - expected).norm() / expected.norm()).item() < 0.15


@pytest.mark.parametrize("name", ["cogvideox", "consisid"])
def test_compiled_fp8_block_is_one_graph_and_matches_eager(name):
    model, inputs, _ = in_dtype(BUILDERS[name])(torch.bfloat16)
    integration.apply(model, quantize="fp8")
    block = model.transformer_blocks[0]
    arguments, keywords = block_call(model, inputs, block)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="ditops")  # no hook fallback: the fused block is what is compiled
        in_graph_and_matches_eager(block, arguments, keywords, ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8",
                                                                "quantize_fp8", "qk_norm_rope_"))

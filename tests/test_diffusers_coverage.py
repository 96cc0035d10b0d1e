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

TOLERANCE = 1e-5  # float32, per op (docs/ops.md)


def run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample.float()


def built(model_class, **config):
    """The model with random norm weights (diffusers initialises them to 1), so that a norm
    applied with another's weights shows."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' notes about configs and casting
        model = model_class(**config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight") and parameter.ndim == 1:
                parameter.uniform_(0.5, 1.5)
    return model


def recorded_calls(monkeypatch, names) -> list:
    """The names of the ops among `names` that the integration calls, in call order."""
    calls = []
    for name in names:
        original = getattr(integration.ops, name)
        monkeypatch.setattr(integration.ops, name,
                            lambda *a, _original=original, _name=name, **k: calls.append(_name) or _original(*a, **k))
    return calls


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
FLUX_SHAPE = dict(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2, attention_head_dim=16,
                  num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8))


def flux_inputs(text_tokens=5, image_tokens=12, **extra):
    generator = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, image_tokens, 8, generator=generator),
                  encoder_hidden_states=torch.randn(2, text_tokens, 32, generator=generator),
                  timestep=torch.rand(2, generator=generator),
                  img_ids=torch.randn(image_tokens, 3, generator=generator) * 8, txt_ids=torch.zeros(text_tokens, 3))
    inputs.update(extra)
    return inputs


def tiny_chroma():
    model = built(diffusers.ChromaTransformer2DModel, **FLUX_SHAPE, approximator_num_channels=16,
                  approximator_hidden_dim=32, approximator_layers=1)
    # the pipeline's mask: the text keep-mask (the second prompt is 3 tokens long), then the image tokens
    text_mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    return model, flux_inputs(attention_mask=torch.cat([text_mask, torch.ones(2, 12)], dim=1))


def tiny_longcat_image():
    return built(diffusers.LongCatImageTransformer2DModel, **FLUX_SHAPE, pooled_projection_dim=32), flux_inputs()


def tiny_ovis_image():
    return built(diffusers.OvisImageTransformer2DModel, **FLUX_SHAPE, out_channels=8), flux_inputs()


def tiny_bria():
    generator = torch.Generator().manual_seed(2)
    return (built(diffusers.BriaTransformer2DModel, **FLUX_SHAPE, pooled_projection_dim=32),
            flux_inputs(pooled_projections=torch.randn(2, 32, generator=generator)))


def tiny_bria_fibo():
    model = built(diffusers.BriaFiboTransformer2DModel, **FLUX_SHAPE, text_encoder_dim=16)
    generator = torch.Generator().manual_seed(2)
    layers = [torch.randn(2, 5, 16, generator=generator) for _ in range(4)]  # one per block
    return model, flux_inputs(text_encoder_layers=layers)


# name: (build, sites replaced, ops, blocks the signal goes through)
FLUX_LIKE = {
    # per double block: norm1, norm1_context, the block (norm2 and norm2_context), attn; per single block: norm, attn
    "chroma": (tiny_chroma, 2 * 4 + 2 * 2, FLUX_OPS),
    "longcat-image": (tiny_longcat_image, 2 * 4 + 2 * 2, FLUX_OPS),
    "ovis-image": (tiny_ovis_image, 2 * 4 + 2 * 2, FLUX_OPS),
    "bria": (tiny_bria, 2 * 4 + 2 * 2, FLUX_OPS),
    # FIBO's single blocks run diffusers' generic Attention: their attention stays
    "bria-fibo": (tiny_bria_fibo, 2 * 4 + 2 * 1, FLUX_OPS),
}


@pytest.mark.parametrize("name", FLUX_LIKE)
def test_flux_like_patched_matches_diffusers_and_remove_restores_it(name):
    build, sites, ops = FLUX_LIKE[name]
    model, inputs = build()
    report = assert_patched_matches(model, inputs, 4, sites, ops)
    if name == "bria-fibo":
        assert report.skipped == [f"single_transformer_blocks.{i}.attn: processor BriaAttnProcessor or its q/k norms "
                                  "are not the ones checked" for i in range(2)]
    else:
        assert not report.skipped


@pytest.mark.parametrize("name", FLUX_LIKE)
def test_flux_like_runs_the_ops(monkeypatch, name):
    model, inputs = FLUX_LIKE[name][0]()
    integration.apply(model)
    calls = recorded_calls(monkeypatch, sorted(FLUX_OPS))
    run(model, inputs)
    # 2 double blocks: 2 AdaLN + 2 residual norms + 2 RoPE calls (text, image); 2 single blocks: 1 + 1 (FIBO: 1 + 0)
    single_rope = 0 if name == "bria-fibo" else 2
    assert sorted(calls) == sorted(["norm_scale_shift"] * 6 + ["residual_norm_scale_shift"] * 4
                                   + ["qk_norm_rope_"] * (4 + single_rope))


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

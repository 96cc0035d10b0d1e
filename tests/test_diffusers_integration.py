"""ditops.integrations.diffusers on tiny random-weight diffusers models, on CPU (no download).

Tolerance: the patched model computes the same math as diffusers with different rounding
(one rounding per fused op instead of one per torch op), so outputs may differ by what one
op may differ by (docs/ops.md: atol = rtol = 1e-5 in float32, 1.6e-2 in bfloat16, and a relative
error of the whole tensor of at most 4 eps) for each block the signal went through.
"""

import subprocess
import sys
import types

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
integration = pytest.importorskip("ditops.integrations.diffusers")

from model_runs import TOLERANCE, recorded_calls, run  # noqa: E402
from tiny_models import cast, tiny_flux, tiny_qwen, tiny_wan, tiny_z_image, z_image_noise_mask_call  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_flux_patched_matches_diffusers_and_remove_restores_it(dtype):
    model, inputs, blocks = tiny_flux(dtype)
    expected = run(model, inputs)
    report = integration.apply(model)
    assert {op for _, op in report.replaced} == {"norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"}
    assert len(report.replaced) == 12 and not report.skipped
    patched = run(model, inputs)
    tolerance = TOLERANCE[dtype] * blocks
    torch.testing.assert_close(patched, expected, atol=tolerance, rtol=tolerance)
    epsilon = torch.finfo(dtype).eps
    assert (patched - expected).norm() / expected.norm() <= 4 * epsilon * blocks
    integration.remove(model)
    assert torch.equal(run(model, inputs), expected)


def test_the_patched_model_runs_the_ops(monkeypatch):
    model, inputs, _ = tiny_flux(torch.float32)
    integration.apply(model)
    calls = recorded_calls(monkeypatch, ("norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"))
    run(model, inputs)
    # 2 double blocks: 2 AdaLN + 2 residual norms + 2 RoPE calls (text, image); 2 single blocks: 1 + 1
    assert sorted(calls) == sorted(["norm_scale_shift"] * 6 + ["residual_norm_scale_shift"] * 4 + ["qk_norm_rope_"] * 6)


def test_a_forward_already_set_on_the_instance_is_replaced_and_restored():
    """Hooks (accelerate's offloading, for one) set forward on the instance: apply must still
    bind its own, and remove must put the instance's back."""
    model, inputs, _ = tiny_flux(torch.float32)
    expected = run(model, inputs)
    norm = model.transformer_blocks[0].norm1
    hook = types.MethodType(type(norm).forward, norm)
    norm.forward = hook
    integration.apply(model)
    assert norm.forward is not hook
    torch.testing.assert_close(run(model, inputs), expected, atol=4e-5, rtol=4e-5)
    integration.remove(model)
    assert norm.forward is hook and torch.equal(run(model, inputs), expected)


def test_apply_twice_changes_nothing():
    model, inputs, _ = tiny_flux(torch.float32)
    first = integration.apply(model)
    patches = list(model._ditops_patches)
    assert integration.apply(model) is first and model._ditops_patches == patches
    integration.remove(model)
    assert not hasattr(model, "_ditops_patches")


MODELS = {
    "z-image": (tiny_z_image, {"norm_scale_shift", "add_gate_norm_scale", "add_gate_norm", "qk_norm_rope_"}),
    "wan": (tiny_wan, {"norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_ (norm_over=token)"}),
    "qwen-image": (tiny_qwen, {"norm_scale_shift (select with modulate_index)",
                               "residual_norm_scale_shift (select with modulate_index)", "qk_norm_rope_"}),
    "qwen-image-edit": (lambda dtype: tiny_qwen(dtype, edit=True),
                        {"norm_scale_shift (select with modulate_index)",
                         "residual_norm_scale_shift (select with modulate_index)", "qk_norm_rope_"}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", MODELS)
def test_wan_and_qwen_patched_match_diffusers(name, dtype):
    build, ops_expected = MODELS[name]
    model, inputs, blocks = build(dtype)
    expected = run(model, inputs)
    report = integration.apply(model)
    assert {op for _, op in report.replaced} == ops_expected
    patched = run(model, inputs)
    tolerance = TOLERANCE[dtype] * blocks
    torch.testing.assert_close(patched, expected, atol=tolerance, rtol=tolerance)
    assert (patched - expected).norm() / expected.norm() <= 4 * torch.finfo(dtype).eps * blocks
    integration.remove(model)
    assert torch.equal(run(model, inputs), expected)


def test_qwen_image_edit_runs_the_select_ops(monkeypatch):
    model, inputs, _ = tiny_qwen(torch.float32, edit=True)
    integration.apply(model)
    calls = recorded_calls(monkeypatch, ("norm_scale_shift", "norm_scale_shift_select", "residual_norm_scale_shift", "residual_norm_scale_shift_select"))
    run(model, inputs)
    # per block: the image stream's two select ops, the text stream's two plain ones
    assert sorted(calls) == sorted(["norm_scale_shift_select", "residual_norm_scale_shift_select",
                                    "norm_scale_shift", "residual_norm_scale_shift"] * 2)


def test_z_image_runs_the_gated_add_ops(monkeypatch):
    model, inputs, _ = tiny_z_image(torch.float32)
    integration.apply(model)
    calls = recorded_calls(monkeypatch, ("norm_scale_shift", "add_gate_norm_scale", "add_gate_norm", "qk_norm_rope_"))
    run(model, inputs)
    # three modulated blocks (noise refiner, two layers) run the three norm ops; the context
    # refiner has no modulation; all four attentions run qk_norm_rope_
    assert sorted(calls) == sorted(["norm_scale_shift", "add_gate_norm_scale", "add_gate_norm"] * 3 + ["qk_norm_rope_"] * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_z_image_noise_mask_blocks_run_the_ops_with_per_token_modulation(dtype, monkeypatch):
    """Z-Image Omni's blocks with noise_mask: each token takes the noisy or the clean
    modulation; patched, the same three norm ops take them, norm_scale_shift its scale as a
    [B, 2, D] table (clean, noisy) read through noise_mask, the others as [B, S, D] tensors,
    and match diffusers' block."""
    model, _, _ = tiny_z_image(dtype)
    call = z_image_noise_mask_call(model, dtype)
    expected = call()
    integration.apply(model)
    calls = recorded_calls(monkeypatch, ("norm_scale_shift", "add_gate_norm_scale", "add_gate_norm"))
    tables, recorded = [], integration.ops.norm_scale_shift
    monkeypatch.setattr(integration.ops, "norm_scale_shift",
                        lambda x, scale, *a, **k: tables.append((scale.shape, k["modulation_index"])) or recorded(x, scale, *a, **k))
    patched = call()
    assert sorted(calls) == ["add_gate_norm", "add_gate_norm_scale", "norm_scale_shift"]
    (shape, index), = tables
    assert shape == (2, 2, model.dim) and index.shape == (2, 11) and set(index.unique().tolist()) == {0, 1}
    tolerance = TOLERANCE[dtype] * len(calls)  # each op rounds once where diffusers rounds each step
    torch.testing.assert_close(patched, expected, atol=tolerance, rtol=tolerance)
    assert (patched - expected).norm() / expected.norm() <= 4 * torch.finfo(dtype).eps
    integration.remove(model)
    assert torch.equal(call(), expected)


def test_wan_runs_the_norm_ops_and_one_token_norm_qk_norm_rope_per_self_attention(monkeypatch):
    model, inputs, _ = tiny_wan(torch.float32)
    integration.apply(model)
    calls = recorded_calls(monkeypatch, ("norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_", "rope_"))
    norm_over, recorded = [], integration.ops.qk_norm_rope_
    monkeypatch.setattr(integration.ops, "qk_norm_rope_", lambda *a, **k: norm_over.append(k.get("norm_over")) or recorded(*a, **k))
    run(model, inputs)
    # per block: norm1; norm2 and norm3 with their residuals; the self-attention's q/k norm + RoPE
    assert sorted(calls) == sorted((["norm_scale_shift"] + ["residual_norm_scale_shift"] * 2 + ["qk_norm_rope_"]) * 2)
    assert norm_over == ["token"] * 2


def test_an_unsupported_model_is_left_untouched_with_one_warning():
    model = diffusers.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
                                            sample_size=8)
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.warns(UserWarning, match="left the model untouched: DiTTransformer2DModel: not a supported model") as caught:
        report = integration.apply(model)
    assert len(caught) == 1 and report.replaced == [] and "DiTTransformer2DModel" in report.skipped[0]
    assert not hasattr(model, "_ditops_patches") and all(torch.equal(state[n], t) for n, t in model.state_dict().items())


def test_importing_ditops_does_not_import_diffusers():
    code = "import sys, ditops, ditops.integrations; print('diffusers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize("name", ["flux", "wan", "qwen-image", "z-image"])
def test_torch_compile_of_the_patched_model_adds_no_graph_break(name):
    """FLUX, Wan and Qwen-Image trace as one graph before and after; Z-Image's own forward
    breaks the graph in places ditops does not touch, and no more after apply."""
    build = {"flux": tiny_flux, "wan": tiny_wan, "qwen-image": tiny_qwen, "z-image": tiny_z_image}[name]
    model, inputs, _ = build(torch.float32)
    with torch.no_grad():
        torch._dynamo.reset()
        before = torch._dynamo.explain(model)(**inputs)
        integration.apply(model)
        torch._dynamo.reset()
        after = torch._dynamo.explain(model)(**inputs)
    assert after.graph_break_count <= before.graph_break_count
    assert name == "z-image" or after.graph_break_count == 0
    code = "".join(graph.code for graph in after.graphs)
    for op in GRAPH_OPS[name]:
        assert f"torch.ops.ditops.{op}(" in code, f"{op} is not a node of the traced graphs"


GRAPH_OPS = {
    "flux": ["norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"],
    "wan": ["norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"],
    "qwen-image": ["norm_scale_shift", "residual_norm_scale_shift", "qk_norm_rope_"],
    "z-image": ["norm_scale_shift", "add_gate_norm_scale", "add_gate_norm", "qk_norm_rope_"],
}


def test_model_to_dtype_after_apply_keeps_the_patches():
    model, inputs, blocks = tiny_flux(torch.float32)
    reference_model, _, _ = tiny_flux(torch.float32)
    integration.apply(model)
    model, reference_model = cast(model, torch.bfloat16), cast(reference_model, torch.bfloat16)
    inputs = {name: value.to(torch.bfloat16) if value.is_floating_point() and name.endswith("states") or name in ("pooled_projections", "timestep") else value
              for name, value in inputs.items()}
    patched, expected = run(model, inputs), run(reference_model, inputs)
    tolerance = TOLERANCE[torch.bfloat16] * blocks
    torch.testing.assert_close(patched, expected, atol=tolerance, rtol=tolerance)
    assert len(model._ditops_patches) == 12

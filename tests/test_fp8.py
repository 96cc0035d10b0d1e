"""FP8: the *_fp8 ops' defined edge cases, the FP8 linear layers, and ``apply(model,
quantize="fp8")`` on tiny random diffusers models, on CPU (the reference backend computes the
ops; torch._scaled_mm runs on the CPU too). The ops' values against the float64 oracle are the
conformance suite's (tests/conformance); speed is benchmarks/fp8.py's."""

import warnings

import pytest
import torch

import ditops
from ditops import dispatch, fp8
from ditops.dispatch import simulated_device
from ditops.fp8 import Float8Linear, Float8Rows

E4M3 = torch.float8_e4m3fn


def _modulation(batch=2, hidden=64):
    generator = torch.Generator().manual_seed(3)
    return torch.randn(batch, 6, hidden, generator=generator)


def test_a_row_holding_nan_or_inf_is_nan_and_the_others_are_not_touched():
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
    x[0, 1, 3], x[1, 4, 0] = float("nan"), float("inf")
    modulation = _modulation()
    y, y_scale = ditops.norm_scale_shift_fp8(x, modulation[:, 1], modulation[:, 0], fp8_dtype=E4M3)
    bad = torch.zeros(2, 5, dtype=torch.bool)
    bad[0, 1] = bad[1, 4] = True
    assert y_scale[bad].isnan().all() and y.float()[bad].isnan().all()
    assert y_scale[~bad].isfinite().all() and y.float()[~bad].isfinite().all()


def test_an_all_zero_row_has_the_floor_scale_and_zero_values():
    x = torch.randn(3, 32)
    x[1] = 0
    y, y_scale = ditops.quantize_fp8(x, fp8_dtype=E4M3)
    assert y_scale[1].item() == pytest.approx(1e-12 / 448)
    assert torch.equal(y.float()[1], torch.zeros(32))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_rows_of_no_values_get_the_zero_row_scale(static):
    """D = 0: no kernel runs, and each row's scale is still written: the all-zero row's floor,
    or the static scale."""
    static_scale = torch.tensor([0.25]) if static else None
    x, modulation = torch.randn(2, 3, 0), torch.randn(2, 0)
    expected = 0.25 if static else 1e-12 / 448
    for _, y_scale, *_ in (ditops.quantize_fp8(x, fp8_dtype=E4M3, static_scale=static_scale),
                           ditops.norm_scale_shift_fp8(x, modulation, modulation, fp8_dtype=E4M3, static_scale=static_scale),
                           ditops.residual_norm_scale_shift_fp8(x, x, modulation, modulation, modulation, fp8_dtype=E4M3,
                                                                static_scale=static_scale)):
        assert y_scale.shape == (2, 3, 1)
        assert torch.equal(y_scale, torch.full((2, 3, 1), expected, dtype=torch.float32))


def test_dynamic_scales_map_each_rows_largest_value_to_the_formats_largest():
    x = torch.randn(4, 48) * torch.tensor([1e-3, 1.0, 30.0, 1e4])[:, None]
    for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        y, y_scale = ditops.quantize_fp8(x, fp8_dtype=fp8_dtype)
        fmax = torch.finfo(fp8_dtype).max
        assert torch.equal(y.float().abs().amax(-1), torch.full((4,), fmax))
        torch.testing.assert_close(y_scale.squeeze(1), x.abs().amax(-1) / fmax)


def test_a_static_scale_saturates_and_keeps_nan():
    x = torch.tensor([[1.0, -1.0, 0.001, float("nan")]]).repeat(1, 4)
    y, y_scale = ditops.quantize_fp8(x, fp8_dtype=E4M3, static_scale=torch.tensor(1e-3))
    assert torch.equal(y_scale, torch.full((1, 1), 1e-3))
    values = y.float()[0, :4]
    assert values[0] == 448 and values[1] == -448 and values[2] == 1 and values[3].isnan()


def test_gelu_tanh_is_diffusers_gelu():
    x = torch.randn(6, 64) * 3
    y, y_scale = ditops.quantize_fp8(x, activation="gelu_tanh", fp8_dtype=E4M3)
    expected = torch.nn.functional.gelu(x, approximate="tanh")
    assert ((y.float() * y_scale - expected).abs() <= 2 ** -4 * expected.abs() + y_scale * 2 ** -9).all()


def test_a_prefix_is_quantised_with_x_as_one_row_and_takes_no_activation():
    """quantize_fp8(x, prefix=p): the rows of cat([p, act(x)], -1), one scale per row over both
    (FLUX's single block: attention output, then its GELU MLP hidden state), in x's leading dims."""
    generator = torch.Generator().manual_seed(4)
    x, prefix = torch.randn(2, 5, 48, generator=generator) * 3, torch.randn(2, 5, 16, generator=generator) * 5
    y, y_scale = ditops.quantize_fp8(x, prefix=prefix, fp8_dtype=E4M3)
    joined, joined_scale = ditops.quantize_fp8(torch.cat([prefix, x], -1), fp8_dtype=E4M3)
    assert torch.equal(y.view(torch.uint8), joined.view(torch.uint8)) and torch.equal(y_scale, joined_scale)
    y, y_scale = ditops.quantize_fp8(x, activation="gelu_tanh", prefix=prefix, fp8_dtype=E4M3)
    expected = torch.cat([prefix, torch.nn.functional.gelu(x, approximate="tanh")], -1)
    assert y.shape == (2, 5, 64) and y_scale.shape == (2, 5, 1)
    assert ((y.float() * y_scale - expected).abs() <= 2 ** -4 * expected.abs() + y_scale * 2 ** -9).all()
    torch.testing.assert_close(y_scale, expected.abs().amax(-1, keepdim=True) / 448)


def test_a_prefix_alone_is_quantised_where_x_has_no_values():
    prefix = torch.randn(3, 24)
    y, y_scale = ditops.quantize_fp8(torch.randn(3, 0), activation="gelu_tanh", prefix=prefix, fp8_dtype=E4M3)
    expected, expected_scale = ditops.quantize_fp8(prefix, fp8_dtype=E4M3)
    assert torch.equal(y.view(torch.uint8), expected.view(torch.uint8)) and torch.equal(y_scale, expected_scale)


@pytest.mark.parametrize("prefix, named", [
    (torch.randn(2, 3, 16), r"prefix has shape \[2, 3, 16\]; wanted x's leading dims and any width P, \[2, P\]"),
    (torch.randn(3, 16), r"prefix has shape \[3, 16\]; wanted x's leading dims"),
    (torch.randn(2, 16, dtype=torch.bfloat16), "prefix has dtype bfloat16; wanted the dtype of x, float32"),
    (torch.randn(2, 16, device="meta"), "prefix is on meta; wanted the device of the first activation argument, cpu"),
    ([[1.0] * 16] * 2, "prefix is a list; wanted a torch.Tensor"),
])
def test_a_bad_prefix_is_named(prefix, named):
    with pytest.raises(ValueError, match=named):
        ditops.quantize_fp8(torch.randn(2, 32), prefix=prefix, fp8_dtype=E4M3)


def test_the_kernels_take_a_prefix_by_its_width_and_x_s():
    """cuda and rocm move a row in chunks of 8 values: P and D must each be a multiple of 8, so
    that no chunk straddles the two parts (Triton takes any widths); P + D is the row's width
    for every kernel's size limit."""
    x = torch.randn(4, 1000, dtype=torch.bfloat16)  # refusals(P, D) reads x[:, :D]
    backends = dispatch.dispatcher().registry.backends
    for arch, backend in (("sm_90", "cuda"), ("gfx942", "rocm")):
        if backends[backend].refusal(dispatch.parse_arch(arch)):  # not installed here (hip-python): refused for that
            continue
        with simulated_device(arch):
            fp8_dtype = ditops.fp8_dtypes("cpu")[0]

            def refusals(prefix_width, hidden=1000):
                prefix = torch.randn(4, prefix_width, dtype=torch.bfloat16)
                explanation = ditops.explain("quantize_fp8", x[:, :hidden], prefix=prefix, fp8_dtype=fp8_dtype)
                return {row.backend: row.refusal for row in explanation.candidates}

            assert "needs P and D to be multiples of 8, got P=333, D=1000" in refusals(333)[backend]
            assert "got P=64, D=999" in refusals(64, 999)[backend]
            assert refusals(333)["triton"] is None and refusals(3072)["triton"] is None
            wide = refusals(16384, 8)  # Triton's rows go to 32768 (FLUX.2's), the compiled kernels' to 16384
            assert wide["triton"] is None and "supports P + D <= 16384, got P + D = 16384 + 8" in wide[backend]
            assert refusals(32768, 8)["triton"] == "supports P + D <= 32768, got P + D = 32768 + 8"


def test_the_format_defaults_to_the_devices():
    x = torch.randn(2, 32)
    assert ditops.quantize_fp8(x)[0].dtype == torch.float8_e4m3fn  # the CPU: the first format listed
    assert ditops.fp8_dtypes("cpu") == (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
    with simulated_device("gfx942"):
        assert ditops.fp8_dtypes("cpu") == (torch.float8_e4m3fnuz,)
        assert ditops.quantize_fp8(x, backend="reference")[0].dtype == torch.float8_e4m3fnuz


@pytest.mark.parametrize("arguments, named", [
    (dict(fp8_dtype=torch.float16), "fp8_dtype is torch.float16; wanted one of torch.float8_e4m3fn"),
    (dict(static_scale=torch.ones(2)), "static_scale has shape [2]"),
    (dict(static_scale=torch.ones((), dtype=torch.bfloat16)), "static_scale has dtype bfloat16"),
    (dict(activation="gelu"), "activation is 'gelu'"),
])
def test_bad_fp8_arguments_are_named(arguments, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        ditops.quantize_fp8(torch.randn(2, 32), **arguments)


def test_a_device_without_fp8_is_refused_by_name():
    x = torch.randn(2, 32)
    with simulated_device("sm_80"):
        with pytest.raises(ValueError, match=r"fp8_dtype is None on cuda sm_80 .*, which has no FP8 format; wanted an "
                                             r"FP8 dtype to compute on the reference"):
            ditops.quantize_fp8(x)
        explanation = ditops.explain("quantize_fp8", x, fp8_dtype=E4M3)  # the reference computes it; the kernel refuses
        assert explanation.selected == "reference"
        refusal = {row.backend: row.refusal for row in explanation.candidates}["triton"]
        assert refusal == "needs a GPU with hardware float8_e4m3fn (fp8_formats), not sm_80"
        with pytest.raises(ValueError, match=r"fp8: device .* multiplies in FP8 formats: none"):
            fp8.check_device(x.device)
    with simulated_device("gfx942"):
        with pytest.raises(ValueError, match="float8_e4m3fnuz"):
            fp8.check_device(x.device, torch.float8_e4m3fn)


def _linear(in_features, out_features, bias=True):
    torch.manual_seed(5)
    return torch.nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)


def test_float8_linear_is_the_dequantised_product():
    linear = _linear(64, 48)
    layer = Float8Linear(linear, E4M3)
    assert layer.weight.dtype == E4M3 and layer.weight_scale.shape == (1, 48)
    rows = Float8Rows(*ditops.quantize_fp8(torch.randn(3, 7, 64, dtype=torch.bfloat16), fp8_dtype=E4M3))
    expected = (rows.data.double() * rows.scale) @ (layer.weight.double() * layer.weight_scale.t().double()).t()
    expected = expected + linear.bias.double()
    torch.testing.assert_close(layer(rows).double(), expected, rtol=1e-2, atol=1e-2)
    assert layer(rows).dtype == torch.bfloat16 and layer(rows).shape == (3, 7, 48)


def test_float8_linear_quantises_a_tensor_itself_and_tracks_the_bf16_linear():
    linear = _linear(64, 32)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    expected = linear(x).float()
    error = (Float8Linear(linear, E4M3)(x).float() - expected).norm() / expected.norm()
    assert 0 < error < 0.08  # two FP8 roundings of half a step at most (1/16 each)


def test_float8_linear_takes_a_tensor_of_any_leading_shape():
    """Rows of a [B, F, H, W, D] tensor (Kandinsky 5's visual Linears) as of [N, D]: the same values."""
    linear = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    fp8_linear = Float8Linear(linear, E4M3)
    x = torch.randn(2, 3, 4, 5, 64, dtype=torch.bfloat16)
    out = fp8_linear(x)
    assert out.shape == (2, 3, 4, 5, 32)
    assert torch.equal(out, fp8_linear(x.reshape(-1, 64)).reshape(2, 3, 4, 5, 32))
    assert torch.equal(out[1, 2], fp8_linear(x[1, 2]))


def test_float8_linear_of_a_concatenation_fed_by_a_prefix_quantisation():
    """FLUX's single-block proj_out: [attention output, GELU(MLP)] quantised by one quantize_fp8,
    never concatenated, gives the Linear of the concatenation."""
    linear = _linear(96, 32)
    attention, hidden = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(4, 64, dtype=torch.bfloat16)
    rows = Float8Rows(*ditops.quantize_fp8(hidden, activation="gelu_tanh", prefix=attention, fp8_dtype=E4M3))
    expected = linear(torch.cat([attention, torch.nn.functional.gelu(hidden, approximate="tanh")], dim=-1)).float()
    error = (Float8Linear(linear, E4M3)(rows).float() - expected).norm() / expected.norm()
    assert 0 < error < 0.08  # two FP8 roundings of half a step at most (1/16 each)


def test_a_linear_whose_sizes_an_fp8_gemm_cannot_take_is_refused():
    with pytest.raises(ValueError, match="24 -> 32; wanted both multiples of 16"):
        Float8Linear(_linear(24, 32), E4M3)


def test_fp8_under_torch_compile_matches_eager():
    layer = Float8Linear(_linear(64, 32), E4M3)
    x, modulation = torch.randn(2, 9, 64, dtype=torch.bfloat16), _modulation()

    def block(x):
        return layer(Float8Rows(*ditops.norm_scale_shift_fp8(x, modulation[:, 1], modulation[:, 0])))

    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    assert torch.equal(compiled(x), block(x))


# apply(model, quantize="fp8") on tiny diffusers models


diffusers = pytest.importorskip("diffusers")
from fp8_checks import FP8_OPS, TINY, fed_and_own_input, in_graph_and_matches_eager, state_copy  # noqa: E402
from model_runs import block_call, recorded_calls, run  # noqa: E402
from tiny_models import in_dtype, tiny_cosmos, tiny_flux, tiny_qwen, tiny_wan, z_image_noise_mask_call  # noqa: E402

from ditops.integrations import diffusers as integration  # noqa: E402

BF16_REASONS = ("wanted both multiples of 16", "an embedder", "context-parallel plan")


@pytest.mark.parametrize("name", TINY)
def test_apply_fp8_runs_every_linear_it_can_in_fp8_and_remove_restores_the_bf16_model(name, monkeypatch):
    model, inputs, _ = TINY[name](torch.bfloat16)
    linears = [path for path, module in model.named_modules() if type(module) is torch.nn.Linear]
    before, expected = state_copy(model), run(model, inputs)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    listed = dict(report.linears)
    assert sorted(listed) == sorted(linears)  # every Linear, once
    for path, kind in listed.items():
        module = model.get_submodule(path)
        assert kind.startswith("fp8") == isinstance(module, Float8Linear), (path, kind)
        assert kind.startswith("fp8") or any(reason in kind for reason in BF16_REASONS), (path, kind)
    assert sum(kind.startswith("fp8") for kind in listed.values()) >= len(linears) // 2
    patched = run(model, inputs)
    assert calls and set(calls) <= set(FP8_OPS)
    error = ((patched - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.15, error  # FP8 GEMMs on random weights; benchmarks/fp8.py compares with torchao
    integration.remove(model)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[key], before[key]) for key in before)
    assert torch.equal(run(model, inputs), expected)


def test_z_image_noise_mask_blocks_feed_fp8_rows_with_per_token_modulation(monkeypatch):
    model, _, _ = TINY["z-image"](torch.bfloat16)
    call = z_image_noise_mask_call(model, torch.bfloat16)
    expected = call()
    integration.apply(model, quantize="fp8")
    calls = recorded_calls(monkeypatch, FP8_OPS)
    patched = call()
    assert {"norm_scale_shift_fp8", "add_gate_norm_scale_fp8"} <= set(calls)
    error = ((patched - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.15, error  # FP8 GEMMs on random weights


def test_flux_norms_feed_their_projections_fp8_rows(monkeypatch):
    model, inputs, _ = tiny_flux(torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    ops = {op for _, op in report.replaced}
    assert {"norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "quantize_fp8 (GELU)"} <= ops
    run(model, inputs)
    # per double block: 2 norms, 2 residual norms, 2 MLP GELUs, 2 attention outputs; per single
    # block: its norm, its attention and MLP parts; 2 of each kind of block
    assert calls.count("norm_scale_shift_fp8") == 2 * 2 + 2
    assert calls.count("residual_norm_scale_shift_fp8") == 2 * 2
    fed = [path for path, kind in report.linears if kind.startswith("fp8") and "own input" not in kind]
    assert "transformer_blocks.0.attn.to_q" in fed and "single_transformer_blocks.1.proj_mlp" in fed
    assert "transformer_blocks.0.norm1.linear" not in fed  # its input is silu(temb), no op's output


def test_flux2_norms_feed_their_projections_fp8_rows(monkeypatch):
    """FLUX.2: q/k/v of both streams (one GEMM each), the SwiGLU MLPs' linear_in and the single
    blocks' fused qkv + MLP projection take the norms' FP8 rows; what follows SwiGLU and the
    single blocks' output projection quantise their own input."""
    model, inputs, _ = TINY["flux2"](torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    assert calls.count("norm_scale_shift_fp8") == 2 * 2 + 2
    assert calls.count("residual_norm_scale_shift_fp8") == 2 * 2
    kinds = dict(report.linears)
    fed = {path for path, kind in kinds.items() if kind.startswith("fp8") and "own input" not in kind}
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_v_proj", "transformer_blocks.0.ff.linear_in",
            "transformer_blocks.1.ff_context.linear_in", "single_transformer_blocks.1.attn.to_qkv_mlp_proj"} <= fed
    assert "own input" in kinds["transformer_blocks.0.ff.linear_out"]
    assert "own input" in kinds["single_transformer_blocks.0.attn.to_out"]
    joined = {path for path, kind in report.replaced if kind.startswith("one FP8 GEMM")}
    assert {"transformer_blocks.0.attn.to_qkv", "transformer_blocks.0.attn.to_added_qkv"} <= joined


@pytest.mark.parametrize("name", ["hunyuan-video", "hunyuan-video-1.5"])
def test_hunyuan_video_norms_feed_their_projections_fp8_rows(name, monkeypatch):
    """The double blocks' norms feed q/k/v of both streams and the GELU MLPs (GELU + quantisation
    in one quantize_fp8); a single block's norm feeds proj_mlp and q/k/v (its video and text
    rows sliced as diffusers slices them), and its proj_out input is one quantize_fp8 (1.5 has
    no single blocks)."""
    model, inputs, _ = TINY[name](torch.bfloat16)
    singles = len(getattr(model, "single_transformer_blocks", None) or [])
    assert singles == (2 if name == "hunyuan-video" else 0)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    assert calls.count("norm_scale_shift_fp8") == 2 * 2 + singles
    assert calls.count("residual_norm_scale_shift_fp8") == 2 * 2
    fed, own_input = fed_and_own_input(report)
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_v_proj", "transformer_blocks.0.ff.net.0.proj",
            "transformer_blocks.1.ff_context.net.2"} <= fed
    for index in range(singles):
        block = f"single_transformer_blocks.{index}"
        assert {f"{block}.attn.to_q", f"{block}.attn.to_v", f"{block}.proj_mlp", f"{block}.proj_out"} <= fed
        assert f"{block}.norm.linear" in own_input
        assert (f"{block}.act_mlp, {block}.proj_out", "quantize_fp8 (attention; GELU)") in report.replaced
    assert not any("bf16" in line for line in report.skipped)


@pytest.mark.parametrize("name", ["hunyuan-video", "bria-fibo"])
def test_compiled_fed_single_block_is_one_graph_and_matches_eager(name):
    model, inputs, _ = TINY[name](torch.bfloat16)
    integration.apply(model, quantize="fp8")
    block = model.single_transformer_blocks[0]
    arguments, keywords = block_call(model, inputs, block)
    in_graph_and_matches_eager(block, arguments, keywords, ("norm_scale_shift_fp8", "quantize_fp8", "qk_norm_rope_"))


FP8_BLOCK_OPS = {"hunyuan-video": ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "quantize_fp8", "qk_norm_rope_"),
                 "hunyuan-video-1.5": ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "quantize_fp8",
                                       "qk_norm_rope_"),
                 "sd3": ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "quantize_fp8"),
                 "sd3.5": ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "quantize_fp8", "norm_scale_shift"),
                 "lumina2": ("norm_scale_shift_fp8", "add_gate_norm_scale_fp8", "qk_norm_rope_", "add_gate_norm"),
                 "cosmos": ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "residual_norm_scale_shift",
                            "qk_norm_rope_"),
                 "kandinsky5": ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "residual_norm_scale_shift",
                                "qk_norm_rope_"),
                 "helios": ("norm_scale_shift_fp8", "residual_norm_scale_shift", "quantize_fp8", "qk_norm_rope_"),
                 "minimax-h3": ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "qk_norm_rope_")}


@pytest.mark.parametrize("name", FP8_BLOCK_OPS)
def test_compiled_fp8_block_is_one_graph_and_matches_eager(name):
    """A block with FP8 norms under torch.compile(fullgraph=True), where the whole model has
    graph breaks of diffusers' own (HunyuanVideo 1.5's, without ditops, two) or is tested as
    blocks (SD3.5, Lumina2, Kandinsky 5's visual blocks)."""
    model, inputs, _ = TINY[name](torch.bfloat16)
    integration.apply(model, quantize="fp8")
    block = {"lumina2": lambda: model.layers[0], "kandinsky5": lambda: model.visual_transformer_blocks[0],
             "helios": lambda: model.blocks[0]}.get(name, lambda: model.transformer_blocks[0])()
    arguments, keywords = block_call(model, inputs, block)
    with torch.no_grad():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(block)(*arguments, **keywords)
        assert explained.graph_break_count == 0 and len(explained.graphs) == 1
        for op in FP8_BLOCK_OPS[name]:
            assert f"torch.ops.ditops.{op}(" in explained.graphs[0].code, op
        eager = block(*arguments, **keywords)
        compiled = torch.compile(block, fullgraph=True)(*arguments, **keywords)
    for got, want in zip(compiled, eager):
        assert (got.float() - want.float()).norm() / want.float().norm() < 0.05


@pytest.mark.parametrize("name", ["sd3", "sd3.5"])
def test_sd3_norms_feed_the_attentions_and_the_mlps_fp8_rows(name, monkeypatch):
    """The AdaLN norms feed q/k/v of both streams (and SD3.5's second attention), the residual
    norms the GELU MLPs (GELU + quantisation one quantize_fp8); SD3's q/k/v, with no q/k norm
    after them, are one GEMM per stream; the attention outputs quantise their own input."""
    model, inputs, _ = TINY[name](torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    # norm1 (SD3.5's first block: modulated twice, for its two attentions) and norm1_context in
    # both blocks; residual norms: block 0's two streams, block 1's image stream (its text ends)
    assert calls.count("norm_scale_shift_fp8") == (5 if name == "sd3.5" else 4)
    assert calls.count("residual_norm_scale_shift_fp8") == 3
    fed, own_input = fed_and_own_input(report)
    assert {"transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_v_proj", "transformer_blocks.1.attn.add_k_proj",
            "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.ff_context.net.2"} <= fed
    assert {"transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.to_add_out"} <= own_input
    joined = {path for path, kind in report.replaced if kind.startswith("one FP8 GEMM")}
    if name == "sd3.5":
        assert "transformer_blocks.0.attn2.to_k" in fed and not joined
    else:
        assert joined == {f"transformer_blocks.{index}.attn.{joint}" for index in range(2)
                          for joint in ("to_qkv", "to_added_qkv")}
    assert not any("bf16" in line for line in report.skipped)


@pytest.mark.parametrize("name", ["sd3", "sd3.5"])
def test_sd3_processor_on_fp8_rows_computes_what_it_computes_on_tensors(name):
    """SD3JointProcessor on FP8 rows of both streams against itself on the tensors they stand for,
    and for SD3 (no q/k norm of ditops') against diffusers' processor on those tensors: the FP8
    Linears quantise the tensors again, which may round a value the other way. SD3.5's norms
    against diffusers' are the bf16 coverage tests'."""
    from ditops.integrations.diffusers import sd3

    model, _, _ = TINY[name](torch.bfloat16)
    integration.apply(model, quantize="fp8")
    attn = model.transformer_blocks[0].attn
    assert type(attn.processor) is sd3.SD3JointProcessor
    generator = torch.Generator().manual_seed(7)
    rows = [Float8Rows(*ditops.quantize_fp8(torch.randn(2, tokens, 32, generator=generator, dtype=torch.bfloat16) * 3))
            for tokens in (16, 5)]
    tensors = [part.dequantize(torch.bfloat16) for part in rows]
    with torch.no_grad():
        got = attn.processor(attn, *rows)
        references = [attn.processor(attn, *tensors)] + ([attn.processor.defer(attn, *tensors)] if name == "sd3" else [])
    for expected in references:
        for got_stream, expected_stream in zip(got, expected, strict=True):
            assert got_stream.shape == expected_stream.shape
            error = (got_stream.float() - expected_stream.float()).norm() / expected_stream.float().norm()
            assert error < 0.01, error.item()


# FP8 rows from every norm, per double block (2 norms, 2 residual norms) and single block (its
# norm): the blocks compute FLUX's math with ditops' attention processor (FIBO's single blocks
# on diffusers' generic Attention).
FLUX_COPIES = ("chroma", "longcat-image", "bria", "ovis-image", "bria-fibo")


@pytest.mark.parametrize("name", FLUX_COPIES)
def test_chroma_and_the_flux_copies_norms_feed_their_projections_fp8_rows(name, monkeypatch):
    model, inputs, _ = TINY[name](torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    assert calls.count("norm_scale_shift_fp8") == 2 * 2 + 2, str(report)
    assert calls.count("residual_norm_scale_shift_fp8") == 2 * 2
    fed, own_input = fed_and_own_input(report)
    assert {"transformer_blocks.0.attn.to_q", "single_transformer_blocks.1.proj_mlp",
            "single_transformer_blocks.1.attn.to_v"} <= fed
    if name == "ovis-image":  # SwiGLU: the rows reach the up projections; the rest quantises its own input
        assert {"transformer_blocks.0.ff.net.0.proj", "transformer_blocks.1.ff_context.net.0.proj"} <= fed
        assert {"transformer_blocks.0.ff.net.2", "single_transformer_blocks.1.proj_out"} <= own_input
    else:  # proj_out's input is one quantize_fp8 of [attention, GELU(MLP)]
        assert "single_transformer_blocks.1.proj_out" in fed
        assert ("single_transformer_blocks.1.act_mlp, single_transformer_blocks.1.proj_out",
                "quantize_fp8 (attention; GELU)") in report.replaced
    assert not any("bf16" in entry for entry in report.skipped), report.skipped


def test_flux_projections_fed_the_same_rows_are_one_gemm_and_remove_unjoins_them():
    model, inputs, _ = tiny_flux(torch.bfloat16)
    expected = run(model, inputs)
    report = integration.apply(model, quantize="fp8")
    joined = {path: kind for path, kind in report.replaced if kind.startswith("one FP8 GEMM")}
    assert joined["transformer_blocks.0.attn.to_qkv"] == "one FP8 GEMM for to_q, to_k, to_v"
    assert "transformer_blocks.1.attn.to_added_qkv" in joined and "single_transformer_blocks.0.attn.to_qkv" in joined
    attention = model.transformer_blocks[0].attn
    assert attention.fused_projections
    joint = attention.to_qkv.weight
    for position, name in enumerate(("to_q", "to_k", "to_v")):  # views of the joint weight: held once
        part = getattr(attention, name).weight
        assert part.untyped_storage().data_ptr() == joint.untyped_storage().data_ptr()
        assert part.data_ptr() == joint[position * part.shape[0]:].data_ptr()
    error = ((run(model, inputs) - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.15, error
    integration.remove(model)
    assert not attention.fused_projections and not hasattr(attention, "to_qkv")
    assert torch.equal(run(model, inputs), expected)


def test_projections_one_gemm_cannot_serve_stay_separate_and_are_reported():
    model, inputs, _ = tiny_flux(torch.bfloat16)
    model.transformer_blocks[0].attn.to_k.bias = None  # a bias on q and v only
    expected = run(model, inputs)
    report = integration.apply(model, quantize="fp8")
    assert any(line.startswith("transformer_blocks.0.attn: its projections stay separate GEMMs") for line in report.skipped)
    first, second = model.transformer_blocks[0].attn, model.transformer_blocks[1].attn
    assert not first.fused_projections and not hasattr(first, "to_qkv") and not hasattr(first, "to_added_qkv")
    assert second.fused_projections and hasattr(second, "to_qkv") and hasattr(second, "to_added_qkv")
    error = ((run(model, inputs) - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.15, error


def test_a_flux_model_with_its_own_fused_projections_keeps_them_and_runs_fp8():
    model, inputs, _ = tiny_flux(torch.bfloat16)
    model.fuse_qkv_projections()
    expected = run(model, inputs)
    report = integration.apply(model, quantize="fp8")
    assert not any(kind.startswith("one FP8 GEMM") for _, kind in report.replaced)
    assert isinstance(model.transformer_blocks[0].attn.to_qkv, Float8Linear)
    error = ((run(model, inputs) - expected).norm() / expected.norm()).item()
    assert 0 < error < 0.15, error
    integration.remove(model)
    assert torch.equal(run(model, inputs), expected)


@pytest.mark.parametrize("name", ["flux", "chroma", "flux2"])
def test_compiled_fp8_flux_has_no_graph_break_and_matches_eager(name):
    model, inputs, _ = TINY[name](torch.bfloat16)
    integration.apply(model, quantize="fp8")
    eager = run(model, inputs)
    with torch.no_grad():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(**inputs)
        assert explained.graph_break_count == 0
        code = "".join(graph.code for graph in explained.graphs)
        for op in ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "quantize_fp8"):  # FLUX's (FLUX.2: SwiGLU's)
            assert f"torch.ops.ditops.{op}(" in code
        compiled = torch.compile(model, fullgraph=True)(**inputs).sample.float()
    # bf16 rounding differs between Inductor's code and eager; FP8 rounding may amplify a
    # difference of one bf16 ulp to one FP8 step on a few values
    assert (compiled - eager).norm() / eager.norm() < 0.05


def test_quantize_must_be_fp8_or_none():
    model, _, _ = tiny_flux(torch.bfloat16)
    with pytest.raises(ValueError, match="quantize is 'int8'"):
        integration.apply(model, quantize="int8")
    assert getattr(model, "_ditops_patches", None) is None


def test_a_gpu_without_fp8_refuses_quantize_before_patching_anything():
    model, _, _ = tiny_flux(torch.bfloat16)
    with simulated_device("sm_80"), warnings.catch_warnings():
        with pytest.raises(ValueError, match="multiplies in FP8 formats: none"):
            integration.apply(model, quantize="fp8")
    assert getattr(model, "_ditops_patches", None) is None


@pytest.mark.parametrize("edit", [False, True], ids=["qwen-image", "qwen-image-edit"])
def test_qwen_image_norms_feed_their_projections_fp8_rows(edit, monkeypatch):
    """Qwen-Image: both streams' norms give FP8 rows; Qwen-Image-Edit's image stream through the
    select forms."""
    model, inputs, _ = tiny_qwen(torch.bfloat16, edit=edit)
    expected = run(model, inputs)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    integration.apply(model, quantize="fp8")
    patched = run(model, inputs)
    blocks = 2
    assert calls.count("norm_scale_shift_fp8") == blocks * (1 if edit else 2)
    assert calls.count("residual_norm_scale_shift_fp8") == blocks * (1 if edit else 2)
    assert calls.count("norm_scale_shift_select_fp8") == calls.count("residual_norm_scale_shift_select_fp8") == (
        blocks if edit else 0)
    assert 0 < (patched - expected).norm() / expected.norm() < 0.15


def test_wan_norms_feed_self_attention_and_ffn_fp8_rows(monkeypatch):
    model, inputs, _ = tiny_wan(torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    blocks = 2
    assert calls.count("norm_scale_shift_fp8") == blocks  # norm1 -> q/k/v
    assert calls.count("residual_norm_scale_shift_fp8") == blocks  # norm3 -> the FFN
    assert ("blocks.0.ffn", "quantize_fp8 (GELU)") in report.replaced


def test_helios_norms_feed_self_attention_and_ffn_fp8_rows(monkeypatch):
    """As Wan's; with history tokens before the video, norm3 is a norm_scale_shift_fp8 after the
    video tokens' cross-attention residual."""
    model, inputs, _ = TINY["helios"](torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    blocks = 2
    assert calls.count("norm_scale_shift_fp8") == 2 * blocks  # norm1 -> q/k/v, norm3 -> the FFN
    assert calls.count("residual_norm_scale_shift_fp8") == 0
    fed, own_input = fed_and_own_input(report)
    assert {"blocks.1.attn1.to_q", "blocks.1.attn1.to_v", "blocks.1.ffn.net.0.proj", "blocks.1.ffn.net.2"} <= fed
    assert {"blocks.1.attn2.to_q", "blocks.1.attn1.to_out.0"} <= own_input
    assert ("blocks.0.ffn", "quantize_fp8 (GELU)") in report.replaced


def test_minimax_h3_norms_feed_attention_and_ffn_fp8_rows(monkeypatch):
    model, inputs, _ = TINY["minimax-h3"](torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    blocks = 2
    assert calls.count("norm_scale_shift_fp8") == calls.count("residual_norm_scale_shift_fp8") == blocks
    fed, own_input = fed_and_own_input(report)
    assert {"transformer_blocks.1.attn.to_q", "transformer_blocks.1.attn.to_v", "transformer_blocks.1.ff.net.0.proj"} <= fed
    assert {"transformer_blocks.1.ff.net.2", "transformer_blocks.1.attn.to_out.0"} <= own_input
    assert ("transformer_blocks.0.attn.to_qkv", "one FP8 GEMM for to_q, to_k, to_v") in report.replaced


def test_z_image_norms_feed_attention_and_ffn_fp8_rows(monkeypatch):
    model, inputs, _ = TINY["z-image"](torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    expected_blocks = [path for path, op in report.replaced if op == "norm_scale_shift_fp8"]
    assert expected_blocks and len(expected_blocks) == sum(op == "add_gate_norm_scale_fp8" for _, op in report.replaced)
    run(model, inputs)
    assert calls.count("norm_scale_shift_fp8") == calls.count("add_gate_norm_scale_fp8") == len(expected_blocks)
    fed = [path for path, kind in report.linears if kind.startswith("fp8") and "own input" not in kind]
    assert "layers.0.attention.to_q" in fed and "layers.0.feed_forward.w3" in fed
    assert "layers.0.feed_forward.w2" not in fed  # its input is the SiLU gating, no op's output


def test_lumina2_norms_feed_attention_and_ffn_fp8_rows(monkeypatch):
    """As Z-Image's: the modulated blocks' (noise refiner, layers) first norm feeds q/k/v, the
    gated norm the SwiGLU FFN's linear_1 and linear_3; the context refiner (no modulation) and
    linear_2 (the SiLU gating's product) quantise their own input."""
    model, inputs, _ = TINY["lumina2"](torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    fused = [path for path, op in report.replaced if op == "norm_scale_shift_fp8"]
    assert fused == ["noise_refiner.0.norm1", "layers.0.norm1", "layers.1.norm1"]
    run(model, inputs)
    assert calls.count("norm_scale_shift_fp8") == calls.count("add_gate_norm_scale_fp8") == len(fused)
    kinds = dict(report.linears)
    for block in ("noise_refiner.0", "layers.1"):
        for linear in ("attn.to_q", "attn.to_v", "feed_forward.linear_1", "feed_forward.linear_3"):
            assert "own input" not in kinds[f"{block}.{linear}"], (block, linear)
        assert "own input" in kinds[f"{block}.feed_forward.linear_2"] and "own input" in kinds[f"{block}.attn.to_out.0"]
    assert "own input" in kinds["context_refiner.0.attn.to_q"]


@pytest.mark.parametrize("name", ["cosmos", "cosmos-2.5"])
def test_cosmos_norm1_and_norm3_feed_the_self_attention_and_ffn_fp8_rows(name, monkeypatch):
    """norm1 feeds attn1's q/k/v, norm3 the FFN's up projection (exact GELU after it: the down
    projection quantises its own input); norm2 feeds the cross-attention, diffusers' processor, bf16."""
    model, inputs, _ = (TINY["cosmos"] if name == "cosmos" else in_dtype(lambda: tiny_cosmos(True)))(
        torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    run(model, inputs)
    assert calls.count("norm_scale_shift_fp8") == calls.count("residual_norm_scale_shift_fp8") == 2
    kinds = dict(report.linears)
    for linear in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "ff.net.0.proj"):
        assert "own input" not in kinds[f"transformer_blocks.1.{linear}"], linear
    for linear in ("attn1.to_out.0", "attn2.to_q", "attn2.to_k", "ff.net.2"):
        assert "own input" in kinds[f"transformer_blocks.1.{linear}"], linear
    assert ("transformer_blocks.0.norm2", "residual_norm_scale_shift") in report.replaced


def test_kandinsky5_norms_feed_the_self_attentions_and_ffns_fp8_rows(monkeypatch):
    """Text and visual blocks: the first norm feeds q/k/v, feed_forward_norm the FFN's in_layer
    (exact GELU after it: out_layer quantises its own input); the visual blocks'
    cross_attention_norm feeds diffusers' cross-attention bf16."""
    model, inputs, _ = TINY["kandinsky5"](torch.bfloat16)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    patched = run(model, inputs)
    assert calls.count("norm_scale_shift_fp8") == calls.count("residual_norm_scale_shift_fp8") == 4
    # a hooked q norm sends the call to diffusers' processor, which gets the rows as tensors
    # (its attention names its projections to_query, not to_q)
    model.visual_transformer_blocks[0].self_attention.query_norm.register_forward_hook(lambda *_: None)
    with pytest.warns(UserWarning, match="hook"):
        deferred = run(model, inputs)
    assert ((deferred - patched).norm() / patched.norm()).item() < 0.05
    kinds = dict(report.linears)
    for block in ("text_transformer_blocks.1", "visual_transformer_blocks.0"):
        for linear in ("self_attention.to_query", "self_attention.to_value", "feed_forward.in_layer"):
            assert "own input" not in kinds[f"{block}.{linear}"], (block, linear)
        assert "own input" in kinds[f"{block}.feed_forward.out_layer"]
    assert "own input" in kinds["visual_transformer_blocks.0.cross_attention.to_query"]
    assert ("visual_transformer_blocks.1.cross_attention_norm", "residual_norm_scale_shift") in report.replaced


def test_a_processor_that_defers_to_diffusers_gets_a_tensor_from_fp8_rows():
    """Wan's ditops processor hands calls it does not cover (here: a rotary table per batch
    item) to diffusers' processor, which takes a tensor: FP8 rows are dequantised for it."""
    model, inputs, _ = tiny_wan(torch.bfloat16)
    model.rope.register_forward_hook(lambda module, arguments, tables: tuple(t.expand(2, *t.shape[1:]) for t in tables))
    expected = run(model, inputs)
    integration.apply(model, quantize="fp8")
    processor = model.blocks[0].attn1.processor
    original, seen = processor.original, []
    processor.original = lambda attn, hidden_states, *rest: seen.append(type(hidden_states)) or original(attn, hidden_states, *rest)
    patched = run(model, inputs)
    assert seen == [torch.Tensor]  # block 0's self-attention, deferred once
    assert 0 < (patched - expected).norm() / expected.norm() < 0.15


def test_a_linear_with_a_hook_and_the_context_parallel_plans_projection_stay_bf16():
    """A replacement module would not carry a hook (an offload hook, a context-parallel
    gather), and enable_parallelism hooks the plan's modules by name in either order."""
    model, inputs, _ = tiny_flux(torch.bfloat16)
    seen = []
    model.transformer_blocks[0].attn.to_out[0].register_forward_hook(lambda *arguments: seen.append(True))
    report = dict(integration.apply(model, quantize="fp8").linears)
    assert report["transformer_blocks.0.attn.to_out.0"] == "bf16: it has a torch forward hook, which a replacement would drop"
    assert report["proj_out"] == "bf16: named in the model's context-parallel plan (_cp_plan)"
    run(model, inputs)
    assert seen


HOOKED_FED_LINEAR = {  # a Linear that a norm would feed FP8 rows, in the first block of each family
    "flux": ("transformer_blocks.0.attn.to_q", "transformer_blocks.0"),
    "qwen-image": ("transformer_blocks.0.img_mlp.net.0.proj", "transformer_blocks.0"),
    "wan": ("blocks.0.ffn.net.2", "blocks.0"),
    "z-image": ("layers.0.feed_forward.w1", "layers.0"),
}


@pytest.mark.parametrize("name", HOOKED_FED_LINEAR)
def test_a_hook_on_a_fed_linear_keeps_its_blocks_norms_bf16(name, monkeypatch):
    """FP8 rows must never reach a bf16 Linear: where one the norms feed cannot be replaced (a
    hook on it), none of the block's are, and its norms give bf16; the other blocks keep FP8 rows."""
    model, inputs, _ = TINY[name](torch.bfloat16)
    linear, block = HOOKED_FED_LINEAR[name]
    seen = []
    model.get_submodule(linear).register_forward_hook(lambda *arguments: seen.append(True))
    expected = run(model, inputs)
    calls = recorded_calls(monkeypatch, FP8_OPS)
    report = integration.apply(model, quantize="fp8")
    assert any(line.startswith(f"{block}: its norms give bf16") and linear in line for line in report.skipped)
    assert dict(report.linears)[linear].startswith("bf16: it has a torch forward hook")
    assert not any(path.startswith(block + ".") and op.endswith("_fp8") for path, op in report.replaced)
    assert any(op.startswith("norm_scale_shift_fp8") for _, op in report.replaced)  # the other block
    seen.clear()
    patched = run(model, inputs)
    assert seen and "norm_scale_shift_fp8" in calls
    assert 0 < (patched - expected).norm() / expected.norm() < 0.15


def test_a_processor_that_is_not_ditops_keeps_the_norms_bf16():
    """diffusers' own processor takes tensors: a block whose attention ditops does not patch
    gets no FP8 rows."""
    model, inputs, _ = tiny_flux(torch.bfloat16)
    model.transformer_blocks[0].attn.norm_q.eps = 1e-3  # q/k norms of other eps: ditops leaves the processor
    report = integration.apply(model, quantize="fp8")
    assert "transformer_blocks.0: its norms give bf16 (the attention processor is not ditops')" in report.skipped
    run(model, inputs)


def test_apply_again_with_another_quantize_asks_for_remove_first():
    model, inputs, _ = tiny_flux(torch.bfloat16)
    report = integration.apply(model)
    assert integration.apply(model) is report
    with pytest.raises(ValueError, match="quantize is 'fp8', but the model is patched with quantize=None; wanted remove"):
        integration.apply(model, quantize="fp8")
    integration.remove(model)
    assert integration.apply(model, quantize="fp8").linears


# The Triton FP8 kernels in Triton's interpreter. The interpreter converts float32 to FP8
# wrongly, so the conformance suite checks these kernels on the GPU only; here each kernel
# writes its values into a float32 y (the cast to y's type is then no cast at all) with the
# format's range, so everything but the final rounding is checked on every CI run.

import os  # noqa: E402

from ditops import conformance  # noqa: E402
from ditops.backends import triton as triton_backend  # noqa: E402
from ditops.backends.triton.kernel_launch import run as run_launch  # noqa: E402
from ditops.ops import OPS, ordered_arguments  # noqa: E402

FP8_CASES = [case for case in conformance.CASES if conformance.SPECS[case.op].quantized]


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton's interpreter on the CPU (on a GPU the conformance suite checks the FP8 values)")
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda case: case.id)
def test_triton_fp8_kernels_before_the_final_rounding(case):
    arguments = case.arguments(torch.float32, "cpu")
    ordered, _ = ordered_arguments(case.op, **arguments)
    if OPS[case.op].check(*ordered) is None:
        pytest.skip("empty input: nothing is launched")
    outputs = list(OPS[case.op].outputs(*ordered))
    fp8_dtype = outputs[0].dtype
    outputs[0] = torch.full(outputs[0].shape, float("nan"))
    outputs[1].fill_(float("nan"))
    with simulated_device("sm_90"):
        launch = getattr(triton_backend, case.op + "_launch")(*ordered, *outputs)
        run_launch(launch._replace(constexprs=dict(launch.constexprs, FP8_MAX=float(torch.finfo(fp8_dtype).max))))
    expected = conformance.oracle(case.op, arguments, torch.float32)
    fmax = torch.finfo(fp8_dtype).max
    values, scales = outputs[0].double(), outputs[1].double()
    assert torch.equal(values.isnan(), expected[0].isnan()) and torch.equal(scales.isnan(), expected[1].isnan())
    assert ((values - expected[0]).abs().nan_to_num(0) <= 1e-5 * fmax).all()
    torch.testing.assert_close(scales, expected[1], rtol=1e-5, atol=0, equal_nan=True)
    for output, wanted in zip(outputs[2:], expected[2:]):  # residual_out
        torch.testing.assert_close(output.double(), wanted, rtol=1e-5, atol=1e-5, equal_nan=True)

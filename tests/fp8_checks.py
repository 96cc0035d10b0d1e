"""What the tests of ``apply(model, quantize="fp8")`` share: the FP8 ops, the tiny models they
quantise, and checks of a report and of a compiled FP8 block."""

import torch
from tiny_models import (
    in_dtype,
    tiny_bria,
    tiny_bria_fibo,
    tiny_chroma,
    tiny_cogvideox,
    tiny_cosmos,
    tiny_flux,
    tiny_flux2,
    tiny_helios,
    tiny_hidream,
    tiny_hunyuan_video,
    tiny_hunyuan_video15,
    tiny_kandinsky5,
    tiny_longcat_image,
    tiny_ltx,
    tiny_ltx2,
    tiny_lumina2,
    tiny_minimax_h3,
    tiny_ovis_image,
    tiny_qwen,
    tiny_sd3,
    tiny_wan,
    tiny_z_image,
)

# the ops that give or take FP8 rows, as recorded_calls takes them
FP8_OPS = ("norm_scale_shift_fp8", "residual_norm_scale_shift_fp8", "norm_scale_shift_select_fp8",
           "residual_norm_scale_shift_select_fp8", "add_gate_norm_scale_fp8", "quantize_fp8")

# every family the FP8 tests quantise, by name: builders taking the dtype (Z-Image with 3 heads:
# FFN widths an FP8 GEMM takes)
TINY = {
    "flux": tiny_flux, "wan": tiny_wan, "qwen-image": tiny_qwen, "z-image": lambda dtype: tiny_z_image(dtype, heads=3),
    "chroma": in_dtype(tiny_chroma), "longcat-image": in_dtype(tiny_longcat_image),
    "ovis-image": in_dtype(tiny_ovis_image), "bria": in_dtype(tiny_bria), "bria-fibo": in_dtype(tiny_bria_fibo),
    "flux2": in_dtype(tiny_flux2), "hunyuan-video": in_dtype(tiny_hunyuan_video),
    "hunyuan-video-1.5": in_dtype(tiny_hunyuan_video15), "sd3": in_dtype(tiny_sd3),
    "sd3.5": in_dtype(lambda: tiny_sd3(sd35=True)), "lumina2": in_dtype(tiny_lumina2), "cosmos": in_dtype(tiny_cosmos),
    "kandinsky5": in_dtype(tiny_kandinsky5), "hidream": in_dtype(tiny_hidream), "ltx-video": in_dtype(tiny_ltx),
    "ltx-2": in_dtype(tiny_ltx2), "helios": in_dtype(lambda: tiny_helios(amplify_history=False)),
    "minimax-h3": in_dtype(tiny_minimax_h3), "cogvideox": in_dtype(tiny_cogvideox),
}


def state_copy(model) -> dict:
    """A copy of the model's state dict, to check that remove gives it back bit for bit."""
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def fed_and_own_input(report) -> tuple:
    """The report's Linears fed FP8 rows by a norm, and those that quantise their own input."""
    kinds = dict(report.linears)
    fed = {path for path, kind in kinds.items() if kind.startswith("fp8") and "own input" not in kind}
    return fed, {path for path, kind in kinds.items() if "own input" in kind}


def in_graph_and_matches_eager(block, arguments, keywords, ops) -> None:
    """Asserts torch.compile(fullgraph=True) traces `block` as one graph holding the ditops `ops`, close to eager."""
    with torch.no_grad():
        torch._dynamo.reset()
        explained = torch._dynamo.explain(block)(*arguments, **keywords)
        assert explained.graph_break_count == 0 and len(explained.graphs) == 1
        for op in ops:
            assert f"torch.ops.ditops.{op}(" in explained.graphs[0].code, op
        eager = block(*arguments, **keywords)
        compiled = torch.compile(block, fullgraph=True)(*arguments, **keywords)
    eager, compiled = (output if isinstance(output, tuple) else (output,) for output in (eager, compiled))
    assert len(compiled) == len(eager)
    for got, want in zip(compiled, eager):
        assert (got.float() - want.float()).norm() / want.float().norm() < 0.05

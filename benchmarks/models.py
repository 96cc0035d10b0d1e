"""Model-level speed of ditops under diffusers, on the GPU, bf16, random weights (no download).

Blocks at real widths and token counts: one FLUX.1 double block and one single block at
1024px (4096 image + 512 text tokens, width 3072, 24 heads), one Wan2.1-1.3B block at 480p
and 81 frames (32760 tokens), one Qwen-Image block at 1024px (4096 image + 512 text tokens).
Each is built inside a one-layer diffusers model (so that ditops.integrations.diffusers.apply
sees the real classes), fed the inputs the model would give it, and its forward timed four
ways: eager diffusers, eager + ditops, torch.compile of diffusers, torch.compile + ditops
(median of CUDA-event timings after warm-up). The patched output is compared with diffusers'.
Usage: python benchmarks/models.py [--json FILE] [--models flux wan qwen-image]
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings

import torch

from ditops.integrations import diffusers as integration

DTYPE = torch.bfloat16


def time_ms(function, repeats: int = 10) -> float:
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


def flux():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(num_layers=1, num_single_layers=1)  # FLUX.1 widths
    ids = torch.cat([torch.zeros(512, 3), torch.stack(torch.meshgrid(
        torch.zeros(1), torch.arange(64.0), torch.arange(64.0), indexing="ij"), dim=-1).reshape(-1, 3)]).cuda()

    def prepare(model):
        rotary = model.pos_embed(ids)
        inputs = dict(hidden_states=randn(1, 4096, 3072), encoder_hidden_states=randn(1, 512, 3072), temb=randn(1, 3072),
                      image_rotary_emb=rotary)

        def forward():
            context, hidden = model.transformer_blocks[0](**inputs)
            return model.single_transformer_blocks[0](hidden, context, inputs["temb"], rotary)[1]

        return forward
    return model, prepare


def wan():
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                                  text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=1, cross_attn_norm=True)

    def prepare(model):
        latents = randn(1, 16, 21, 60, 104)  # 480x832, 81 frames -> 21 x 30 x 52 = 32760 tokens
        inputs = dict(hidden_states=randn(1, 32760, 1536), encoder_hidden_states=randn(1, 512, 1536),
                      temb=torch.randn(1, 6, 1536, device="cuda", dtype=torch.float32), rotary_emb=model.rope(latents))
        return lambda: model.blocks[0](**inputs)
    return model, prepare


def qwen_image():
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(num_layers=1)  # Qwen-Image widths

    def prepare(model):
        rotary = model.pos_embed([(1, 64, 64)], max_txt_seq_len=512, device="cuda")
        inputs = dict(hidden_states=randn(1, 4096, 3072), encoder_hidden_states=randn(1, 512, 3072),
                      encoder_hidden_states_mask=torch.ones(1, 512, device="cuda", dtype=DTYPE), temb=randn(1, 3072),
                      image_rotary_emb=rotary)
        return lambda: model.transformer_blocks[0](**inputs)[1]
    return model, prepare


MODELS = {"flux": flux, "wan": wan, "qwen-image": qwen_image}


def measure(name: str) -> dict:
    torch.manual_seed(0)
    model, prepare = MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model.to("cuda", DTYPE).eval()
    result = {"model": name}
    with torch.no_grad():
        torch.manual_seed(1)
        forward = prepare(model)
        expected = forward()
        result["eager diffusers ms"] = time_ms(forward)
        torch._dynamo.reset()
        compiled = torch.compile(forward)
        result["torch.compile diffusers ms"] = time_ms(compiled)
        report = integration.apply(model)
        patched = forward()
        result["eager + ditops ms"] = time_ms(forward)
        torch._dynamo.reset()
        compiled = torch.compile(forward)
        result["torch.compile + ditops ms"] = time_ms(compiled)
    difference = patched.float() - expected.float()
    result.update({
        "replaced": [f"{path}: {op}" for path, op in report.replaced],
        "max abs difference": difference.abs().max().item(),
        "relative difference": (difference.norm() / expected.float().norm()).item(),
        "eager speedup": result["eager diffusers ms"] / result["eager + ditops ms"],
        "compile speedup": result["torch.compile diffusers ms"] / result["torch.compile + ditops ms"],
    })
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    arguments = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": str(DTYPE), "models": []}
    for name in arguments.models:
        results["models"].append(measure(name))
        print(json.dumps({k: v for k, v in results["models"][-1].items() if k != "replaced"}), flush=True)
        if arguments.json:
            with open(arguments.json, "w") as file:
                json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()

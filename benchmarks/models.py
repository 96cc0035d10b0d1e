"""Model-level speed of ditops under diffusers, on the GPU, bf16, random weights (no download).

Blocks at real widths and token counts: one FLUX.1 double block and one single block at
1024px (4096 image + 512 text tokens, width 3072, 24 heads), one Wan2.1-1.3B block at 480p
and 81 frames (32760 tokens), one Qwen-Image block at 1024px (4096 image + 512 text tokens),
one Z-Image layer at 1024px (4096 image + 512 text tokens in one stream, width 3840, 30 heads).
Each is built inside a one-layer diffusers model (so that ditops.integrations.diffusers.apply
sees the real classes), fed the inputs the model would give it, and its forward timed four
ways: eager diffusers, eager + ditops, torch.compile of diffusers, torch.compile + ditops
(median of CUDA-event timings after warm-up). The patched output is compared with diffusers'.
With --profile, each of the four ways also runs under torch.profiler and prints per forward:
wall time, GPU kernel time, kernel count, the host time of each ditops op call, and the
kernels that took the most GPU time (where a way loses: host-bound gaps or extra kernels).
Usage: python benchmarks/models.py [--json FILE] [--models flux wan qwen-image z-image] [--profile]
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


def z_image():
    from diffusers import ZImageTransformer2DModel

    model = ZImageTransformer2DModel(n_layers=1, n_refiner_layers=1)  # Z-Image widths: 3840, 30 heads of 128

    def prepare(model):
        text, image = 512, 4096  # 1024px: 64 x 64 patches
        ids = torch.cat([torch.stack([torch.arange(1, text + 1), torch.zeros(text), torch.zeros(text)], dim=1),
                         torch.stack(torch.meshgrid(torch.full((1,), text + 1.0), torch.arange(64.0), torch.arange(64.0),
                                                    indexing="ij"), dim=-1).reshape(-1, 3)]).long().cuda()
        inputs = dict(x=randn(1, text + image, 3840), attn_mask=torch.ones(1, text + image, dtype=torch.bool, device="cuda"),
                      freqs_cis=model.rope_embedder(ids).unsqueeze(0), adaln_input=randn(1, 256))
        return lambda: model.layers[0](**inputs)
    return model, prepare


MODELS = {"flux": flux, "wan": wan, "qwen-image": qwen_image, "z-image": z_image}


def profile(function, label: str, forwards: int = 5) -> None:
    """Prints where one way spends a forward: wall and kernel time, ditops host time per call, top kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    function()
    torch.cuda.synchronize()
    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(forwards):
            function()
        end.record()
        torch.cuda.synchronize()
    events = trace.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / forwards
    count = sum(e.count for e in kernels) / forwards
    print(f"  [{label}] wall {start.elapsed_time(end) / forwards:.3f} ms, kernels {kernel_ms:.3f} ms in {count:.0f} launches")
    for e in events:
        if e.key.startswith("ditops::"):
            print(f"    host {e.key}: {e.cpu_time_total / e.count:.1f} us per call, {e.count // forwards} calls")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"    {e.self_device_time_total / 1e3 / forwards:7.3f} ms {e.count // forwards:3d}x {e.key[:90]}")


def measure(name: str, profiling: bool = False) -> dict:
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
        if profiling:
            print(name, flush=True)
            profile(forward, "eager diffusers")
            profile(compiled, "torch.compile diffusers")
        report = integration.apply(model)
        patched = forward()
        result["eager + ditops ms"] = time_ms(forward)
        torch._dynamo.reset()
        compiled = torch.compile(forward)
        result["torch.compile + ditops ms"] = time_ms(compiled)
        if profiling:
            profile(forward, "eager + ditops")
            profile(compiled, "torch.compile + ditops")
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
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler summary of each way")
    arguments = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": str(DTYPE), "models": []}
    for name in arguments.models:
        results["models"].append(measure(name, arguments.profile))
        print(json.dumps({k: v for k, v in results["models"][-1].items() if k != "replaced"}), flush=True)
        if arguments.json:
            with open(arguments.json, "w") as file:
                json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()

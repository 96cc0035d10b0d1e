"""Model-level speed of ditops under diffusers, on the GPU, bf16, random weights (no download).

Blocks at real widths and token counts: one FLUX.1 double block and one single block at
1024px (4096 image + 512 text tokens, width 3072, 24 heads), one Wan2.1-1.3B block at 480p
and 81 frames (32760 tokens), one Qwen-Image block at 1024px (4096 image + 512 text tokens),
one Z-Image layer at 1024px (4096 image + 512 text tokens in one stream, width 3840, 30 heads).
Each is built inside a one-layer diffusers model (so that ditops.integrations.diffusers.apply
sees the real classes), fed the inputs the model would give it, and its forward timed four
ways: eager diffusers, eager + ditops, torch.compile of diffusers, torch.compile + ditops
(median of CUDA-event timings after warm-up). The patched output is compared with diffusers'.
Two times per way: one forward on its own (the host's time to issue the block's kernels
shows, as nothing runs before it), and the time per block of --blocks forwards chained
back to back, each fed the previous one's output, as the 19 to 60 blocks of a model run
(the host issues block i+1 while the GPU runs block i). torch.compile compiles the block
function once and calls it per block, as diffusers' regional compilation does.
With --profile, each way's chained run also runs under torch.profiler and prints per block:
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


# Each model gives (model, prepare); prepare(model) gives (step, state): step(state) runs the
# block(s) once and returns the next state (the hidden streams), so blocks can be chained as
# the model chains them.


def flux():
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(num_layers=1, num_single_layers=1)  # FLUX.1 widths
    ids = torch.cat([torch.zeros(512, 3), torch.stack(torch.meshgrid(
        torch.zeros(1), torch.arange(64.0), torch.arange(64.0), indexing="ij"), dim=-1).reshape(-1, 3)]).cuda()

    def prepare(model):
        rotary, temb = model.pos_embed(ids), randn(1, 3072)

        def step(state):
            hidden, context = state
            context, hidden = model.transformer_blocks[0](hidden, context, temb, rotary)
            context, hidden = model.single_transformer_blocks[0](hidden, context, temb, rotary)
            return hidden, context

        return step, (randn(1, 4096, 3072), randn(1, 512, 3072))
    return model, prepare


def wan():
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                                  text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=1, cross_attn_norm=True)

    def prepare(model):
        latents = randn(1, 16, 21, 60, 104)  # 480x832, 81 frames -> 21 x 30 x 52 = 32760 tokens
        context, rotary = randn(1, 512, 1536), model.rope(latents)
        temb = torch.randn(1, 6, 1536, device="cuda", dtype=torch.float32)
        return (lambda state: (model.blocks[0](state[0], context, temb, rotary),)), (randn(1, 32760, 1536),)
    return model, prepare


def qwen_image():
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(num_layers=1)  # Qwen-Image widths

    def prepare(model):
        rotary = model.pos_embed([(1, 64, 64)], max_txt_seq_len=512, device="cuda")
        mask, temb = torch.ones(1, 512, device="cuda", dtype=DTYPE), randn(1, 3072)

        def step(state):
            hidden, context = state
            context, hidden = model.transformer_blocks[0](hidden, context, mask, temb, rotary)
            return hidden, context

        return step, (randn(1, 4096, 3072), randn(1, 512, 3072))
    return model, prepare


def z_image():
    from diffusers import ZImageTransformer2DModel

    model = ZImageTransformer2DModel(n_layers=1, n_refiner_layers=1)  # Z-Image widths: 3840, 30 heads of 128

    def prepare(model):
        text, image = 512, 4096  # 1024px: 64 x 64 patches
        ids = torch.cat([torch.stack([torch.arange(1, text + 1), torch.zeros(text), torch.zeros(text)], dim=1),
                         torch.stack(torch.meshgrid(torch.full((1,), text + 1.0), torch.arange(64.0), torch.arange(64.0),
                                                    indexing="ij"), dim=-1).reshape(-1, 3)]).long().cuda()
        mask = torch.ones(1, text + image, dtype=torch.bool, device="cuda")
        frequencies, adaln = model.rope_embedder(ids).unsqueeze(0), randn(1, 256)
        return (lambda state: (model.layers[0](state[0], mask, frequencies, adaln),)), (randn(1, text + image, 3840),)
    return model, prepare


MODELS = {"flux": flux, "wan": wan, "qwen-image": qwen_image, "z-image": z_image}


def chained(step, state, blocks: int):
    """``blocks`` steps back to back, each fed the previous one's output, as a model runs them."""
    def forward():
        current = state
        for _ in range(blocks):
            current = step(current)
        return current
    return forward


def profile(function, label: str, blocks: int, forwards: int = 3) -> None:
    """Prints where one way spends a block of a chained forward: wall and kernel time, ditops
    host time per call, the kernels that took the most time."""
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
    per_block = forwards * blocks
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / per_block
    launches = sum(e.count for e in kernels) / per_block
    print(f"  [{label}] per block: wall {start.elapsed_time(end) / per_block:.3f} ms, "
          f"kernels {kernel_ms:.3f} ms in {launches:.0f} launches")
    for e in events:
        if e.key.startswith("ditops::"):
            print(f"    host {e.key}: {e.cpu_time_total / e.count:.1f} us per call, {e.count / per_block:g} per block")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"    {e.self_device_time_total / 1e3 / per_block:7.3f} ms {e.count / per_block:4g}x {e.key[:90]}")


WAYS = ("eager diffusers", "torch.compile diffusers", "eager + ditops", "torch.compile + ditops")


def measure(name: str, blocks: int, profiling: bool = False) -> dict:
    torch.manual_seed(0)
    model, prepare = MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model.to("cuda", DTYPE).eval()
    result = {"model": name, "chained blocks": blocks}
    outputs = {}
    with torch.no_grad():
        torch.manual_seed(1)
        step, state = prepare(model)
        for way in WAYS:
            if way == "eager + ditops":
                report = integration.apply(model)
            torch._dynamo.reset()
            function = torch.compile(step) if way.startswith("torch.compile") else step
            outputs[way] = function(state)[0]
            result[f"{way} ms"] = time_ms(lambda: function(state))
            result[f"{way} ms per chained block"] = time_ms(chained(function, state, blocks)) / blocks
            if profiling:
                profile(chained(function, state, blocks), f"{name}, {way}", blocks)
    expected = outputs["eager diffusers"].float()
    for way in WAYS[1:]:
        difference = outputs[way].float() - expected
        result[f"{way}: max abs difference"] = difference.abs().max().item()
        result[f"{way}: relative difference"] = (difference.norm() / expected.norm()).item()
    for timing in ("ms", "ms per chained block"):
        result[f"eager speedup ({timing})"] = result[f"eager diffusers {timing}"] / result[f"eager + ditops {timing}"]
        result[f"compile speedup ({timing})"] = (result[f"torch.compile diffusers {timing}"]
                                                 / result[f"torch.compile + ditops {timing}"])
    result["replaced"] = [f"{path}: {op}" for path, op in report.replaced]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--blocks", type=int, default=8, help="blocks chained back to back for the steady-state time")
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler summary of each way")
    arguments = parser.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": str(DTYPE), "models": []}
    for name in arguments.models:
        results["models"].append(measure(name, arguments.blocks, arguments.profile))
        print(json.dumps({k: v for k, v in results["models"][-1].items() if k != "replaced"}), flush=True)
        if arguments.json:
            with open(arguments.json, "w") as file:
                json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()

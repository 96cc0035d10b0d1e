"""Model-level speed of ditops under diffusers, on the GPU, bf16, random weights (no download).

Blocks at real widths: FLUX.1 (one double and one single block; 512px = 1024 image tokens
and 1024px = 4096, plus 512 text tokens; width 3072, 24 heads), Wan2.1-1.3B (one block, 480p
81 frames = 32760 tokens), Qwen-Image (one block, 1024px: 4096 image + 512 text tokens),
Z-Image (one layer, 1024px: 4096 + 512 tokens, width 3840, 30 heads), FLUX.2 dev (one double
and one single block, 1024px: 4096 image + 512 text tokens, width 6144, 48 heads of 128),
HunyuanVideo 1.5 (one block, 480p = 480x848, 61 frames: 16 x 30 x 53 = 25440 video tokens +
1985 text rows (729 image, 256 ByT5, 1000 Qwen2.5-VL; a 256-token prompt, the rest masked),
width 2048, 16 heads of 128), LTX-2 (one block, both streams, the pipeline's default
512x768, 121 frames at 24 fps: 16 x 16 x 24 = 6144 video tokens, width 4096, 32 heads of
128, split RoPE; 126 audio tokens, width 2048, 32 heads of 64; 1024 text tokens per stream),
SD3.5 Large (the first of two blocks, 1024px: 4096 image + 333 text tokens (77 CLIP + 256
T5, the pipeline's default), width 2432, 38 heads of 64, per-head q/k RMSNorm). Each is
built inside a one-layer diffusers model (so that ditops.integrations.diffusers.apply sees
the real classes; SD3.5's has two, as its last block drops the text stream) and fed what the
model would give it. A forward is ``--blocks`` steps chained back to back, each fed the
previous one's output, as the 19 to 60 blocks of a model run; torch.compile compiles the
step once and calls it per block, as diffusers' regional compilation does.

Modes: ``eager``, ``compile`` (torch.compile default mode) and ``reduce-overhead`` (CUDA
graphs). Per model, resolution and mode: ``baseline_ms`` (diffusers) and ``ditops_ms`` per
forward, ``speedup``, ``rel_err`` (ditops' output vs diffusers' eager output, relative L2; vs
diffusers in the same mode when eager is not run), and for compile rows ``replaced_share``:
the share of the compiled baseline's GPU kernel time spent in the kernels that ditops
replaces, from a profile (Inductor's generated kernels that hold a norm: layer_norm,
rms_norm, var_mean, rsqrt, or a RoPE rotation: the cos/sin products of the q/k heads; an
estimate from kernel names, see ``replaced_kernel``), so the ceiling of a compile row is
1 / (1 - replaced_share). A time is the median of ``--rounds`` rounds (``*_rounds_ms``),
alternating which way goes first; a round is the median of 5 CUDA-event timings after
warm-up.

Writes benchmarks/results/models_<GPU>_<date>.json: {"device", "static_launch_user_kernels", "rows": [...]}
(``static_launch_user_kernels``: as in fp8.py).
Usage: python benchmarks/models.py [--output FILE] [--models flux wan qwen-image z-image flux2
       hunyuan-video-1.5 ltx-2 sd3.5] [--modes ...]
       python benchmarks/models.py --table FILE   # the README's table of a results file
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import time
import warnings
from pathlib import Path

import torch

from ditops.integrations import diffusers as integration

DTYPE = torch.bfloat16


def time_ms(function, repeats: int = 5) -> float:
    for _ in range(2):
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


def host_ms(function, repeats: int = 5) -> float:
    """Median time for ``function`` to return, the GPU idle before each call: the host's cost of
    issuing one forward. Where it is near time_ms, the forward is host-bound."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def randn(*shape):
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


# Each model gives (model, prepare); prepare(model) gives (step, state): step(state) runs the
# block(s) once and returns the next state (the hidden streams), so blocks can be chained as
# the model chains them.


def flux(resolution: int = 1024):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel(num_layers=1, num_single_layers=1)  # FLUX.1 widths
    side = resolution // 16  # 8x VAE, 2x2 patches
    ids = torch.cat([torch.zeros(512, 3), torch.stack(torch.meshgrid(
        torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij"), dim=-1).reshape(-1, 3)]).cuda()

    def prepare(model):
        rotary, temb = model.pos_embed(ids), randn(1, 3072)

        def step(state):
            hidden, context = state
            context, hidden = model.transformer_blocks[0](hidden, context, temb, rotary)
            context, hidden = model.single_transformer_blocks[0](hidden, context, temb, rotary)
            return hidden, context

        return step, (randn(1, side * side, 3072), randn(1, 512, 3072))
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


def flux2(image: int = 4096, text: int = 512):
    from diffusers import Flux2Transformer2DModel

    model = Flux2Transformer2DModel(num_layers=1, num_single_layers=1)  # FLUX.2 dev widths: 6144, 48 heads of 128

    def prepare(model):
        side, width = int(image ** 0.5), model.inner_dim
        # the pipeline's (t, h, w, l) positions: text (0, 0, 0, l), image (0, h, w, 0)
        ids = torch.cat([torch.cartesian_prod(*map(torch.arange, (1, 1, 1, text))),
                         torch.cartesian_prod(*map(torch.arange, (1, side, side, 1)))]).to(model.device)
        with torch.no_grad():  # the model's modulations: once per step, shared by all blocks of a kind
            temb = randn(1, width)
            image_mod, text_mod = model.double_stream_modulation_img(temb), model.double_stream_modulation_txt(temb)
            single_mod = model.single_stream_modulation(temb)
        rotary = model.pos_embed(ids)

        def step(state):
            hidden, context = state
            context, hidden = model.transformer_blocks[0](hidden, context, image_mod, text_mod, rotary)
            context, hidden = model.single_transformer_blocks[0](hidden, context, single_mod, rotary,
                                                                 split_hidden_states=True)
            return hidden, context

        return step, (randn(1, image, width), randn(1, text, width))
    return model, prepare


def hunyuan_video_15(latent: tuple = (16, 30, 53), text: int = 729 + 256 + 1000, prompt: int = 256):
    from diffusers import HunyuanVideo15Transformer3DModel

    model = HunyuanVideo15Transformer3DModel(num_layers=1)  # HunyuanVideo 1.5 widths: 2048, 16 heads of 128

    def prepare(model):
        width = model.config.num_attention_heads * model.config.attention_head_dim
        rotary = model.rope(randn(1, model.config.in_channels, *latent))
        # text-to-video: of the 729 image, 256 ByT5 and 1000 Qwen2.5-VL rows, the prompt's come first
        # (the model moves the padding behind the valid rows); the rest are masked
        mask = (torch.arange(text, device=model.device) < prompt).unsqueeze(0)
        temb = randn(1, width)

        def step(state):
            return model.transformer_blocks[0](state[0], state[1], temb, mask, rotary)

        return step, (randn(1, latent[0] * latent[1] * latent[2], width), randn(1, text, width))
    return model, prepare


def ltx2(latent: tuple = (16, 16, 24), audio: int = 126, text: int = 1024):
    from diffusers import LTX2VideoTransformer3DModel

    # LTX-2 (19B) widths: video 4096 (32 heads of 128), audio 2048 (32 heads of 64); its split RoPE
    model = LTX2VideoTransformer3DModel(num_layers=1, rope_type="split")

    def prepare(model):
        config = model.config
        width, audio_width = (config.num_attention_heads * config.attention_head_dim,
                              config.audio_num_attention_heads * config.audio_attention_head_dim)
        video_coords = model.rope.prepare_video_coords(1, *latent, model.device, fps=24.0)
        audio_coords = model.audio_rope.prepare_audio_coords(1, audio, model.device)
        timestep = torch.full((1,), 500.0, device=model.device)

        def modulation(embedding):
            return embedding(timestep, batch_size=1, hidden_dtype=DTYPE)[0].view(1, 1, -1)

        with torch.no_grad():  # the model's modulations: once per step, shared by all blocks
            arguments = dict(
                temb=modulation(model.time_embed), temb_audio=modulation(model.audio_time_embed),
                temb_ca_scale_shift=modulation(model.av_cross_attn_video_scale_shift),
                temb_ca_audio_scale_shift=modulation(model.av_cross_attn_audio_scale_shift),
                temb_ca_gate=modulation(model.av_cross_attn_video_a2v_gate),
                temb_ca_audio_gate=modulation(model.av_cross_attn_audio_v2a_gate))
        # the connectors' text (learnable registers in the padding: all rows kept), as the model's additive bias
        bias = torch.zeros(1, 1, text, device=model.device, dtype=DTYPE)
        arguments.update(
            encoder_hidden_states=randn(1, text, width), audio_encoder_hidden_states=randn(1, text, audio_width),
            video_rotary_emb=model.rope(video_coords), audio_rotary_emb=model.audio_rope(audio_coords),
            ca_video_rotary_emb=model.cross_attn_rope(video_coords[:, 0:1]),
            ca_audio_rotary_emb=model.cross_attn_audio_rope(audio_coords[:, 0:1]),
            encoder_attention_mask=bias, audio_encoder_attention_mask=bias)

        def step(state):
            return model.transformer_blocks[0](state[0], state[1], **arguments)

        return step, (randn(1, latent[0] * latent[1] * latent[2], width), randn(1, audio, audio_width))
    return model, prepare


def sd35(image: int = 4096, text: int = 77 + 256):
    from diffusers import SD3Transformer2DModel

    # SD3.5 Large widths: 2432, 38 heads of 64, per-head q/k RMSNorm; two layers, as the last one (its
    # text stream ends at its attention) is not the block the other 37 are: the first is timed
    model = SD3Transformer2DModel(num_layers=2, num_attention_heads=38, attention_head_dim=64,
                                  caption_projection_dim=2432, pos_embed_max_size=192, qk_norm="rms_norm")

    def prepare(model):
        width, temb = model.inner_dim, randn(1, model.inner_dim)

        def step(state):
            context, hidden = model.transformer_blocks[0](state[0], state[1], temb)
            return hidden, context

        return step, (randn(1, image, width), randn(1, text, width))
    return model, prepare


MODELS = {"flux": flux, "wan": wan, "qwen-image": qwen_image, "z-image": z_image, "flux2": flux2,
          "hunyuan-video-1.5": hunyuan_video_15, "ltx-2": ltx2, "sd3.5": sd35}
# the released model's blocks per block list (built here with one or two), for the weights' bytes at
# full depth: FLUX.1, Wan2.1 1.3B, Qwen-Image, Z-Image, FLUX.2 dev, HunyuanVideo 1.5, LTX-2, SD3.5 Large
DEPTH = {"flux": {"transformer_blocks": 19, "single_transformer_blocks": 38}, "wan": {"blocks": 30},
         "qwen-image": {"transformer_blocks": 60}, "z-image": {"layers": 30, "noise_refiner": 2, "context_refiner": 2},
         "flux2": {"transformer_blocks": 8, "single_transformer_blocks": 48},
         "hunyuan-video-1.5": {"transformer_blocks": 54}, "ltx-2": {"transformer_blocks": 48},
         "sd3.5": {"transformer_blocks": 38}}
RESOLUTIONS = {"flux": (512, 1024), "wan": ("480p",), "qwen-image": (1024,), "z-image": (1024,), "flux2": (1024,),
               "hunyuan-video-1.5": ("480p",), "ltx-2": ("512x768",), "sd3.5": (1024,)}


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


_NORM_OR_ROPE = re.compile(r"layer_norm|rms_norm|var_mean|rsqrt|native_layer_norm|cos|sin|rope|rotary")


def replaced_kernel(name: str) -> bool:
    """Whether a kernel of the compiled baseline is one that ditops replaces: Inductor names
    its generated kernels after the ops fused in them."""
    return name.startswith("triton_") and bool(_NORM_OR_ROPE.search(name))


def replaced_share(function) -> float:
    from torch.profiler import ProfilerActivity, profile

    function()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        function()
        torch.cuda.synchronize()
    kernels = [e for e in trace.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels)
    return sum(e.self_device_time_total for e in kernels if replaced_kernel(e.key)) / total


COMPILE = {"eager": None, "compile": {}, "reduce-overhead": {"mode": "reduce-overhead"}}


def build(name: str, resolution):
    torch.manual_seed(0)
    model, prepare = MODELS[name](resolution) if name == "flux" else MODELS[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model.to("cuda", DTYPE).eval()
    torch.manual_seed(1)
    return model, prepare


def measure(name: str, resolution, modes: list, blocks: int, profiling: bool, rounds: int) -> list:
    """Per mode: both ways compiled (or not) once, then timed ``rounds`` times each, alternating
    which goes first; each way's time is the median of its rounds. A host-bound row (FLUX
    512px) moves by a quarter between two timings of the same code on one machine: timed once
    each, in a fixed order, its ratio says more about the order than about the ops (an H100,
    one process: the same compiled FLUX 512px forward took 12.1 and 15.2 ms)."""
    model, prepare = build(name, resolution)
    step, state = prepare(model)
    samples, outputs, share = {}, {}, None
    with torch.no_grad():
        for mode in modes:
            torch._dynamo.reset()
            forwards = {}
            for patched in (False, True):
                _set_patched(model, patched)
                forwards[patched] = _forward(mode, step, state, blocks)
                outputs[patched, mode] = forwards[patched]()[0].float().clone()
            for turn in range(rounds):
                for patched in (False, True) if turn % 2 == 0 else (True, False):
                    _set_patched(model, patched)
                    samples.setdefault((patched, mode), []).append(time_ms(forwards[patched]))
            if mode == "compile":  # after the timings, so that no profiler session sits between them
                _set_patched(model, False)
                share = replaced_share(forwards[False])
            if profiling:
                for patched in (False, True):
                    _set_patched(model, patched)
                    profile(forwards[patched], f"{name} {resolution}, {mode}, {'ditops' if patched else 'diffusers'}", blocks)
        integration.remove(model)
    expected = outputs[False, "eager"] if "eager" in modes else None
    rows = []
    for mode in modes:
        baseline, ditops = (statistics.median(samples[patched, mode]) for patched in (False, True))
        reference = outputs[False, mode] if expected is None else expected
        difference = outputs[True, mode] - reference
        row = dict(model=name, resolution=str(resolution), mode=mode, blocks=blocks,
                   baseline_ms=baseline, ditops_ms=ditops, speedup=baseline / ditops,
                   rel_err=(difference.norm() / reference.norm()).item(),
                   baseline_rel_err=((outputs[False, mode] - reference).norm() / reference.norm()).item(),
                   baseline_rounds_ms=samples[False, mode], ditops_rounds_ms=samples[True, mode])
        if mode == "compile":
            row["replaced_share"] = share
        rows.append(row)
    return rows


def _set_patched(model, patched: bool) -> None:
    (integration.apply if patched else integration.remove)(model)


def _forward(mode: str, step, state, blocks: int):
    if mode == "reduce-overhead":  # one CUDA graph for the chained blocks: a graph's outputs
        # are overwritten by its next replay, so blocks cannot each be one
        whole = torch.compile(chained(step, state, blocks), **COMPILE[mode])
        return lambda: (torch.compiler.cudagraph_mark_step_begin(), whole())[1]
    return chained(step if COMPILE[mode] is None else torch.compile(step, **COMPILE[mode]), state, blocks)


def table(path: Path) -> str:
    """The README's table of a results file: one line per row, with each compile row's target
    (70% of the ceiling 1 / (1 - replaced_share))."""
    lines = ["| model | resolution | mode | diffusers (ms) | ditops (ms) | speedup | target | rel_err (baseline) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in json.loads(path.read_text())["rows"]:
        target = {"eager": "", "reduce-overhead": ">= 1.00"}.get(row["mode"])
        if target is None:
            target = f">= {1 / (1 - 0.7 * row['replaced_share']):.3f} (share {row['replaced_share']:.3f})"
        lines.append(f"| {row['model']} | {row['resolution']} | {row['mode']} | {row['baseline_ms']:.2f} | "
                     f"{row['ditops_ms']:.2f} | {row['speedup']:.3f}x | {target} | "
                     f"{row['rel_err']:.1e} ({row['baseline_rel_err']:.1e}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, help="print the markdown table of a results file and exit")
    parser.add_argument("--output", help="JSON file (default: benchmarks/results/models_<GPU>_<date>.json)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(COMPILE), choices=list(COMPILE))
    parser.add_argument("--blocks", type=int, default=8, help="blocks chained back to back in one forward")
    parser.add_argument("--rounds", type=int, default=4, help="timings of each way per mode, alternating which goes first")
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler summary of each way")
    options = parser.parse_args()
    if options.table:
        print(table(options.table))
        return
    device = torch.cuda.get_device_name()
    short = device.split()[1] if len(device.split()) > 1 else device
    output = Path(options.output or Path(__file__).parent / "results" / f"models_{short}_{datetime.date.today()}.json")
    document = dict(device=device, torch=torch.__version__, dtype=str(DTYPE), date=str(datetime.date.today()),
                    static_launch_user_kernels=torch._inductor.config.static_launch_user_defined_triton_kernels, rows=[])
    for name in options.models:
        for resolution in RESOLUTIONS[name]:
            for row in measure(name, resolution, options.modes, options.blocks, options.profile, options.rounds):
                document["rows"].append(row)
                print(f"{row['model']:10} {row['resolution']:>5} {row['mode']:15} diffusers {row['baseline_ms']:8.3f} ms  "
                      f"ditops {row['ditops_ms']:8.3f} ms  speedup {row['speedup']:.3f}  rel_err {row['rel_err']:.1e}"
                      + (f"  replaced_share {row['replaced_share']:.3f}" if "replaced_share" in row else ""), flush=True)
            output.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()

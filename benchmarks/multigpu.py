"""ditops under diffusers' context parallelism: speed and error, with and without ditops.

FLUX.1 at 1024px (4096 image + 512 text tokens, width 3072, 24 heads) and Wan2.1-1.3B at 480p,
81 frames (32760 tokens, width 1536, 12 heads, 512 text tokens), each as a diffusers model with
``--blocks`` blocks of each kind (random weights from the config, bf16, no download). Per model,
parallel setting and mode, the same model runs unpatched (``baseline_ms``) and with
``ditops.integrations.diffusers.apply`` (``ditops_ms``), each the median of ``--rounds`` rounds
that alternate which way runs first (``*_rounds_ms``; a round is the median of ``--repeats``
forwards); ``rel_err`` and ``baseline_rel_err``
are the relative L2 error of each output against the one-GPU eager run without ditops.
``*_host_ms``: rank 0's time to issue one forward of each way (the call's return, the GPUs idle
before it), the median of its rounds' medians (near the forward's time, the step is host-bound
and its time spreads with the host's).
``cp_calls`` / ``attention_calls``: attention calls of one ditops forward that got the parallel
config / all of them (counted eagerly at ``dispatch_attention_fn``; the compiled forward runs the
same processors). Wan's cross-attention runs without the config by diffusers' design (its text
is not split), so there cp_calls = the self-attention calls.

Parallel settings: ``ulysses<N>`` and ``ring<N>`` (N = the torchrun world size), or ``none1`` in
one process (the degree-1 speedup on the same host). Ring attention needs a backend that returns
the log-sum-exp: ``--backend`` (default ``_native_cudnn``: torch's cuDNN attention, which
diffusers registers with context-parallel support and LSE; it runs on H100/H200 in bf16) is used
by every run here, the reference included. Modes: ``eager``, ``compile`` (torch.compile of the
whole model, default mode), ``reduce-overhead`` (the same with CUDA graphs; ``cudagraph_skips``
counts the graphs Inductor ran without them) and ``regional`` (diffusers' ``compile_repeated_blocks``);
the last two are not run by default: ``python benchmarks/multigpu.py --models flux --modes eager regional``.

Usage:
    torchrun --nproc-per-node 2 benchmarks/multigpu.py          # ulysses2 and ring2
    python benchmarks/multigpu.py                                # none1: the degree-1 speedup
    torchrun --nproc-per-node 2 benchmarks/multigpu.py --tiny   # CPU smoke test on gloo, tiny widths
Writes benchmarks/results/multigpu_<GPU>x<N>_<date>.json ({"device", "rows"}) unless --tiny
(printed only) or --output says otherwise; ``--table FILE`` prints the README's table of a file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ditops.integrations import diffusers as integration

# (config, input shapes) per model: real widths, and --tiny ones for a CPU smoke test
FLUX = {"real": (dict(patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24,
                      joint_attention_dim=4096, pooled_projection_dim=768, axes_dims_rope=(16, 56, 56)),
                 dict(image_tokens=4096, text_tokens=512)),
        "tiny": (dict(patch_size=1, in_channels=8, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                      pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)),
                 dict(image_tokens=64, text_tokens=8))}
WAN = {"real": (dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
                     text_dim=4096, freq_dim=256, ffn_dim=8960, cross_attn_norm=True),
                dict(latent=(16, 21, 60, 104), text_tokens=512)),
       "tiny": (dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                     text_dim=32, freq_dim=32, ffn_dim=64, cross_attn_norm=True, rope_max_seq_len=32),
                dict(latent=(4, 3, 8, 8), text_tokens=8))}


def flux(size: str, blocks: int, device, dtype):
    import diffusers

    config, shapes = FLUX[size]
    with torch.device(device):
        model = diffusers.FluxTransformer2DModel(num_layers=blocks, num_single_layers=blocks, **config)
    generator = torch.Generator(device).manual_seed(1)
    image, text = shapes["image_tokens"], shapes["text_tokens"]
    side = int(image ** 0.5)
    rows, columns = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")  # FLUX's latent grid ids
    image_ids = torch.stack([torch.zeros_like(rows), rows, columns], -1).float()
    inputs = dict(hidden_states=torch.randn(1, image, config["in_channels"], generator=generator, device=device),
                  encoder_hidden_states=torch.randn(1, text, config["joint_attention_dim"], generator=generator,
                                                    device=device),
                  pooled_projections=torch.randn(1, config["pooled_projection_dim"], generator=generator, device=device),
                  timestep=torch.rand(1, generator=generator, device=device),
                  img_ids=image_ids.reshape(-1, 3).to(device), txt_ids=torch.zeros(text, 3, device=device))
    return model, inputs


def wan(size: str, blocks: int, device, dtype):
    import diffusers

    config, shapes = WAN[size]
    with torch.device(device):
        model = diffusers.WanTransformer3DModel(num_layers=blocks, **config)
    generator = torch.Generator(device).manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, *shapes["latent"], generator=generator, device=device),
                  timestep=torch.tensor([500.0], device=device),
                  encoder_hidden_states=torch.randn(1, shapes["text_tokens"], config["text_dim"], generator=generator,
                                                    device=device))
    return model, inputs


MODELS = {"flux": flux, "wan": wan}


def build(name: str, size: str, blocks: int, device, dtype, backend: str):
    torch.manual_seed(0)  # the same weights on every rank
    model, inputs = MODELS[name](size, blocks, device, dtype)
    model = model.eval().to(dtype)
    model.set_attention_backend(backend)
    inputs = {key: value.to(dtype) if value.is_floating_point() and not key.endswith("_ids") else value
              for key, value in inputs.items()}
    return model, inputs


def forward(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def time_ms(function, device, repeats: int) -> tuple:
    """Medians over ``repeats`` calls of (the forward's time, the host's time to issue it: until
    the call returns), the GPUs idle and the ranks in step before each call."""
    for _ in range(3):
        function()
    times, issued = [], []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        function()
        issued.append((time.perf_counter() - start) * 1e3)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), statistics.median(issued)


def count_attention_calls(model, inputs) -> tuple:
    """(calls that got a parallel config, all calls) of dispatch_attention_fn in one eager
    forward. The counter is in place for that forward only: under torch.compile it would be
    traced, and its growing list would make every call recompile."""
    import importlib

    import diffusers.models.attention_dispatch as dispatch

    calls, original = [], dispatch.dispatch_attention_fn
    modules = [dispatch] + [importlib.import_module(f"diffusers.models.transformers.{name}")  # imported by name there
                            for name in ("transformer_flux", "transformer_wan")]

    def counted(*args, parallel_config=None, **kwargs):
        calls.append(parallel_config is not None)
        return original(*args, parallel_config=parallel_config, **kwargs)

    for module in modules:
        module.dispatch_attention_fn = counted
    try:
        forward(model, inputs)
    finally:
        for module in modules:
            module.dispatch_attention_fn = original
    return sum(calls), len(calls)


def relative_error(output, reference) -> float:
    return ((output.float() - reference).norm() / reference.norm()).item()


def measure(name: str, parallel: str, arguments, device) -> list:
    """Per mode: both ways compiled (or not) once, then timed ``--rounds`` times each,
    alternating which goes first; each way's time is the median of its rounds. Timed once
    each in a fixed order, a host-bound compiled step's ratio said more about the order than
    about the ops (models.py says how far)."""
    from diffusers import ContextParallelConfig

    dtype = torch.float32 if arguments.tiny else torch.bfloat16
    size = "tiny" if arguments.tiny else "real"
    model, inputs = build(name, size, arguments.blocks, device, dtype, arguments.backend)
    reference = forward(model, inputs).float()  # one device, eager, no ditops
    world = dist.get_world_size() if dist.is_initialized() else 1
    if parallel != "none":
        model.enable_parallelism(config=ContextParallelConfig(**{f"{parallel}_degree": world}))
    rows = []
    for mode in arguments.modes:
        row = {"model": name, "parallel": f"{parallel}{world}", "mode": mode}
        try:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            runs = {}
            for variant in ("baseline", "ditops"):
                _set_variant(model, variant)
                if variant == "ditops":
                    row["cp_calls"], row["attention_calls"] = count_attention_calls(model, inputs)
                if mode == "regional":
                    model.compile_repeated_blocks()
                compiled = {"compile": "default", "reduce-overhead": "reduce-overhead"}.get(mode)
                runs[variant] = torch.compile(model, mode=compiled) if compiled else model
                # the first call compiles; Dynamo's guards on the patched modules keep one graph per variant
                output = forward(runs[variant], inputs)
                row["rel_err" if variant == "ditops" else "baseline_rel_err"] = relative_error(output, reference)
            samples, issued = {"baseline": [], "ditops": []}, {"baseline": [], "ditops": []}
            for turn in range(arguments.rounds):
                for variant in ("baseline", "ditops") if turn % 2 == 0 else ("ditops", "baseline"):
                    _set_variant(model, variant)
                    wall, host = time_ms(lambda: forward(runs[variant], inputs), device, arguments.repeats)
                    samples[variant].append(wall)
                    issued[variant].append(host)
            for variant, times in samples.items():
                row[f"{variant}_ms"], row[f"{variant}_rounds_ms"] = statistics.median(times), times
                row[f"{variant}_host_ms"] = statistics.median(issued[variant])
            row["speedup"] = row["baseline_ms"] / row["ditops_ms"]
            if mode == "reduce-overhead":
                row["cudagraph_skips"] = torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]
        except Exception as error:  # noqa: BLE001  the row says what failed; the other rows still run
            row["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
        uncompile(model)
        integration.remove(model)
        rows.append(row)
        report(row)
    return rows


def _set_variant(model, variant: str) -> None:
    (integration.apply if variant == "ditops" else integration.remove)(model)


def uncompile(model) -> None:
    """Undoes compile_repeated_blocks: nn.Module.compile keeps its compiled call here, and has no public undo."""
    for module in model.modules():
        module._compiled_call_impl = None


def report(row: dict) -> None:
    """Each row on stderr as it is measured: a long run that is stopped still shows its rows."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(json.dumps(row), file=sys.stderr, flush=True)


def table(path: Path) -> str:
    """The README's table of a results file: one line per row, in file order."""
    result = json.loads(path.read_text())
    lines = ["| run | model | parallel | mode | baseline (ms) | ditops (ms) | speedup | rel_err (unpatched) | cp calls |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row.get('run', '')} | {row['model']} | {row['parallel']} | {row.get('mode', '')} | "
                         f"error: {row['error'][:80]} | | | | |")
            continue
        lines.append(f"| {row.get('run', '')} | {row['model']} | {row['parallel']} | {row['mode']} | "
                     f"{row['baseline_ms']:.2f} | {row['ditops_ms']:.2f} | {row['speedup']:.2f}x | "
                     f"{row['rel_err']:.1e} ({row['baseline_rel_err']:.1e}) | {row['cp_calls']}/{row['attention_calls']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", type=Path, help="print the markdown table of a results file and exit")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--parallel", nargs="+", choices=["ulysses", "ring"], default=["ulysses", "ring"],
                        help="context-parallel kinds when run under torchrun with more than one process")
    parser.add_argument("--modes", nargs="+", choices=["eager", "compile", "reduce-overhead", "regional"],
                        default=["eager", "compile"],
                        help="regional: diffusers' compile_repeated_blocks (torch.compile of each block)")
    parser.add_argument("--blocks", type=int, default=2, help="double and single blocks (FLUX), blocks (Wan)")
    parser.add_argument("--backend", default=None,
                        help="diffusers attention backend for every run (default _native_cudnn on GPU, native on CPU)")
    parser.add_argument("--repeats", type=int, default=10, help="forwards per round (the round's time is their median)")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per way and mode, alternating which goes first")
    parser.add_argument("--tiny", action="store_true", help="tiny widths, float32, CPU and gloo when no GPU: a smoke test")
    parser.add_argument("--output", type=Path, default=None)
    arguments = parser.parse_args()
    if arguments.table:
        print(table(arguments.table))
        return
    if arguments.blocks < 1:
        parser.error(f"--blocks is {arguments.blocks}; wanted >= 1")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    elif arguments.tiny:
        device = torch.device("cpu")
        torch.accelerator.device_count = lambda: 1  # diffusers places rank r on accelerator r % count; a CPU counts none
    else:
        parser.error("no GPU: only --tiny runs on CPU")
    arguments.backend = arguments.backend or ("_native_cudnn" if device.type == "cuda" else "native")
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    import diffusers.hooks.context_parallel as context_parallel

    if not hasattr(context_parallel.logger, "warning_once"):  # diffusers 0.42.1 calls it (Wan's 1-D timestep)
        context_parallel.logger.warning_once = context_parallel.logger.warning

    rows = []
    for name in arguments.models:
        for parallel in (arguments.parallel if world > 1 else ["none"]):
            rows += measure(name, parallel, arguments, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        gpu = torch.cuda.get_device_name(device).replace("NVIDIA ", "").replace(" ", "-") if device.type == "cuda" else "cpu"
        result = {"device": f"{gpu} x{world}", "backend": arguments.backend, "blocks": arguments.blocks,
                  "tiny": arguments.tiny, "rows": rows}
        text = json.dumps(result, indent=1)
        print(text)
        output = arguments.output
        if output is None and not arguments.tiny:
            output = Path(__file__).parent / "results" / f"multigpu_{gpu}x{world}_{datetime.date.today()}.json"
        if output is not None:
            output.write_text(text + "\n")
            print(f"wrote {output}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

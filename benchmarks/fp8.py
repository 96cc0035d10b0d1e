"""Model-level FP8: ditops' ``apply(model, quantize="fp8")`` against diffusers in bf16 and
torchao's FP8 (dynamic per-row activations, per-channel weights), on the GPU, random weights.

The models and their chained blocks are benchmarks/models.py's. Three copies of each are built
from one seed and fed the same inputs: diffusers as is (bf16), torchao's
``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())`` applied with ``quantize_``
(every Linear, as a user would apply it), and ditops FP8. Per model, resolution and mode
(``eager``, ``compile``, ``reduce-overhead``): the time per forward of each (``bf16_ms``,
``torchao_ms``, ``ditops_ms``; bf16 in the same mode), the host's time to issue one
(``*_host_ms``; near the time per forward, the forward is host-bound), their ratios, each FP8
output's relative L2 error against diffusers' bf16 eager output, the first call's time of each
compiled FP8 model (``compile_s_*``, compile caches emptied before) and the bytes of the blocks' weights on the
GPU, as built and at the released model's depth (``weight_bytes_full_depth_*``: the blocks
a built model lacks counted as its first block's). A time is the median of ``--rounds``
rounds, the three ways taking turns going first; a round is the median of 5 CUDA-event
timings after warm-up.

Writes benchmarks/results/fp8_<GPU>_<date>.json: {"device", "static_launch_user_kernels", "rows": [...]};
``static_launch_user_kernels``: whether Inductor launched ditops' Triton kernels with its static
launcher (TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1; docs/diffusers.md).
Usage: python benchmarks/fp8.py [--output FILE] [--models flux ...] [--modes ...] [--ways ...]
       python benchmarks/fp8.py --combine A.json B.json --output FILE   # rows of runs that timed some ways each
       python benchmarks/fp8.py --table FILE   # the README's table of a results file
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # before torch: first calls compile from scratch (not where another script imports this)
    os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch

sys.path.insert(0, str(Path(__file__).parent))  # models.py beside this file, also where this file is imported
import models  # noqa: E402
from ditops.integrations import diffusers as integration

WAYS = ("bf16", "torchao", "ditops")
FP8_MODELS = tuple(models.MODELS)


def _torchao(model) -> None:
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))


def _weight_bytes(model) -> int:
    """Bytes of the storages behind the model's parameters and buffers on the GPU, each storage
    once (ditops' joint q/k/v weight and its parts' views are one; torchao's FP8 weights are
    tensor subclasses: their inner tensors are counted)."""
    storages = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if not tensor.is_cuda:
            continue
        inner = [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]] if hasattr(
            tensor, "__tensor_flatten__") else [tensor]
        for part in inner:
            storages[part.untyped_storage().data_ptr()] = part.untyped_storage().nbytes()
    return sum(storages.values())


def _full_depth_bytes(model, name: str) -> int:
    """The bytes of the released model's weights (models.DEPTH): the built model's, and for
    each block a list lacks, those of the list's first block (the blocks of a list are alike)."""
    return _weight_bytes(model) + sum((count - len(getattr(model, blocks))) * _weight_bytes(getattr(model, blocks)[0])
                                      for blocks, count in models.DEPTH[name].items())


def _first_call_s(function, way: str, mode: str) -> float:
    """The first call's seconds, Triton's kernel cache a new folder per way and mode (Inductor's
    caches are off for the whole run: TORCHINDUCTOR_FORCE_DISABLE_CACHES=1, set at the top)."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"triton-{way}-{mode}-")
    torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(name: str, resolution, modes: list, blocks: int, rounds: int, ways: tuple = WAYS):
    """Yields a row per mode as soon as it is measured; a way left out of ``ways`` is built and
    run eagerly once (its bf16 eager output is every row's reference) but not timed."""
    built, steps = {}, {}
    for way in WAYS:
        model, prepare = models.build(name, resolution)
        if way == "torchao":
            _torchao(model)
        elif way == "ditops":
            integration.apply(model, quantize="fp8")
        torch.manual_seed(1)
        built[way], steps[way] = model, prepare(model)
        print(f"  built {name} {resolution} {way}", flush=True)
    weight_bytes = {way: _weight_bytes(built[way]) for way in WAYS}
    full_depth_bytes = {way: _full_depth_bytes(built[way], name) for way in WAYS}
    samples, outputs, first_call = {}, {}, {}
    for mode in modes:
        forwards = {}
        with torch.no_grad():
            if "bf16" not in ways:
                outputs["bf16", "eager"] = models._forward("eager", *steps["bf16"], blocks)()[0].float().clone()
            torch._dynamo.reset()  # once per mode: a reset between ways would drop the compiled code of those before
            for way in ways:
                step, state = steps[way]
                forwards[way] = models._forward(mode, step, state, blocks)
                first_call[way, mode] = _first_call_s(forwards[way], way, mode)
                print(f"  {mode} {way}: first call {first_call[way, mode]:.1f} s", flush=True)
                outputs[way, mode] = forwards[way]()[0].float().clone()
            for turn in range(rounds):
                order = ways[turn % len(ways):] + ways[:turn % len(ways)]
                for way in order:
                    samples.setdefault((way, mode), []).append(models.time_ms(forwards[way]))
            host = {way: models.host_ms(forwards[way]) for way in ways}
        expected = outputs["bf16", "eager"] if ("bf16", "eager") in outputs else outputs["bf16", mode]
        ms = {way: statistics.median(samples[way, mode]) if (way, mode) in samples else None for way in WAYS}
        error = {way: ((outputs[way, mode] - expected).norm() / expected.norm()).item() if (way, mode) in outputs
                 else None for way in WAYS}
        ratio = lambda way: ms[way] / ms["ditops"] if None not in (ms[way], ms["ditops"]) else None  # noqa: E731
        row = dict(model=name, resolution=str(resolution), mode=mode, blocks=blocks,
                   bf16_ms=ms["bf16"], torchao_ms=ms["torchao"], ditops_ms=ms["ditops"],
                   speedup_vs_bf16=ratio("bf16"), speedup_vs_torchao=ratio("torchao"),
                   rel_err_ditops=error["ditops"], rel_err_torchao=error["torchao"], rel_err_bf16=error["bf16"],
                   weight_bytes_bf16=weight_bytes["bf16"], weight_bytes_ditops=weight_bytes["ditops"],
                   weight_bytes_torchao=weight_bytes["torchao"],
                   **{f"weight_bytes_full_depth_{way}": full_depth_bytes[way] for way in WAYS},
                   rounds_ms={way: samples[way, mode] for way in ways},
                   **{f"{way}_host_ms": host[way] for way in ways})
        if mode != "eager":
            row.update({f"compile_s_{way}": first_call.get((way, mode)) for way in WAYS})
        yield row


def weights(row: dict) -> str:
    """The ditops weights' bytes over bf16's, as built and, where the row has them, at full depth."""
    built = f"{row['weight_bytes_ditops'] / row['weight_bytes_bf16']:.2f}"
    if "weight_bytes_full_depth_ditops" not in row:
        return built
    return f"{built} ({row['weight_bytes_full_depth_ditops'] / row['weight_bytes_full_depth_bf16']:.2f})"


def mode_shown(row: dict) -> str:
    """The row's mode, and the static launcher where the run had it."""
    return f"{row['mode']}, static launch" if row.get("static_launch_user_kernels") else row["mode"]


def table(path: Path) -> str:
    """The README's table of a results file."""
    lines = ["| model | resolution | mode | bf16 (ms) | torchao FP8 (ms) | ditops FP8 (ms) | vs bf16 | vs torchao "
             "| rel_err ditops (torchao) | first call s, ditops (torchao) | weights vs bf16, as built (full depth) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    def shown(value, form: str) -> str:  # a way left out of the run: "-"
        return "-" if value is None else format(value, form)

    for row in json.loads(path.read_text())["rows"]:
        first = (f"{shown(row['compile_s_ditops'], '.0f')} ({shown(row['compile_s_torchao'], '.0f')})"
                 if "compile_s_ditops" in row else "")
        lines.append(
            f"| {row['model']} | {row['resolution']} | {mode_shown(row)} | {shown(row['bf16_ms'], '.2f')} | "
            f"{shown(row['torchao_ms'], '.2f')} | {row['ditops_ms']:.2f} | {shown(row['speedup_vs_bf16'], '.3f')}x | "
            f"{shown(row['speedup_vs_torchao'], '.3f')}x | {shown(row['rel_err_ditops'], '.1e')} "
            f"({shown(row['rel_err_torchao'], '.1e')}) | {first} | {weights(row)} |")
    return "\n".join(lines)


def combine(paths: list) -> dict:
    """One results document from runs that each timed some of the ways (a compile row of all
    three does not fit in one 10-minute command: torchao's first compile alone took over 340 s):
    per (model, resolution, mode), each way's fields from the run that timed it, the ratios
    recomputed, and ``runs``: which file each way's time came from (timings of separate
    processes; in one run the ways take turns), kept as it was where a row comes from a file
    combined before. A run with Inductor's static launcher gives rows of their own, marked
    ``static_launch_user_kernels`` (a setting of the process, not of the model)."""
    documents = [json.loads(Path(path).read_text()) for path in paths]
    sources = [source for path, document in zip(paths, documents)
               for source in document.get("combined_from", [str(path)])]
    merged, rows = dict(documents[0], rows=[], combined_from=sources), {}
    merged.pop("static_launch_user_kernels", None)  # per row in a combined document
    for path, document in zip(paths, documents):
        for row in document["rows"]:
            row = dict(row, static_launch_user_kernels=row.get("static_launch_user_kernels",
                                                                document.get("static_launch_user_kernels", False)))
            key = (row["model"], row["resolution"], row["mode"], row["static_launch_user_kernels"])
            target = rows.setdefault(key, dict(row, runs={}))
            for way in WAYS:
                if row.get(f"{way}_ms") is not None:
                    for field in (f"{way}_ms", f"{way}_host_ms", f"rel_err_{way}", f"compile_s_{way}"):
                        if field in row:
                            target[field] = row[field]
                    target["runs"][way] = row.get("runs", {}).get(way) or str(path)
    for row in rows.values():
        for way in ("bf16", "torchao"):
            have = row.get(f"{way}_ms") is not None and row.get("ditops_ms") is not None
            row[f"speedup_vs_{way}"] = row[f"{way}_ms"] / row["ditops_ms"] if have else None
        row.pop("rounds_ms", None)
        merged["rows"].append(row)
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, help="print the markdown table of a results file and exit")
    parser.add_argument("--output", help="JSON file (default: benchmarks/results/fp8_<GPU>_<date>.json)")
    parser.add_argument("--models", nargs="+", default=list(FP8_MODELS), choices=list(FP8_MODELS))
    parser.add_argument("--resolutions", nargs="+", help="only these resolutions (e.g. 1024)")
    parser.add_argument("--modes", nargs="+", default=list(models.COMPILE), choices=list(models.COMPILE))
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=list(WAYS), help="the ways timed")
    parser.add_argument("--blocks", type=int, default=8, help="blocks chained back to back in one forward")
    parser.add_argument("--rounds", type=int, default=3, help="timings of each way per mode, taking turns going first")
    parser.add_argument("--combine", nargs="+", type=Path, help="merge the rows of these results files into --output")
    options = parser.parse_args()
    if options.table:
        print(table(options.table))
        return
    if options.combine:
        Path(options.output).write_text(json.dumps(combine(options.combine), indent=1) + "\n")
        print(table(Path(options.output)))
        return
    device = torch.cuda.get_device_name()
    short = device.split()[1] if len(device.split()) > 1 else device
    output = Path(options.output or Path(__file__).parent / "results" / f"fp8_{short}_{datetime.date.today()}.json")
    import torchao

    document = dict(device=device, torch=torch.__version__, torchao=torchao.__version__, date=str(datetime.date.today()),
                    static_launch_user_kernels=torch._inductor.config.static_launch_user_defined_triton_kernels,
                    rows=[])
    for name in options.models:
        for resolution in models.RESOLUTIONS[name]:
            if options.resolutions and str(resolution) not in options.resolutions:
                continue
            for row in measure(name, resolution, options.modes, options.blocks, options.rounds, tuple(options.ways)):
                document["rows"].append(row)
                output.write_text(json.dumps(document, indent=1) + "\n")
                print(json.dumps({key: value for key, value in row.items() if key != "rounds_ms"}), flush=True)
            output.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()

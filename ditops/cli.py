"""The ``ditops`` command: info, explain, check, bench, warmup."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections import Counter, defaultdict

import torch

from . import conformance, dispatch, explain
from .examples import DEFAULT_SHAPES, example_arguments

INFO_TOKENS = 128  # dispatch does not depend on the token count; keep the example inputs small


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise argparse.ArgumentTypeError(f"{name!r} is not a torch dtype")
    return dtype


def _shape(text: str) -> tuple:
    try:
        return tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape like 2,4096,3072") from None


def _device_scope(arch):
    return dispatch.simulated_device(arch) if arch else contextlib.nullcontext()


def _local_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def info(arguments) -> int:
    with _device_scope(arguments.device):
        device = dispatch.device_of(-1) if arguments.device else dispatch.current_device()
        print(f"ditops {sys.modules['ditops'].__version__}, torch {torch.__version__}")
        print(f"device: {device}")
        registry = dispatch.dispatcher().registry
        print(f"registry: {', '.join(registry.sources)}")
        print("\nbackends:")
        width = max(map(len, registry.backends))
        for name, backend in registry.backends.items():
            reason = backend.refusal(device)
            print(f"  {name:<{width}}  {'available' if reason is None else 'unavailable: ' + reason}")
        print(f"\ndispatch for typical bfloat16 inputs (tokens cut to {INFO_TOKENS}; the choice does not depend on them):")
        width = max(map(len, dispatch.OPS))
        for op in dispatch.OPS:
            shape = list(DEFAULT_SHAPES[op])
            shape[-3 if op.endswith("_") else -2] = INFO_TOKENS
            explanation = explain(op, **example_arguments(op, shape, torch.bfloat16, _local_device()))
            target = explanation.selected or f"none ({explanation.error.splitlines()[0]})"
            print(f"  {op:<{width}}  {shape} -> {target}")
    return 0


def explain_command(arguments) -> int:
    with _device_scope(arguments.device):
        example = example_arguments(arguments.op, arguments.shape, arguments.dtype, _local_device())
        print(explain(arguments.op, **example))
    return 0


def check(arguments) -> int:
    device = arguments.device or _local_device()
    results = defaultdict(Counter)
    skip_reasons = defaultdict(Counter)
    failures = []
    backends = conformance.backends()
    for backend in backends:
        unavailable = conformance.unavailable_reason(backend, device)
        for case in conformance.CASES:
            for dtype in arguments.dtypes:
                outcome = conformance.Outcome("skip", unavailable) if unavailable else conformance.run_case(case, backend, dtype, device)
                results[(case.op, backend)][outcome.status] += 1
                if outcome.status == "skip":
                    skip_reasons[(case.op, backend)][outcome.detail] += 1
                if outcome.status == "fail":
                    failures.append(f"{case.id} [{backend}, {str(dtype).removeprefix('torch.')}]: {outcome.detail}")
    print(f"conformance on {device}: every case x dtype against the float64 oracle\n")
    width = max(map(len, dispatch.OPS))
    print(f"{'op':<{width}}  " + "  ".join(f"{b:<22}" for b in backends))
    for op in dispatch.OPS:
        cells = []
        for backend in backends:
            count = results[(op, backend)]
            cells.append(f"{count['pass']} pass {count['fail']} fail {count['skip']} skip".ljust(22))
        print(f"{op:<{width}}  " + "  ".join(cells))
    if skip_reasons:
        print("\nskipped:")
        for (op, backend), reasons in skip_reasons.items():
            for reason, count in reasons.items():
                print(f"  {op} [{backend}] x{count}: {reason}")
    if failures:
        print("\nfailures:")
        for failure in failures:
            print(f"  {failure}")
    return 1 if failures else 0


def bench(arguments) -> int:
    from . import bench as benchmark

    if arguments.plot_from:
        for path in benchmark.report.plot_file(arguments.plot_from):
            print(f"wrote {path}")
        return 0
    rows, info, paths = benchmark.run(
        ops=arguments.ops,
        shapes=arguments.shapes,
        backends=arguments.backends,
        quick=arguments.quick,
        dtype=arguments.dtype,
        output=arguments.output,
        plots=not arguments.no_plots,
    )
    print(f"\n{info['device']}: copy bandwidth {info['copy_gbps']:.0f} GB/s; torch {info['torch']}, triton {info['triton']}")
    for peer, status in info["peers"].items():
        print(f"  peer {peer}: {status}")
    print("\nmicroseconds per call (percent of copy bandwidth); every row and column: the JSON and CSV files\n")
    print(benchmark.report.summary(rows))
    for path in paths:
        print(f"wrote {path}")
    return 0


def warmup(arguments) -> int:
    """Compiles (or loads from the disk cache) every CUDA kernel instance for one arch."""
    import concurrent.futures
    import time

    from . import kernel_cache
    from .backends.compiled import all_instances
    from .backends.cuda import driver

    if arguments.arch:
        arch, load = arguments.arch, False
    elif torch.cuda.is_available() and torch.version.cuda:
        arch, load = driver.arch_of(torch.cuda.current_device()), True
    else:
        raise ValueError("no NVIDIA GPU here: name the arch to compile for, e.g. --arch sm_90")
    instances = all_instances()
    print(f"{len(instances)} CUDA kernel instances for {arch}; cache: {kernel_cache.cache_dir() or 'off (in memory)'}")

    def prepare(instance) -> tuple:
        start = time.perf_counter()
        entry = driver.cubin(instance, arch)
        return entry.compiled, time.perf_counter() - start

    # NVRTC releases the GIL, so threads compile in parallel; loading stays on this thread.
    total = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(arguments.jobs) as pool:
        prepared = list(pool.map(prepare, instances))
    for number, (instance, (compiled, seconds)) in enumerate(zip(instances, prepared), 1):
        start = time.perf_counter()
        if load:
            driver.function(instance, torch.cuda.current_device())
        how = "compiled" if compiled else "cached"
        print(f"[{number:3}/{len(instances)}] {instance.name_expression:<52} {how:<8} {seconds * 1e3:7.1f} ms"
              + (f"  load {(time.perf_counter() - start) * 1e3:5.2f} ms" if load else ""), flush=True)
    compiled_count = sum(compiled for compiled, _ in prepared)
    print(f"{compiled_count} compiled, {len(instances) - compiled_count} from the cache, "
          f"{time.perf_counter() - total:.1f} s with {arguments.jobs} threads")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ditops", description="Fused ops for diffusion transformers.")
    commands = parser.add_subparsers(dest="command", required=True)

    info_parser = commands.add_parser("info", help="the device, each backend's availability, and what each op dispatches to")
    info_parser.add_argument("--device", help="simulate a GPU arch, e.g. sm_90, gfx942")
    info_parser.set_defaults(run=info)

    explain_parser = commands.add_parser("explain", help="which implementation an op would run for a shape, and why")
    explain_parser.add_argument("op", choices=dispatch.OPS, metavar="OP", help=", ".join(dispatch.OPS))
    explain_parser.add_argument("--shape", type=_shape, help="x as B,S,D for the norm ops; q as T,H,Dh or B,S,H,Dh for RoPE")
    explain_parser.add_argument("--dtype", type=_dtype, default=torch.bfloat16)
    explain_parser.add_argument("--device", help="simulate a GPU arch, e.g. sm_90, gfx942")
    explain_parser.set_defaults(run=explain_command)

    check_parser = commands.add_parser("check", help="run the conformance suite here; prints an op x backend table")
    check_parser.add_argument("--device", help="torch device to test on (default: cuda if present, else cpu)")
    check_parser.add_argument("--dtypes", type=_dtype, nargs="+", default=list(conformance.DTYPES))
    check_parser.set_defaults(run=check)

    bench_parser = commands.add_parser("bench", help="time every op at real model shapes against eager, torch.compile and peers")
    bench_parser.add_argument("--quick", action="store_true", help="one real shape per op and a few latency cases (about a minute on a GPU)")
    bench_parser.add_argument("--ops", nargs="+", help="only these ops")
    bench_parser.add_argument("--shapes", nargs="+", help="only cases whose model or shape contains one of these")
    bench_parser.add_argument("--backends", nargs="+", help="only these candidates (reference, eager, torch.compile, liger, ...)")
    bench_parser.add_argument("--dtype", type=_dtype, default=torch.bfloat16)
    bench_parser.add_argument("--output", default="benchmarks/results", help="folder for the JSON, CSV and PNG files")
    bench_parser.add_argument("--no-plots", action="store_true")
    bench_parser.add_argument("--plot-from", metavar="RESULTS.json", help="only draw the charts of a saved results file")
    bench_parser.set_defaults(run=bench)

    warmup_parser = commands.add_parser("warmup", help="compile every CUDA kernel for this GPU (or --arch) into the disk cache")
    warmup_parser.add_argument("--arch", help="compile for this arch without a GPU, e.g. sm_90")
    warmup_parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compile threads (default: one per CPU)")
    warmup_parser.set_defaults(run=warmup)

    arguments = parser.parse_args(argv)
    try:
        return arguments.run(arguments)
    except ValueError as error:
        print(f"ditops {arguments.command}: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""The ``ditops`` command: info, explain, check, bench, warmup.

Results go to stdout; progress of the long commands (check, warmup, bench) goes to stderr,
silenced by ``-q``. A bad argument ends in one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections import Counter, defaultdict

import torch

from . import __version__, conformance, dispatch, explain
from .dispatch.selector import device_refusal
from .examples import DEFAULT_SHAPES, example_arguments

INFO_TOKENS = 128  # dispatch does not depend on the token count; keep the example inputs small


class UsageError(ValueError):
    """A bad command-line argument: reported in one line, exit code 2."""


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


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"wanted a positive whole number, got {text!r}")
    return int(text)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (no usage block) and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _DeprecatedDevice(argparse.Action):
    """``--device ARCH`` of info/explain, the old spelling of ``--arch`` (``--device`` means a torch device)."""

    def __call__(self, parser, namespace, value, option_string=None):
        print(f"{parser.prog}: --device ARCH is deprecated here, use --arch {value}", file=sys.stderr)
        namespace.arch = value


def _progress(arguments):
    """A function printing one progress line on stderr, or doing nothing under -q."""
    if arguments.quiet:
        return lambda message: None
    return lambda message: print(message, file=sys.stderr, flush=True)


def _simulated(arguments):
    """The device that ``--arch`` (and ``--gpu-name``, which measured preferences match) names, or None."""
    if arguments.gpu_name and not arguments.arch:
        raise UsageError("--gpu-name names the GPU of --arch: give both, e.g. --arch sm_90 --gpu-name H200")
    if not arguments.arch:
        return None
    device = dispatch.parse_arch(arguments.arch)
    return dataclasses.replace(device, name=arguments.gpu_name) if arguments.gpu_name else device


def _dispatch_scope(arguments):
    """Where info and explain dispatch: the named arch, else this machine's GPU, else the CPU.
    They describe calls on meta tensors (shapes without memory), which dispatch would see as
    CPU tensors, so this machine's GPU is simulated too."""
    simulated = _simulated(arguments)
    if simulated:
        return dispatch.simulated_device(simulated)
    if torch.cuda.is_available():  # the detected GPU itself: its name shows and it is not labelled simulated
        return dispatch.simulated_device(dispatch.current_device())
    return contextlib.nullcontext()


def _call_path() -> str:
    """How a call reaches a kernel in this process; the Triton part from kernel_launch.bind's own test."""
    try:
        from .backends.triton.kernel_launch import bound_launch_refusal
    except ImportError:  # no Triton on this platform: the backends list says so
        return "call path: python plans (cached per call signature); triton launches: none (the triton backend does not import)"
    refusal = bound_launch_refusal()
    triton = "pre-bound (kernel_launch.bind)" if refusal is None else f"triton's own launcher ({refusal})"
    return f"call path: python plans (cached per call signature); triton launches: {triton}"


def info(arguments) -> int:
    device = _simulated(arguments) or dispatch.current_device()
    print(f"ditops {__version__}, torch {torch.__version__}")
    print(f"device: {device}")
    registry = dispatch.dispatcher().registry
    print(f"registry: {', '.join(registry.sources)}")
    print(_call_path())
    print("\nbackends:")
    width = max(map(len, registry.backends))
    for name in registry.backends:
        reason = device_refusal(name, device)  # what explain says of each of its implementations on this device
        print(f"  {name:<{width}}  {'available' if reason is None else 'refused: ' + reason}")
    print(f"\ndispatch for typical bfloat16 inputs (tokens cut to {INFO_TOKENS}; the choice does not depend on them):")
    width = max(map(len, dispatch.OPS))
    with _dispatch_scope(arguments):
        for op in dispatch.OPS:
            shape = list(DEFAULT_SHAPES[op])
            shape[-3 if op.endswith("_") else -2] = INFO_TOKENS
            explanation = explain(op, **example_arguments(op, shape, torch.bfloat16, "meta"))
            target = explanation.selected or f"none ({explanation.error.splitlines()[0]})"
            print(f"  {op:<{width}}  {shape} -> {target}")
    return 0


def explain_command(arguments) -> int:
    try:
        example = example_arguments(arguments.op, arguments.shape, arguments.dtype, "meta")
    except ValueError as error:
        raise UsageError(f"--shape: {error}") from None
    with _dispatch_scope(arguments):
        print(explain(arguments.op, **example, compiled=arguments.compiled))
    return 0


def _check_device(text: str) -> torch.device:
    """The torch device ``check`` runs on: cpu or an existing GPU (cuda[:N], also on ROCm torch)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(
            f"--device {text!r} is not a torch device (cpu, cuda, cuda:1); "
            f"to see dispatch on a GPU arch without one, use ditops info --arch {text}"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: check computes values on cpu or cuda[:N], got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {text!r}: no GPU here (torch.cuda.is_available() is False)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {text!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def _check_dtypes(dtypes) -> list:
    allowed = {str(dtype).removeprefix("torch."): dtype for dtype in conformance.DTYPES}
    for dtype in dtypes:
        if dtype not in conformance.DTYPES:
            raise UsageError(
                f"--dtypes: conformance has tolerances for {', '.join(allowed)}, got {str(dtype).removeprefix('torch.')}"
            )
    return list(dtypes)


def check(arguments) -> int:
    device = str(_check_device(arguments.device)) if arguments.device else ("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = _check_dtypes(arguments.dtypes)
    progress = _progress(arguments)
    results = defaultdict(Counter)
    skip_reasons = defaultdict(Counter)
    failures = []
    backends = conformance.backends()
    cases_by_op = defaultdict(list)
    cases = conformance.CASES + (conformance.LONG_CASES if device.startswith("cuda") else [])  # long: GPU calls
    for case in cases:
        cases_by_op[case.op].append(case)
    total = len(backends) * len(cases) * len(dtypes)
    done = 0
    started = time.perf_counter()  # each op's line says when it began: a cold cache compiles every kernel
    progress(f"check on {device}: {len(backends)} backends x {len(cases)} cases x {len(dtypes)} dtypes = {total} runs")
    for backend in backends:
        unavailable = conformance.unavailable_reason(backend, device)
        if unavailable:
            progress(f"  {backend}: skipped, {unavailable}")
        for op, cases in cases_by_op.items():
            runs = len(cases) * len(dtypes)
            if not unavailable:
                progress(f"  [{done + runs:5}/{total}] {backend} {op}: {len(cases)} cases x {len(dtypes)} dtypes"
                         f" ({time.perf_counter() - started:.0f} s in)")
            for case in cases:
                for dtype in dtypes:
                    outcome = (
                        conformance.Outcome("skip", unavailable) if unavailable else conformance.run_case(case, backend, dtype, device)
                    )
                    results[(op, backend)][outcome.status] += 1
                    if outcome.status == "skip":
                        skip_reasons[(op, backend)][outcome.detail] += 1
                    if outcome.status == "fail":
                        failures.append(f"{case.id} [{backend}, {str(dtype).removeprefix('torch.')}]: {outcome.detail}")
            done += runs
    progress(f"check took {time.perf_counter() - started:.0f} s")
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
        try:
            paths = benchmark.report.plot_file(arguments.plot_from)
        except ValueError as error:
            raise UsageError(f"--plot-from: {error}") from None
        for path in paths:
            print(f"wrote {path}")
        return 0
    benchmark.checked_cases(arguments.ops, arguments.shapes, arguments.backends, arguments.quick, arguments.dtype)
    try:
        output = benchmark.prepare_output(arguments.output)
    except ValueError as error:
        raise UsageError(f"--output: {error}") from None
    rows, info, _ = benchmark.run(
        ops=arguments.ops,
        shapes=arguments.shapes,
        backends=arguments.backends,
        quick=arguments.quick,
        dtype=arguments.dtype,
        write_files=False,
        progress=_progress(arguments),
    )
    if not rows:
        raise UsageError(f"--backends: {', '.join(arguments.backends)} accepted none of the selected cases (ditops explain says why)")
    print(f"\n{info['device']}: copy bandwidth {info['copy_gbps']:.0f} GB/s; torch {info['torch']}, triton {info['triton']}")
    for peer, status in info["peers"].items():
        print(f"  peer {peer}: {status}")
    print("\nmicroseconds per call (percent of copy bandwidth); every row and column: the JSON and CSV files\n")
    print(benchmark.report.summary(rows), flush=True)  # before writing: a failed write loses no result
    try:
        paths = benchmark.write(rows, info, output, plots=not arguments.no_plots)
    except OSError as error:
        print(f"ditops bench: could not write the files ({error}); the table above holds the results", file=sys.stderr)
        return 1
    for path in paths:
        print(f"wrote {path}")
    return 0


def _warmup_arch(text) -> tuple:
    """(arch, load the kernels too) for warmup: the named NVIDIA arch, or this machine's GPU."""
    from .backends.cuda import driver

    if text is None:
        if torch.cuda.is_available() and torch.version.cuda:
            return driver.arch_of(torch.cuda.current_device()), True
        raise UsageError("no NVIDIA GPU here: name the arch to compile for, e.g. --arch sm_90")
    device = dispatch.parse_arch(text)
    cuda = dispatch.dispatcher().registry.backends.get("cuda")
    min_sm = (cuda.constraints.get("min_sm", 0) if cuda else 0) or 0
    if device.vendor != "cuda" or device.sm < min_sm:
        raise UsageError(
            f"--arch: warmup compiles the cuda backend's kernels for NVIDIA sm_{min_sm} and newer, got {text!r}"
            + (" (AMD: the rocm backend compiles each kernel on first use)" if device.vendor == "rocm" else "")
        )
    return device.arch, False


def warmup(arguments) -> int:
    """Compiles (or loads from the disk cache) every CUDA kernel instance for one arch."""
    import concurrent.futures
    import time

    from . import kernel_cache
    from .backends.compiled import all_instances, stream_instances
    from .backends.cuda import driver

    arch, load = _warmup_arch(arguments.arch)
    progress = _progress(arguments)
    instances = all_instances() + stream_instances()
    print(f"{len(instances)} CUDA kernel instances for {arch}; cache: {kernel_cache.cache_dir() or 'off (in memory)'}", flush=True)

    def prepare(instance) -> tuple:
        start = time.perf_counter()
        entry = driver.cubin(instance, arch)
        return entry.compiled, time.perf_counter() - start

    # NVRTC releases the GIL, so threads compile in parallel; loading stays on this thread.
    total = time.perf_counter()
    compiled_count = 0
    with concurrent.futures.ThreadPoolExecutor(arguments.jobs) as pool:
        futures = {pool.submit(prepare, instance): instance for instance in instances}
        for number, future in enumerate(concurrent.futures.as_completed(futures), 1):
            instance = futures[future]
            compiled, seconds = future.result()
            compiled_count += compiled
            progress(f"[{number:3}/{len(instances)}] {instance.name_expression:<64} {'compiled' if compiled else 'cached':<8} {seconds * 1e3:7.1f} ms")
    if load:
        start = time.perf_counter()
        for instance in instances:
            driver.function(instance, torch.cuda.current_device())
        progress(f"loaded {len(instances)} kernels in {time.perf_counter() - start:.2f} s")
    print(f"{compiled_count} compiled, {len(instances) - compiled_count} from the cache, "
          f"{time.perf_counter() - total:.1f} s with {arguments.jobs} threads")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ditops", description="Fused ops for diffusion transformers.")
    parser.add_argument("--version", action="version", version=f"ditops {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    quiet = _Parser(add_help=False)
    quiet.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")

    def simulated_arch(command):
        command.add_argument("--arch", help="show dispatch on this GPU arch (simulated), e.g. sm_90, gfx942")
        command.add_argument("--device", action=_DeprecatedDevice, metavar="ARCH", help="deprecated spelling of --arch")
        command.add_argument("--gpu-name", help="with --arch: the GPU's name, which the registry's measured preferences match, e.g. H200")

    info_parser = commands.add_parser("info", help="the device, each backend's availability, and what each op dispatches to")
    simulated_arch(info_parser)
    info_parser.set_defaults(run=info)

    explain_parser = commands.add_parser("explain", help="which implementation an op would run for a shape, and why")
    explain_parser.add_argument("op", choices=dispatch.OPS, metavar="OP", help=", ".join(dispatch.OPS))
    explain_parser.add_argument("--shape", type=_shape, help="x as B,S,D or S,D for the norm ops; q as T,H,Dh or B,S,H,Dh for RoPE")
    explain_parser.add_argument("--dtype", type=_dtype, default=torch.bfloat16)
    explain_parser.add_argument("--compiled", action="store_true",
                                help="the choice for the call traced into a torch.compile graph")
    simulated_arch(explain_parser)
    explain_parser.set_defaults(run=explain_command)

    check_parser = commands.add_parser("check", parents=[quiet], help="run the conformance suite here; prints an op x backend table")
    check_parser.add_argument("--device", help="torch device to test on: cpu, cuda, cuda:N (default: cuda if present, else cpu)")
    check_parser.add_argument("--dtypes", type=_dtype, nargs="+", default=list(conformance.DTYPES), help="float32 float16 bfloat16 (default: all)")
    check_parser.set_defaults(run=check)

    bench_parser = commands.add_parser("bench", parents=[quiet], help="time every op at real model shapes against eager, torch.compile and peers")
    bench_parser.add_argument("--quick", action="store_true", help="one real shape per op and a few latency cases (about a minute on a GPU)")
    bench_parser.add_argument("--ops", nargs="+", help="only these ops")
    bench_parser.add_argument("--shapes", nargs="+", help="only cases whose model or shape contains one of these")
    bench_parser.add_argument("--backends", nargs="+", help="only these candidates (reference, eager, torch.compile, liger, ...)")
    bench_parser.add_argument("--dtype", type=_dtype, default=torch.bfloat16)
    bench_parser.add_argument("--output", default="benchmarks/results", help="folder for the JSON, CSV and PNG files (checked before the run)")
    bench_parser.add_argument("--no-plots", action="store_true")
    bench_parser.add_argument("--plot-from", metavar="RESULTS.json", help="only draw the charts of a saved results file")
    bench_parser.set_defaults(run=bench)

    warmup_parser = commands.add_parser("warmup", parents=[quiet], help="compile every CUDA kernel for this GPU (or --arch) into the disk cache")
    warmup_parser.add_argument("--arch", help="compile for this NVIDIA arch without a GPU, e.g. sm_90")
    warmup_parser.add_argument("--jobs", type=_positive, default=os.cpu_count(), help="compile threads (default: one per CPU)")
    warmup_parser.set_defaults(run=warmup)
    return parser


def main(argv=None) -> int:
    arguments = _parser().parse_args(argv)
    try:
        return arguments.run(arguments)
    except ValueError as error:  # UsageError, and bad input the ops report (a ValueError naming the argument)
        print(f"ditops {arguments.command}: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

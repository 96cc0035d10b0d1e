"""Compiling ditops/csrc kernels with NVRTC (cuda.bindings.nvrtc) to a cubin for one exact
arch. Needs no GPU and no driver, so CI compiles every instance on a CPU machine."""

from __future__ import annotations

import functools
import re
import sys
import time
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

from ..compiled import SOURCES, Instance


class CompileError(RuntimeError):
    pass


class Compiled(NamedTuple):
    cubin: bytes
    lowered_name: str  # the mangled name of the instance in the cubin
    registers: int
    spill_bytes: int  # spill stores + loads, per ptxas, of its entry function and of the functions it calls
    stack_bytes: int  # local-memory stack frame (arrays or parameters the compiler could not keep in registers)
    seconds: float


class Resources(NamedTuple):
    """ptxas' figures for one entry function."""

    registers: int
    spill_bytes: int  # spill stores + loads
    stack_bytes: int  # local-memory stack frame


class Program(NamedTuple):
    """Instances of one source file compiled together."""

    cubin: bytes
    lowered_names: dict  # Instance -> its mangled name in the cubin (the name of its entry function)
    resources: dict  # Instance -> Resources of its entry function
    # Function name -> spill bytes of each function ptxas reported spilling that is no instance's entry
    # function: a device function compiled as a call instead of inlined, whose spills resources omit.
    other_spills: dict
    seconds: float


def _check(result, what: str, program=None) -> tuple:
    from cuda.bindings import nvrtc

    error, *values = result
    if error != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        log = _log(program) if program is not None else ""
        raise CompileError(f"{what} failed: {error.name}\n{log}")
    return tuple(values)


def _log(program) -> str:
    from cuda.bindings import nvrtc

    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(program, log)
    return log.decode(errors="replace").rstrip("\x00 \n")


@functools.lru_cache(maxsize=None)
def version() -> str:
    from cuda.bindings import nvrtc

    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=None)
def include_folders() -> tuple:
    """Where cuda_fp16.h and cuda_bf16.h are: NVRTC has no built-in copy. The nvidia-cuda-runtime
    wheel's headers first (they match the pip-installed NVRTC), then a CUDA toolkit's."""
    candidates = []
    for site in sys.path:
        candidates += sorted(Path(site).glob("nvidia/cu*/include")) + [Path(site) / "nvidia/cuda_runtime/include"]
    candidates += [Path("/usr/local/cuda/include")]
    for folder in candidates:
        if (folder / "cuda_fp16.h").is_file():
            return (str(SOURCES), str(folder))
    raise CompileError("cuda_fp16.h not found: install nvidia-cuda-runtime (pip) or a CUDA toolkit")


def ptxas_report(log: str, entry_names: Iterable[str]) -> tuple:
    """From ptxas' -v report in an NVRTC log: the Resources of each entry function named, and
    (name -> spill bytes) for each other function that spills. ptxas reports a function called
    rather than inlined under each entry function that calls it: its largest spills count."""
    registers, frames, entry, function = {}, {}, None, None
    for line in log.splitlines():
        if found := re.search(r"Compiling entry function '([^']+)'", line):
            entry = found.group(1)
        elif found := re.search(r"Function properties for (\S+)", line):
            function = found.group(1)
        elif found := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            stack, stores, loads = map(int, found.groups())
            previous = frames.get(function, (0, 0))
            frames[function] = (max(stack, previous[0]), max(stores + loads, previous[1]))
        elif found := re.search(r"Used (\d+) registers", line):
            registers[entry] = int(found.group(1))
    entries = {}
    for name in entry_names:
        if name not in registers or name not in frames:
            raise CompileError(f"ptxas reported no registers or stack frame for entry function {name}:\n{log}")
        entries[name] = Resources(registers[name], frames[name][1], frames[name][0])
    others = {name: spills for name, (_, spills) in frames.items() if name not in entries and spills}
    return entries, others


def _compile(instances: Sequence[Instance], arch: str, report: bool) -> tuple:
    """(cubin, {instance: lowered name}, NVRTC's log, seconds) of instances of one source file
    compiled together for arch; report: with ptxas' -v report in the log."""
    sources = {instance.source for instance in instances}
    if len(sources) != 1:
        raise ValueError(f"compile_instances takes instances of one source file, got {sorted(sources) or 'none'}")
    (source_name,) = sources
    from cuda.bindings import nvrtc

    start = time.perf_counter()
    source = (SOURCES / source_name).read_bytes()
    (program,) = _check(nvrtc.nvrtcCreateProgram(source, source_name.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        for instance in instances:
            _check(nvrtc.nvrtcAddNameExpression(program, instance.name_expression.encode()), "nvrtcAddNameExpression")
        options = [f"--gpu-architecture={arch}", "-std=c++17", "-lineinfo"] + (["-Xptxas=-v"] if report else [])
        options += [f"-I{folder}" for folder in include_folders()]
        names = "; ".join(instance.name_expression for instance in instances)
        _check(nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options]),
               f"compiling {names} for {arch}", program)
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        lowered = {}
        for instance in instances:
            (name,) = _check(nvrtc.nvrtcGetLoweredName(program, instance.name_expression.encode()), "nvrtcGetLoweredName")
            lowered[instance] = name.decode()
        log = _log(program)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return cubin, lowered, log, time.perf_counter() - start


def compile_instances(instances: Sequence[Instance], arch: str) -> Program:
    """Compiles instances of one source file together for arch ("sm_90") in one NVRTC program,
    with each instance's registers, spills and stack as ptxas reports its entry function."""
    cubin, lowered, log, seconds = _compile(instances, arch, report=True)
    entries, others = ptxas_report(log, lowered.values())
    return Program(cubin, lowered, {instance: entries[name] for instance, name in lowered.items()}, others, seconds)


def compile_instance(instance: Instance, arch: str) -> Compiled:
    """Compiles one instance for arch ("sm_90") and reports its registers and spills."""
    program = compile_instances([instance], arch)
    resources = program.resources[instance]
    # Alone in its program, every other function ptxas reports is one the instance calls.
    return Compiled(program.cubin, program.lowered_names[instance], resources.registers,
                    resources.spill_bytes + sum(program.other_spills.values()), resources.stack_bytes, program.seconds)


def code_of(instance: Instance, arch: str) -> tuple:
    """(cubin, lowered name) of one instance for arch: the backend's compile, without ptxas'
    report, which the code does not need and which NVRTC 13.0 left out of the log in some
    processes where torch had initialised CUDA (on an H200 host: right after a first CUDA tensor,
    and inside a CUDA graph capture), failing the report's check."""
    cubin, lowered, _, _ = _compile([instance], arch, report=False)
    return cubin, lowered[instance]

"""Compiling ditops/csrc kernels with NVRTC (cuda.bindings.nvrtc) to a cubin for one exact
arch. Needs no GPU and no driver, so CI compiles every instance on a CPU machine."""

from __future__ import annotations

import functools
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

from ..compiled import SOURCES, Instance


class CompileError(RuntimeError):
    pass


class Compiled(NamedTuple):
    cubin: bytes
    lowered_name: str  # the mangled name of the instance in the cubin
    registers: int
    spill_bytes: int  # spill stores + loads, per ptxas
    stack_bytes: int  # local-memory stack frame (arrays or parameters the compiler could not keep in registers)
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


def compile_instance(instance: Instance, arch: str) -> Compiled:
    """Compiles one instance for arch ("sm_90") and reports its registers and spills."""
    from cuda.bindings import nvrtc

    start = time.perf_counter()
    source = (SOURCES / instance.source).read_bytes()
    (program,) = _check(nvrtc.nvrtcCreateProgram(source, instance.source.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        name = instance.name_expression.encode()
        _check(nvrtc.nvrtcAddNameExpression(program, name), "nvrtcAddNameExpression")
        options = [f"--gpu-architecture={arch}", "-std=c++17", "-lineinfo", "-Xptxas=-v"]
        options += [f"-I{folder}" for folder in include_folders()]
        _check(nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options]),
               f"compiling {instance.name_expression} for {arch}", program)
        (size,) = _check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        _check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        (lowered,) = _check(nvrtc.nvrtcGetLoweredName(program, name), "nvrtcGetLoweredName")
        log = _log(program)
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    registers = re.search(r"Used (\d+) registers", log)
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    stack = re.search(r"(\d+) bytes stack frame", log)
    return Compiled(cubin, lowered.decode(), int(registers.group(1)) if registers else -1, sum(spills),
                    int(stack.group(1)) if stack else -1, time.perf_counter() - start)

"""Compiling ditops/csrc kernels with hiprtc (hip-python) to an AMD code object for one gfx
arch. Needs no GPU: the ROCm libraries alone (CI uses Debian's ROCm 5.2, see .ci/run)."""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple, Sequence

from ..compiled import SOURCES, Instance


class CompileError(RuntimeError):
    pass


class CodeObject(NamedTuple):
    code: bytes  # an ELF for the AMDGPU machine
    lowered_names: dict  # Instance -> its mangled name in the code object


def _check(result, what: str, program=None) -> tuple:
    from hip import hiprtc

    error, *values = result if isinstance(result, tuple) else (result,)
    if error != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
        raise CompileError(f"{what} failed: {error.name}\n{_log(program) if program is not None else ''}")
    return tuple(values)


def _log(program) -> str:
    from hip import hiprtc

    _, size = hiprtc.hiprtcGetProgramLogSize(program)
    log = bytearray(size)
    hiprtc.hiprtcGetProgramLog(program, log)
    return bytes(log).decode(errors="replace").rstrip("\x00 \n")


@functools.lru_cache(maxsize=None)
def version() -> str:
    from hip import hiprtc

    major, minor = _check(hiprtc.hiprtcVersion(), "hiprtcVersion")
    return f"{major}.{minor}"


def compile_instances(instances: Sequence[Instance], arch: str) -> CodeObject:
    """Compiles instances of one source file together for arch ("gfx942")."""
    from hip import hiprtc

    (source_name,) = {instance.source for instance in instances}
    source = (SOURCES / source_name).read_bytes()
    (program,) = _check(hiprtc.hiprtcCreateProgram(source, source_name.encode(), 0, [], []), "hiprtcCreateProgram")
    try:
        for instance in instances:
            _check(hiprtc.hiprtcAddNameExpression(program, instance.name_expression.encode()), "hiprtcAddNameExpression")
        options = [f"--offload-arch={arch}", "-O3", "-std=c++17", f"-I{SOURCES}"]
        _check(hiprtc.hiprtcCompileProgram(program, len(options), [o.encode() for o in options]),
               f"compiling {source_name} for {arch}", program)
        (size,) = _check(hiprtc.hiprtcGetCodeSize(program), "hiprtcGetCodeSize")
        code = bytearray(size)
        _check(hiprtc.hiprtcGetCode(program, code), "hiprtcGetCode")
        lowered = {}
        for instance in instances:
            (name,) = _check(hiprtc.hiprtcGetLoweredName(program, instance.name_expression.encode()), "hiprtcGetLoweredName")
            lowered[instance] = name.decode() if isinstance(name, bytes) else str(name)
    finally:
        handle = ctypes.c_void_p(int(program))  # hiprtcDestroyProgram takes a hiprtcProgram*
        hiprtc.hiprtcDestroyProgram(ctypes.addressof(handle))
    return CodeObject(bytes(code), lowered)

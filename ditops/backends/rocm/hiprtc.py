"""Compiling ditops/csrc kernels with hiprtc (hip-python) to an AMD code object for one gfx
arch. Needs no GPU: the ROCm libraries alone (CI uses Debian's ROCm 5.2, see .ci/run).

hip-python opens hiprtc on its first call, by a path it resolves itself or by the bare name
``libhiprtc.so``, which many installs lack: PyTorch's ROCm wheels ship hiprtc versioned in
``torch/lib``, distributions ship ``libhiprtc.so.N`` only, and in ROCm 5.2 hiprtc lives in
``libamdhip64.so.5``. ``library()`` finds a library that really holds hiprtc and, where
hip-python resolves paths through ``rocm.bindings.util.paths`` (hip-python 7 and newer),
points it there; ``load_error()`` then calls the binding once, so that the backend is
refused with the reason (and Triton serves) instead of failing on every call.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch

from ..compiled import SOURCES, Instance

# Tried by name (the system loader's search) after the folders below: newest soname first;
# ROCm 5.2 has no libhiprtc and exports hiprtc from the HIP runtime.
_SYSTEM_NAMES = ("libhiprtc.so", "libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so.5", "libamdhip64.so.5")


class CompileError(RuntimeError):
    """hiprtc cannot be loaded, or a kernel does not compile; the message names the backend."""


class CodeObject(NamedTuple):
    code: bytes  # an ELF for the AMDGPU machine
    lowered_names: dict  # Instance -> its mangled name in the code object


def _check(result, what: str, program=None) -> tuple:
    from hip import hiprtc

    error, *values = result if isinstance(result, tuple) else (result,)
    if error != hiprtc.hiprtcResult.HIPRTC_SUCCESS:
        raise CompileError(f"rocm backend: {what} failed: {error.name}\n{_log(program) if program is not None else ''}")
    return tuple(values)


def _log(program) -> str:
    from hip import hiprtc

    _, size = hiprtc.hiprtcGetProgramLogSize(program)
    log = bytearray(size)
    hiprtc.hiprtcGetProgramLog(program, log)
    return bytes(log).decode(errors="replace").rstrip("\x00 \n")


def _candidates() -> list:
    """Where hiprtc may be, most specific first: the path hip-python resolves itself, torch's
    own ROCm libraries, the ROCm trees, then bare names for the system loader."""
    found = []
    try:
        from rocm.bindings.util import paths

        resolved = os.fsdecode(paths.get_library_path("hiprtc"))
        if os.path.isabs(resolved):
            found.append(resolved)
    except Exception:  # an older hip-python, or one whose lookup fails: the searches below remain
        pass
    folders = [Path(torch.__file__).parent / "lib"]
    folders += [Path(root) / "lib" for root in (os.environ.get("ROCM_PATH"), os.environ.get("ROCM_HOME"), "/opt/rocm") if root]
    for folder in folders:
        found += sorted(str(path) for path in folder.glob("libhiprtc.so*"))
    found += _SYSTEM_NAMES
    return list(dict.fromkeys(found))


@functools.lru_cache(maxsize=None)
def library() -> str:
    """The library hip-python's hiprtc calls go to in this process (see the module docstring)."""
    tried = []
    for candidate in _candidates():
        try:
            handle = ctypes.CDLL(candidate)
        except OSError:
            tried.append(candidate)
            continue
        if hasattr(handle, "hiprtcCreateProgram"):
            _point_hip_python_at(candidate)
            return candidate
        tried.append(f"{candidate} (has no hiprtc)")
    raise CompileError(
        f"rocm backend: no loadable hiprtc library (tried {', '.join(tried)}); "
        "install ROCm's hiprtc or a ROCm build of torch, or set ROCM_PATH"
    )


def _point_hip_python_at(path: str) -> None:
    try:
        from rocm.bindings.util import paths
    except ImportError:  # hip-python before 7 opens "libhiprtc.so" by name: load_error() says if that fails
        return
    original = paths.get_library_path
    if getattr(original, "ditops_hiprtc", None) is not None:
        original = original.wrapped

    def get_library_path(shortname, *args, **kwargs):
        return os.fsencode(path) if shortname == "hiprtc" else original(shortname, *args, **kwargs)

    get_library_path.ditops_hiprtc, get_library_path.wrapped = path, original
    paths.get_library_path = get_library_path


@functools.lru_cache(maxsize=None)
def load_error() -> Optional[str]:
    """None once hiprtc answers through hip-python in this process, else why it cannot."""
    try:
        from hip import hiprtc  # noqa: F401  (is hip-python installed at all)
    except ImportError as error:
        return f"needs hip-python (pip install 'ditops[rocm]'): {error}"
    try:
        version()
    except CompileError as error:
        return str(error)
    return None


@functools.lru_cache(maxsize=None)
def version() -> str:
    from hip import hiprtc

    path = library()
    try:
        major, minor = _check(hiprtc.hiprtcVersion(), "hiprtcVersion")
    except CompileError:
        raise
    except RuntimeError as error:  # the binding's own dlopen failure
        raise CompileError(f"rocm backend: hip-python cannot load hiprtc (found at {path}): {error}") from error
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=None)
def rocm_release() -> str:
    """The ROCm release ("5.2") of the HIP runtime that hip-python loads, whose hiprtc compiles
    here: which archs hiprtc knows follows the release, and hiprtcVersion cannot tell releases
    apart (ROCm 5.2's answers 9.0)."""
    from hip import hip

    error, number = hip.hipRuntimeGetVersion()  # HIP_VERSION: major * 10**7 + minor * 10**5 + patch
    if error != hip.hipError_t.hipSuccess:
        raise CompileError(f"rocm backend: hipRuntimeGetVersion failed: {error.name}")
    return f"{number // 10**7}.{number // 10**5 % 100}"


def compile_instances(instances: Sequence[Instance], arch: str) -> CodeObject:
    """Compiles instances of one source file together for arch ("gfx942")."""
    (source_name,) = {instance.source for instance in instances}
    hiprtc_version = version()  # loads hiprtc, or raises CompileError saying why not
    try:
        return _compile(instances, source_name, arch)
    except CompileError:
        raise
    except RuntimeError as error:  # anything else the binding raises, named as this backend's
        raise CompileError(f"rocm backend: hiprtc {hiprtc_version} failed on {source_name} for {arch}: {error}") from error


def _compile(instances: Sequence[Instance], source_name: str, arch: str) -> CodeObject:
    from hip import hiprtc

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

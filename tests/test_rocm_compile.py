"""Every ROCm kernel instance the registry can select compiles for AMD with no GPU: for gfx90a
through the backend's own path (hiprtc via hip-python), for gfx942 with clang-19 (hiprtc 5.2
crashes on gfx942; .ci/run installs the toolchain and says how hiprtc is found). Each must give a real code object: an ELF for
the AMDGPU machine and that arch, one wave64 kernel per instance, none using scratch memory.

CI installs Debian's ROCm 5.2 and clang-19 and sets DITOPS_REQUIRE_ROCM_TOOLS=1: there a
missing tool fails these tests; elsewhere it skips them with the reason.

Compiling every instance takes minutes on a CPU: it runs under ``-m exhaustive``; the default
run compiles one instance for gfx90a, and the FP8 kernels' instances of each format.
"""

import functools
import os
import shutil
import struct
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from ditops.backends.compiled import FP8_TYPES, ROW_KERNELS, SOURCES, all_instances, quantize_instance, row_instance

EM_AMDGPU = 224
MACHINES = {"gfx90a": 0x3F, "gfx942": 0x4C}  # EF_AMDGPU_MACH in the ELF flags
BITCODE = Path("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")  # Debian's rocm-device-libs

INSTANCES = defaultdict(list)
for _instance in all_instances():
    INSTANCES[_instance.source].append(_instance)


def unavailable(reason: str):
    if os.environ.get("DITOPS_REQUIRE_ROCM_TOOLS") == "1":
        pytest.fail(f"ROCm compile tools missing on a machine that requires them: {reason}")
    pytest.skip(reason)


def check_code_object(code: bytes, arch: str, kernel_names, count: int) -> None:
    assert code[:4] == b"\x7fELF"
    machine, = struct.unpack_from("<H", code, 18)
    flags, = struct.unpack_from("<I", code, 48)
    assert machine == EM_AMDGPU and flags & 0xFF == MACHINES[arch]
    for name in kernel_names:
        assert name.encode() in code, f"{name} missing"
    # Kernel metadata is msgpack: a fixstr key, then the value as a positive fixint.
    assert code.count(b"\xaf.wavefront_size\x40") == count, "every kernel must be wave64"
    assert code.count(b"\xbb.private_segment_fixed_size\x00") == count, "a kernel uses scratch memory"


def hiprtc_module():
    try:
        from ditops.backends.rocm import hiprtc

        hiprtc.version()
    except (ImportError, OSError, RuntimeError) as error:
        unavailable(f"hiprtc through hip-python: {error}")
    return hiprtc


@functools.lru_cache(maxsize=None)
def gfx90a_code_object(source: str):
    return hiprtc_module().compile_instances(INSTANCES[source], "gfx90a")


def test_hiprtc_compiles_an_instance_for_gfx90a():
    """The default run's smoke compile: one instance of the rotary kernel (the quickest source)."""
    compiled = hiprtc_module().compile_instances(INSTANCES["rotary.cu"][:1], "gfx90a")
    check_code_object(compiled.code, "gfx90a", compiled.lowered_names.values(), 1)


def test_hiprtc_compiles_the_fp8_kernels_for_gfx90a():
    """The default run's FP8 smoke compile: each FP8 kernel in each format (fp8.cuh's software
    conversion, the only one on AMD), with and without GELU, an affine and a prefix."""
    instances = {f"{kernel}.cu": [row_instance(kernel, torch.bfloat16, torch.bfloat16, 3072, affine, fp8_dtype)
                                  for affine, fp8_dtype in zip((False, True), FP8_TYPES)] for kernel in ROW_KERNELS}
    instances["row_quantize.cu"] = [quantize_instance(torch.float16, fp8_dtype, gelu, 12288 + 3072 * prefix, prefix)
                                    for gelu, fp8_dtype, prefix in zip((True, False), FP8_TYPES, (True, False))]
    for source, chosen in instances.items():
        compiled = hiprtc_module().compile_instances(chosen, "gfx90a")
        check_code_object(compiled.code, "gfx90a", compiled.lowered_names.values(), len(chosen))


@pytest.mark.exhaustive
@pytest.mark.parametrize("source", sorted(INSTANCES))
def test_hiprtc_compiles_every_instance_for_gfx90a(source):
    compiled = gfx90a_code_object(source)
    check_code_object(compiled.code, "gfx90a", compiled.lowered_names.values(), len(INSTANCES[source]))


@pytest.fixture(scope="module")
def gfx942_bitcode(tmp_path_factory) -> Path:
    """ROCm 5.2's device libraries plus the gfx942 ISA-version file they lack, derived from
    gfx940's (the same file with the version number 9402)."""
    tools = [shutil.which(tool) for tool in ("clang++-19", "llvm-dis-19", "llvm-as-19")]
    if not all(tools) or not (BITCODE / "oclc_isa_version_940.bc").is_file():
        unavailable("clang-19, llvm-19 and rocm-device-libs (apt) are needed for gfx942")
    folder = tmp_path_factory.mktemp("bitcode")
    for library in BITCODE.glob("*.bc"):
        (folder / library.name).symlink_to(library)
    text = subprocess.run(["llvm-dis-19", str(BITCODE / "oclc_isa_version_940.bc"), "-o", "-"],
                          check=True, capture_output=True, text=True).stdout
    subprocess.run(["llvm-as-19", "-o", str(folder / "oclc_isa_version_942.bc")],
                   input=text.replace("i32 9400", "i32 9402"), check=True, text=True)
    return folder


@pytest.mark.exhaustive
@pytest.mark.parametrize("source", sorted(INSTANCES))
def test_clang_compiles_every_instance_for_gfx942(source, gfx942_bitcode, tmp_path):
    # Taking each instance's address in host code makes clang emit it for the device.
    wrapper = tmp_path / "instances.hip"
    references = "".join(f"    (void)&{instance.name_expression};\n" for instance in INSTANCES[source])
    wrapper.write_text(f'#include "{source}"\nvoid ditops_instances() {{\n{references}}}\n')
    output = tmp_path / "instances.hsaco"
    subprocess.run(
        ["clang++-19", "-x", "hip", "--offload-arch=gfx942", "--cuda-device-only", "--no-gpu-bundle-output", "-O3",
         "-std=c++17", "--rocm-path=/usr", f"--rocm-device-lib-path={gfx942_bitcode}", f"-I{SOURCES}",
         "-c", str(wrapper), "-o", str(output)],
        check=True, capture_output=True, text=True,
    )
    names = gfx90a_code_object(source).lowered_names.values()  # mangled names do not depend on the arch
    check_code_object(output.read_bytes(), "gfx942", names, len(INSTANCES[source]))

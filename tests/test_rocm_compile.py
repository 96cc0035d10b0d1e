"""Every ROCm kernel instance the registry can select compiles for AMD with no GPU: for gfx90a
through the backend's own path (hiprtc via hip-python), for gfx942 with clang-19 (hiprtc 5.2
crashes on gfx942; .ci/run installs the toolchain and says how hiprtc is found). Each must give a real code object: an ELF for
the AMDGPU machine and that arch, one wave64 kernel per instance, none using scratch memory.

CI installs Debian's ROCm 5.2 and clang-19 and sets DITOPS_REQUIRE_ROCM_TOOLS=1: there a
missing tool fails these tests; elsewhere it skips them with the reason.

On AMD some instances are one kernel up to constants (``amd_shape``): the two FP8 formats run
the same software conversion (fp8.cuh) with another bias, largest value and NaN, and the rotary
kernel's streaming hint is a plain load and store (portability.cuh). Each arch compiles every
such shape once, the two archs taking the shape's other instance where it has two, so that
every instance compiles for AMD and every shape for each arch.

Compiling takes minutes on a CPU: it runs under ``-m exhaustive``, one batch (one compiler
run) per source file and activation dtype; the default run compiles one instance for gfx90a,
and the FP8 kernels' instances of each format.
"""

import os
import shutil
import struct
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from ditops.backends.compiled import (C_TYPES, FP8_TYPES, ROW_KERNELS, SOURCES, all_instances, quantize_instance,
                                      row_instance)

EM_AMDGPU = 224
MACHINES = {"gfx90a": 0x3F, "gfx942": 0x4C}  # EF_AMDGPU_MACH in the ELF flags
BITCODE = Path("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode")  # Debian's rocm-device-libs

ARCHS = ("gfx90a", "gfx942")


def amd_shape(instance) -> tuple:
    """The instance with what AMD compiles to the same code but for constants left out: the
    FP8 format, and the rotary kernel's STREAMING flag."""
    arguments = tuple("fp8" if argument in FP8_TYPES.values() else argument for argument in instance.template_arguments)
    if instance.kernel == "rotary":
        arguments = arguments[:5] + ("streaming",) + arguments[6:]
    return (instance.kernel, arguments)


def arch_instances() -> dict:
    """arch -> source -> activation type -> the instances that arch compiles: one of each
    shape, the shapes' instances taken in turn by the two archs."""
    shapes = defaultdict(list)
    for instance in all_instances():
        shapes[amd_shape(instance)].append(instance)
    chosen = {arch: defaultdict(lambda: defaultdict(list)) for arch in ARCHS}
    for number, members in enumerate(shapes.values()):
        for turn, arch in enumerate(ARCHS):
            instance = members[(number + turn) % len(members)]
            chosen[arch][instance.source][instance.template_arguments[0]].append(instance)
    return chosen


INSTANCES = arch_instances()
BATCHES = [(source, dtype) for source in sorted(INSTANCES["gfx90a"]) for dtype in C_TYPES.values()]


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


def test_hiprtc_compiles_an_instance_for_gfx90a():
    """The default run's smoke compile: one instance of the rotary kernel (the quickest source)."""
    compiled = hiprtc_module().compile_instances(INSTANCES["gfx90a"]["rotary.cu"]["float"][:1], "gfx90a")
    check_code_object(compiled.code, "gfx90a", compiled.lowered_names.values(), 1)


def test_every_instance_compiles_for_an_amd_arch_and_every_shape_for_each():
    everything = all_instances()
    for arch in ARCHS:
        compiled = [instance for source in INSTANCES[arch].values() for batch in source.values() for instance in batch]
        assert len(compiled) == len(set(compiled))
        assert {amd_shape(instance) for instance in compiled} == {amd_shape(instance) for instance in everything}, arch
        assert {batch for batch in BATCHES if INSTANCES[arch][batch[0]][batch[1]]} == set(BATCHES), arch
    together = {instance for arch in ARCHS for source in INSTANCES[arch].values() for batch in source.values()
                for instance in batch}
    assert together == set(everything)
    # both formats and both streaming flags on each arch, not one per arch
    for arch in ARCHS:
        arguments = {argument for source in INSTANCES[arch].values() for batch in source.values() for instance in batch
                     for argument in instance.template_arguments}
        assert set(FP8_TYPES.values()) <= arguments, arch
        rotary = {instance.template_arguments[5] for batch in INSTANCES[arch]["rotary.cu"].values() for instance in batch
                  if instance.kernel == "rotary"}
        assert rotary == {"true", "false"}, arch


def test_what_amd_shape_leaves_out_is_constants_on_amd():
    """amd_shape holds while AMD converts every FP8 format with fp8.cuh's one template and has
    no cache hints: a platform specialisation of either would make them different kernels."""
    amd = (SOURCES / "portability.cuh").read_text().split("\n#else\n")[0]
    assert "fp8_bits<" not in amd
    plain = ("load_streaming(const uint4* address) { return *address; }",
             "store_streaming(uint4* address, const uint4& value) { *address = value; }")
    assert all(definition in amd for definition in plain)


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
@pytest.mark.parametrize("source, dtype", BATCHES)
def test_hiprtc_compiles_every_shape_for_gfx90a(source, dtype):
    instances = INSTANCES["gfx90a"][source][dtype]
    compiled = hiprtc_module().compile_instances(instances, "gfx90a")
    check_code_object(compiled.code, "gfx90a", compiled.lowered_names.values(), len(instances))


@pytest.fixture(scope="module")
def gfx942_bitcode(tmp_path_factory) -> Path:
    """ROCm 5.2's device libraries plus the gfx942 ISA-version file they lack, derived from
    gfx940's (the same file with the version number 9402)."""
    tools = [shutil.which(tool) for tool in ("clang++-19", "llvm-dis-19", "llvm-as-19", "llvm-nm-19")]
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


def kernel_templates(code_object: Path) -> list:
    """The kernels a code object defines, as their template instances are spelled
    (``modulated_norm<float, float16, true, 64, 4, 128, 1, float>``): the AMD types are structs,
    so the demangled names spell them as the instances do."""
    symbols = subprocess.run(["llvm-nm-19", "--demangle", "--defined-only", str(code_object)],
                             check=True, capture_output=True, text=True).stdout
    fields = [line.split(" ", 2) for line in symbols.splitlines()]
    return [name.removeprefix("void ").partition("(")[0] for _, kind, name in fields if kind == "T"]


@pytest.mark.exhaustive
@pytest.mark.parametrize("source, dtype", BATCHES)
def test_clang_compiles_every_shape_for_gfx942(source, dtype, gfx942_bitcode, tmp_path):
    instances = INSTANCES["gfx942"][source][dtype]
    # Taking each instance's address in host code makes clang emit it for the device.
    wrapper = tmp_path / "instances.hip"
    references = "".join(f"    (void)&{instance.name_expression};\n" for instance in instances)
    wrapper.write_text(f'#include "{source}"\nvoid ditops_instances() {{\n{references}}}\n')
    output = tmp_path / "instances.hsaco"
    subprocess.run(
        ["clang++-19", "-x", "hip", "--offload-arch=gfx942", "--cuda-device-only", "--no-gpu-bundle-output", "-O3",
         "-std=c++17", "--rocm-path=/usr", f"--rocm-device-lib-path={gfx942_bitcode}", f"-I{SOURCES}",
         "-c", str(wrapper), "-o", str(output)],
        check=True, capture_output=True, text=True,
    )
    assert sorted(kernel_templates(output)) == sorted(instance.name_expression for instance in instances)
    check_code_object(output.read_bytes(), "gfx942", (), len(instances))

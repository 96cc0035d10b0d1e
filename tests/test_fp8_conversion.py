"""The software float -> FP8 conversion of ditops/csrc/fp8.cuh (the ROCm kernels' in every
format, and the CUDA kernels' for e4m3fnuz), compiled as host C++ with g++ and checked against
torch's casts: rounding to nearest even, saturation to +-fmax (infinities too), NaN, and the
signed zeros of each format. Inputs: every float32 whose low 8 bits are 0x00, 0x01 or 0xff, so
each rounding boundary of the formats (all lie on multiples of 2^8 in the bits) is met exactly
and one float step either side."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ditops.backends.compiled import FP8_TYPES, SOURCES

HARNESS = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
// What fp8.cuh takes from CUDA or HIP, for the host.
#define __device__
inline unsigned __float_as_uint(float value) { unsigned bits; std::memcpy(&bits, &value, 4); return bits; }
inline float __uint_as_float(unsigned bits) { float value; std::memcpy(&value, &bits, 4); return value; }
#include "fp8.cuh"

// Writes the codes of every float (i << 8) | low, i < 2^24, for each low of argv[2..], to argv[1].
int main(int argc, char** argv) {
    std::vector<unsigned char> codes;
    for (int a = 2; a < argc; ++a) {
        const unsigned low = std::strtoul(argv[a], nullptr, 0);
        for (unsigned i = 0; i < (1u << 24); ++i)
            codes.push_back(float_to_fp8_bits<FORMAT>(__uint_as_float((i << 8) | low)));
    }
    FILE* file = std::fopen(argv[1], "wb");
    return std::fwrite(codes.data(), 1, codes.size(), file) == codes.size() && std::fclose(file) == 0 ? 0 : 1;
}
"""
LOWS = (0x00, 0x01, 0xFF)


def _inputs() -> torch.Tensor:
    high = torch.arange(1 << 24, dtype=torch.int64) << 8
    return torch.cat([(high | low).to(torch.int32) for low in LOWS]).view(torch.float32)


@pytest.mark.parametrize("fp8_dtype", list(FP8_TYPES), ids=lambda dtype: str(dtype).removeprefix("torch."))
def test_software_conversion_matches_torch(fp8_dtype, tmp_path: Path):
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler (g++ or clang++)")
    source, program, output = tmp_path / "harness.cpp", tmp_path / "harness", tmp_path / "codes.bin"
    source.write_text(HARNESS)
    build = subprocess.run([compiler, "-std=c++17", "-O2", f"-I{SOURCES}", f"-DFORMAT={FP8_TYPES[fp8_dtype]}", str(source),
                            "-o", str(program)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    subprocess.run([str(program), str(output), *map(hex, LOWS)], check=True)
    codes = torch.frombuffer(bytearray(output.read_bytes()), dtype=torch.uint8)

    values = _inputs()
    fmax = torch.finfo(fp8_dtype).max
    saturated = torch.where(values > fmax, fmax, torch.where(values < -fmax, -fmax, values))  # NaN stays NaN
    expected = saturated.to(fp8_dtype).view(torch.uint8)
    nan = values.isnan()
    assert codes.shape == expected.shape
    assert torch.equal(codes[~nan], expected[~nan]), _first_difference(values, codes, expected, ~nan)
    nan_code = 0x7F if fp8_dtype == torch.float8_e4m3fn else 0x80  # torch keeps NaN's sign in e4m3fn; CUDA's hardware does not
    assert bool((codes[nan] == nan_code).all())


def _first_difference(values, codes, expected, where) -> str:
    index = int(((codes != expected) & where).nonzero()[0])
    return f"{float(values[index])!r} (bits {int(values.view(torch.int32)[index]) & 0xFFFFFFFF:#010x}): " \
           f"{int(codes[index]):#04x}, torch {int(expected[index]):#04x}"

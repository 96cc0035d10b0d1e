"""The kernels of ditops/csrc differ between NVIDIA and AMD only through portability.cuh:
no other file may hard-code a warp width of 32 or a 32-lane mask."""

import re
from pathlib import Path

import pytest

from ditops.backends.compiled import SOURCES

KERNEL_FILES = sorted(path for path in SOURCES.glob("*.cu*") if path.name != "portability.cuh")


def code_without_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda path: path.name)
def test_no_warp_width_outside_the_portability_header(path: Path):
    code = code_without_comments(path.read_text())
    assert not re.search(r"\b32\b", code), "a literal 32: use kWarpSize"
    assert not re.search(r"0x[fF]{8}", code), "a 32-lane mask: use the portability header's exchanges"
    assert "__shfl" not in code, "lane exchanges go through shuffle / shuffle_xor"


def test_the_header_defines_the_width_once_per_vendor():
    header = code_without_comments((SOURCES / "portability.cuh").read_text())
    assert header.count("constexpr int kWarpSize") == 2
    assert "constexpr int kWarpSize = 64" in header and "constexpr int kWarpSize = 32" in header


def test_the_checker_catches_a_hard_coded_width():
    assert re.search(r"\b32\b", code_without_comments("value += shuffle_xor(value, 32 / 2); // 32 lanes"))
    assert not re.search(r"\b32\b", code_without_comments("// a 32-bit index\nint lane = threadIdx.x % kWarpSize;"))

"""Compiles Triton kernel specializations ahead of time for one target, with no GPU.

Usage: python tests/triton_aot.py BACKEND ARCH WARP_SIZE BINARY < specializations.json
(BACKEND cuda or hip; ARCH 90 or gfx942; BINARY cubin or hsaco). Each specialization is
{kernel, signature, constants, num_warps}; prints one line per compiled kernel and fails on
the first one whose machine code is not an ELF object. Run by tests/test_triton_compile.py.

BINARY ttgir prints, per kernel, the float64 operations of its Triton GPU IR instead
("float64 ops: N"): the function's signature and a conversion of an argument to float32
are not operations on float64 values.
"""

import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import ditops.backends.triton as triton_backend


def main() -> int:
    backend, arch, warp_size, binary = sys.argv[1:5]
    target = GPUTarget(backend, int(arch) if arch.isdigit() else arch, int(warp_size))
    for item in json.load(sys.stdin):
        kernel = getattr(triton_backend, item["kernel"])
        source = ASTSource(kernel, item["signature"], item["constants"])
        code = triton.compile(source, target=target, options={"num_warps": item["num_warps"]}).asm[binary]
        if binary == "ttgir":
            operations = [line for line in code.splitlines()
                          if "f64" in line and "tt.func" not in line and "arith.truncf" not in line]
            print(f"{item['kernel']} float64 ops: {len(operations)}", *operations[:3], sep="\n")
            continue
        if not (isinstance(code, bytes) and code[:4] == b"\x7fELF"):
            print(f"no {binary} for {item['kernel']} {item['constants']}")
            return 1
        print(f"compiled {item['kernel']} num_warps={item['num_warps']} {len(code)} bytes of {binary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

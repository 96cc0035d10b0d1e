"""Registers, spills and machine instructions of one CUDA kernel instance, with no GPU: the
screen to run on a kernel change before spending GPU time on it. The row kernels' speed
follows their registers (occupancy) and instructions per element (benchmarks/README.md, "Why
the FP8 rows miss the copy on the H200"). Compiles with NVRTC like the cuda backend; with
--sass also disassembles the cubin with nvdisasm (`pip install nvidia-cuda-nvdisasm`) and
counts the instructions by opcode. Usage:
  python scripts/cuda_instance_stats.py modulated_norm --hidden 3072 --affine --sass
  python scripts/cuda_instance_stats.py modulated_norm --hidden 3072 --fp8 float8_e4m3fn
  python scripts/cuda_instance_stats.py rotary --head-size 128 --dtype float16
"""

import argparse
import collections
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch

from ditops.backends import compiled
from ditops.backends.cuda import nvrtc


def nvdisasm() -> str:
    """The nvdisasm of the nvidia-cuda-nvdisasm wheel, else one on PATH."""
    wheel = sorted(Path(sysconfig.get_paths()["purelib"]).glob("nvidia/cu*/bin/nvdisasm"))
    found = str(wheel[0]) if wheel else shutil.which("nvdisasm")
    if found is None:
        sys.exit("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    return found


def instruction_counts(cubin: bytes) -> collections.Counter:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        listing = subprocess.run([nvdisasm(), "-c", file.name], capture_output=True, text=True, check=True).stdout
    # lines such as "  /*0040*/  @!P0 LDG.E.128.CONSTANT R4, desc[UR6][R2.64] ;": the opcode without its predicate and modifiers
    opcodes = [re.sub(r"^@!?U?P\w+\s+", "", line.split("*/", 1)[1].strip()).split()[0].split(".")[0]
               for line in listing.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line)]
    return collections.Counter(opcodes)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=[*compiled.ROW_KERNELS, "rotary"])
    parser.add_argument("--dtype", default="bfloat16", help="activation dtype")
    parser.add_argument("--param-dtype", default=None, help="weights and modulation (row kernels; default: --dtype)")
    parser.add_argument("--hidden", type=int, default=3072, help="D (row kernels)")
    parser.add_argument("--affine", action="store_true", help="the instance for calls with a norm weight or bias")
    parser.add_argument("--fp8", default=None, help="y in this FP8 format (the row kernels' _fp8 forms), e.g. float8_e4m3fn")
    parser.add_argument("--head-size", type=int, default=128, help="Dh (rotary)")
    parser.add_argument("--neox", action="store_true", help="the NeoX instance (rotary; default: interleaved)")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--sass", action="store_true", help="count machine instructions (needs nvdisasm)")
    arguments = parser.parse_args()
    dtype = getattr(torch, arguments.dtype)
    if arguments.kernel == "rotary":
        instance = compiled.rotary_instance(dtype, arguments.head_size, not arguments.neox)
    else:
        param_dtype = getattr(torch, arguments.param_dtype or arguments.dtype)
        instance = compiled.row_instance(arguments.kernel, dtype, param_dtype, arguments.hidden, arguments.affine,
                                       getattr(torch, arguments.fp8) if arguments.fp8 else None)
    result = nvrtc.compile_instance(instance, arguments.arch)
    print(f"{instance.name_expression} for {arguments.arch}: {result.registers} registers, "
          f"{result.spill_bytes} bytes of spills, {result.stack_bytes} bytes of stack, block {instance.block}")
    if arguments.sass:
        counts = instruction_counts(result.cubin)
        print(f"{sum(counts.values())} instructions:", ", ".join(f"{op} {n}" for op, n in counts.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Launch one bench case's op a few times with one backend, for a profiler (ncu) to attach to.
Usage: ncu --clock-control none --launch-skip 2 --launch-count 1 ... \\
           python benchmarks/profile_kernels.py cuda norm_scale_shift "HunyuanVideo 720p"
"""

import sys

import torch

from ditops.bench.cases import CASES
from ditops.ops import PUBLIC


def main() -> None:
    backend, op, model = sys.argv[1:4]
    case = next(c for c in CASES if c.op == op and c.model == model)
    arguments = case.build("cuda", torch.bfloat16, torch.Generator(device="cuda").manual_seed(0))
    for _ in range(4):
        PUBLIC[op](**arguments, backend=backend)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()

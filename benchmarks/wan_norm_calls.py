"""The norm calls that ditops.integrations.diffusers makes in a Wan2.1-1.3B block (32760 tokens,
D = 1536), with their real argument forms (float32 modulation chunks, scalar zeros, bf16
weights), per backend: CUDA-graph time with rotating inputs and % of a 4266 GB/s copy (H200).
It found the per-column load of scalar modulation in the Triton row kernels (row_math.py).
Usage: python benchmarks/wan_norm_calls.py
"""
import torch

import ditops
from ditops.bench.timing import cuda_graph

COPY = 4266e9  # bytes/s, the H200's measured copy bandwidth (benchmarks/results)
S, D = 32760, 1536
bf = dict(device="cuda", dtype=torch.bfloat16)
def r(*s, **k): return torch.randn(*s, **(k or bf))
table = r(1, 6, D, device="cuda", dtype=torch.float32)
chunks = table.chunk(6, dim=1)
w, b = r(D), r(D)
zero32 = torch.zeros((), device="cuda"); zero16 = torch.zeros((), **bf)
cases = {
  "norm1 fp32 [1,1,D] mod": (lambda x, y: ditops.norm_scale_shift(x, chunks[1], chunks[0], eps=1e-6, backend=B), 2),
  "rms q, bf16 zero scalars, bf16 weight": (lambda x, y: ditops.norm_scale_shift(x, zero16, zero16, weight=w, norm="rms", backend=B), 2),
  "norm2 residual, fp32 gate, fp32 zeros, bf16 w/b": (lambda x, y: ditops.residual_norm_scale_shift(x, y, chunks[2], zero32, zero32, weight=w, bias=b, backend=B), 4),
  "norm3 residual, no gate, fp32 mod": (lambda x, y: ditops.residual_norm_scale_shift(x, y, None, chunks[4], chunks[3], backend=B), 4),
  "norm1 bf16 [1,D] mod (bench form)": (lambda x, y: ditops.norm_scale_shift(x, chunks[1][0].bfloat16(), chunks[0][0].bfloat16(), backend=B), 2),
}
for name, (f, tensors) in cases.items():
    for B in ("triton", "cuda"):
        sets = [(r(1, S, D), r(1, S, D)) for _ in range(4)]
        try:
            t = cuda_graph([lambda x=x, y=y: f(x, y) for x, y in sets])
        except Exception as e:
            print(f"{name:50s} {B:7s} refused: {str(e).splitlines()[0][:80]}"); continue
        print(f"{name:50s} {B:7s} {t.us:8.1f} us {tensors * S * D * 2 / t.us / 1e-6 / COPY * 100:5.1f}% of copy")

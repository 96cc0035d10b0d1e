"""Pieces shared by the row kernels. A program holds a [ROWS, BLOCK] tile: ROWS rows (one
token's D values each) in registers. Rows of one program share their modulation vectors
when they belong to one batch item, so those loads hit L1 instead of going to L2 per row."""

import triton
import triton.language as tl


@triton.jit
def load_modulation(pointer, batch, token, batch_stride, group_stride, group_size, dim_stride, columns, mask):
    """The modulation vectors of rows (batch, token) ([ROWS, 1] each), as a float32 tile.

    Every form of OPS.md is one addressing rule: a scalar has all strides 0, a [D] vector only
    dim_stride, a per-batch vector a batch_stride, a per-token one a group_stride with
    group_size 1, and a per-frame one a group_stride with group_size = S // F tokens."""
    offset = batch * batch_stride + (token // group_size) * group_stride
    return tl.load(pointer + offset + columns * dim_stride, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def normalize(v, mask, hidden, eps, weight_pointer, bias_pointer, columns,
              RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """LayerNorm (biased variance) or RMSNorm of each float32 row of a tile, then the optional affine."""
    if RMS:
        normalized = v * tl.rsqrt(tl.sum(v * v, axis=1)[:, None] / hidden + eps)
    else:
        mean = tl.sum(v, axis=1)[:, None] / hidden
        centered = tl.where(mask, v - mean, 0.0)
        normalized = centered * tl.rsqrt(tl.sum(centered * centered, axis=1)[:, None] / hidden + eps)
    if HAS_WEIGHT:
        normalized = normalized * tl.load(weight_pointer + columns, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        normalized = normalized + tl.load(bias_pointer + columns, mask=mask, other=0.0).to(tl.float32)
    return normalized

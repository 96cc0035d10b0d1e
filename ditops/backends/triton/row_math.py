"""Pieces shared by the row kernels (one token's D values per row): loading a modulation
vector in any of its forms, and LayerNorm / RMSNorm of a row held in registers."""

import triton
import triton.language as tl


@triton.jit
def load_modulation(pointer, batch, token, batch_stride, group_stride, group_size, dim_stride, columns, mask):
    """The modulation vector of row (batch, token), as float32.

    Every form of OPS.md is one addressing rule: a scalar has all strides 0, a [D] vector only
    dim_stride, a per-batch vector a batch_stride, a per-token one a group_stride with
    group_size 1, and a per-frame one a group_stride with group_size = S // F tokens."""
    offset = batch * batch_stride + (token // group_size) * group_stride
    return tl.load(pointer + offset + columns * dim_stride, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def normalize(v, mask, hidden, eps, weight_pointer, bias_pointer, columns,
              RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """LayerNorm (biased variance) or RMSNorm of a float32 row, then the optional affine."""
    if RMS:
        normalized = v * tl.rsqrt(tl.sum(v * v, axis=0) / hidden + eps)
    else:
        mean = tl.sum(v, axis=0) / hidden
        centered = tl.where(mask, v - mean, 0.0)
        normalized = centered * tl.rsqrt(tl.sum(centered * centered, axis=0) / hidden + eps)
    if HAS_WEIGHT:
        normalized = normalized * tl.load(weight_pointer + columns, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        normalized = normalized + tl.load(bias_pointer + columns, mask=mask, other=0.0).to(tl.float32)
    return normalized

"""Pieces shared by the row kernels. A program holds a [ROWS, BLOCK] tile: ROWS rows (one
token's D values each) in registers. Rows of one program share their modulation vectors
when they belong to one batch item, so those loads hit L1 instead of going to L2 per row."""

import triton
import triton.language as tl


@triton.jit
def row_tile(rows, tokens, hidden, BLOCK: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
    """This program's rows: (columns [1, BLOCK], row, batch, token [ROWS, 1], mask [ROWS, BLOCK])."""
    columns = tl.arange(0, BLOCK)[None, :]
    row = tl.program_id(0).to(tl.int64) * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)[:, None]
    mask = columns < tl.where(row < rows, hidden, 0)  # rows past the last one touch nothing
    addressed = tl.minimum(row, rows - 1)  # and address the last one, so one unmasked load per row stays in bounds
    return columns, row, addressed // tokens, addressed % tokens, mask


@triton.jit
def load_rows(pointer, batch, token, batch_stride, token_stride, columns, mask):
    """Rows (batch, token) of an activation whose last dimension has stride 1, as float32."""
    return tl.load(pointer + batch * batch_stride + token * token_stride + columns, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def load_modulation(pointer, batch, token, batch_stride, group_stride, group_size, DIM_STRIDE: tl.constexpr, columns,
                    mask):
    """The modulation vectors of rows (batch, token) ([ROWS, 1] each), as a float32 tile.

    Every form of OPS.md is one addressing rule: a scalar has all strides 0, a [D] vector only
    DIM_STRIDE, a per-batch vector a batch_stride, a per-token one a group_stride with
    group_size 1, and a per-frame one a group_stride with group_size = S // F tokens.
    DIM_STRIDE is a constexpr so that a value shared by all columns (a scalar: 0) is one load
    per row, broadcast: read per column, it cost a scalar-modulated RMSNorm at D = 1536 a
    third of its bandwidth on an H200 (52% of copy against 86% with vectors)."""
    offset = batch * batch_stride + (token // group_size) * group_stride
    if DIM_STRIDE == 0:
        values = tl.load(pointer + offset)  # [ROWS, 1]
    else:
        values = tl.load(pointer + offset + columns * DIM_STRIDE, mask=mask, other=0.0)
    return values.to(tl.float32)


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

"""y = norm(v) * (1 + scale) + shift, where v = x, or v = residual + gate * x stored first as
residual_out (ops 1 and 2). A program normalises ROWS_PER_PROGRAM rows held in registers: every element
is read once and written once."""

import triton
import triton.language as tl

from .row_math import load_modulation, load_rows, normalize, row_tile


@triton.jit
def modulated_norm_kernel(
    x, x_batch_stride, x_token_stride,
    residual, residual_batch_stride, residual_token_stride,
    gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE: tl.constexpr,
    scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE: tl.constexpr,
    shift, shift_batch_stride, shift_group_stride, shift_group_size, SHIFT_DIM_STRIDE: tl.constexpr,
    weight, bias, y, residual_out,
    rows, tokens, hidden, eps,
    RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):
    columns, row, batch, token, mask = row_tile(rows, tokens, hidden, BLOCK, ROWS_PER_PROGRAM)
    v = load_rows(x, batch, token, x_batch_stride, x_token_stride, columns, mask)
    if HAS_RESIDUAL:
        summand = v
        if HAS_GATE:
            summand = summand * load_modulation(gate, batch, token, gate_batch_stride, gate_group_stride,
                                                gate_group_size, GATE_DIM_STRIDE, columns, mask)
        previous = load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, columns, mask)
        stored = (previous + summand).to(residual_out.dtype.element_ty)  # the norm reads it as stored
        tl.store(residual_out + row * hidden + columns, stored, mask=mask)
        v = stored.to(tl.float32)
    normalized = normalize(v, mask, hidden, eps, weight, bias, columns, RMS, HAS_WEIGHT, HAS_BIAS)
    scale_row = load_modulation(scale, batch, token, scale_batch_stride, scale_group_stride, scale_group_size,
                                SCALE_DIM_STRIDE, columns, mask)
    shift_row = load_modulation(shift, batch, token, shift_batch_stride, shift_group_stride, shift_group_size,
                                SHIFT_DIM_STRIDE, columns, mask)
    result = normalized * (1.0 + scale_row) + shift_row
    tl.store(y + row * hidden + columns, result.to(y.dtype.element_ty), mask=mask)

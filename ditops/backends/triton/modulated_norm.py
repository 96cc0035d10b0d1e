"""y = norm(v) * (1 + scale) + shift, where v = x, or v = residual + gate * x stored first as
residual_out (ops 1 and 2). A program normalises ROWS_PER_PROGRAM rows held in registers as a
head and a tail tile (row_math.py): every element is read once and written once."""

import triton
import triton.language as tl

from .row_math import affine, load_modulation, load_rows, normalize, row_tile, store_rows


@triton.jit
def _add_residual(v, residual, residual_batch_stride, residual_token_stride,
                  gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE: tl.constexpr,
                  residual_out, row, batch, token, hidden, columns, mask, HAS_GATE: tl.constexpr):
    """residual + gate * v over one tile, stored to residual_out and returned as stored."""
    if HAS_GATE:
        v = v * load_modulation(gate, batch, token, gate_batch_stride, gate_group_stride, gate_group_size,
                                GATE_DIM_STRIDE, columns, mask)
    summed = load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, columns, mask) + v
    return store_rows(residual_out, row, hidden, summed, columns, mask)


@triton.jit
def _modulation(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE: tl.constexpr,
                shift, shift_batch_stride, shift_group_stride, shift_group_size, SHIFT_DIM_STRIDE: tl.constexpr,
                batch, token, columns, mask):
    """(1 + scale, shift) over one tile."""
    scale_row = load_modulation(scale, batch, token, scale_batch_stride, scale_group_stride, scale_group_size,
                                SCALE_DIM_STRIDE, columns, mask)
    shift_row = load_modulation(shift, batch, token, shift_batch_stride, shift_group_stride, shift_group_size,
                                SHIFT_DIM_STRIDE, columns, mask)
    return 1.0 + scale_row, shift_row


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
    BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, EARLY_LOADS: tl.constexpr,
):
    head, head_mask, tail, tail_mask, row, batch, token = row_tile(rows, tokens, hidden, BLOCK, TAIL, ROWS_PER_PROGRAM)
    v = load_rows(x, batch, token, x_batch_stride, x_token_stride, head, head_mask)
    v_tail = load_rows(x, batch, token, x_batch_stride, x_token_stride, tail, tail_mask)
    if HAS_RESIDUAL:
        v = _add_residual(v, residual, residual_batch_stride, residual_token_stride,
                          gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                          residual_out, row, batch, token, hidden, head, head_mask, HAS_GATE)
        v_tail = _add_residual(v_tail, residual, residual_batch_stride, residual_token_stride,
                               gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                               residual_out, row, batch, token, hidden, tail, tail_mask, HAS_GATE)
    if EARLY_LOADS:
        scale_row, shift_row = _modulation(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                                           shift, shift_batch_stride, shift_group_stride, shift_group_size, SHIFT_DIM_STRIDE,
                                           batch, token, head, head_mask)
        scale_tail, shift_tail = _modulation(scale, scale_batch_stride, scale_group_stride, scale_group_size,
                                             SCALE_DIM_STRIDE, shift, shift_batch_stride, shift_group_stride,
                                             shift_group_size, SHIFT_DIM_STRIDE, batch, token, tail, tail_mask)
    v, v_tail = normalize(v, v_tail, head_mask, tail_mask, hidden, eps, RMS)
    if not EARLY_LOADS:
        scale_row, shift_row = _modulation(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                                           shift, shift_batch_stride, shift_group_stride, shift_group_size, SHIFT_DIM_STRIDE,
                                           batch, token, head, head_mask)
    v = affine(v, weight, bias, head, head_mask, HAS_WEIGHT, HAS_BIAS)
    store_rows(y, row, hidden, v * scale_row + shift_row, head, head_mask)
    if not EARLY_LOADS:
        scale_tail, shift_tail = _modulation(scale, scale_batch_stride, scale_group_stride, scale_group_size,
                                             SCALE_DIM_STRIDE, shift, shift_batch_stride, shift_group_stride,
                                             shift_group_size, SHIFT_DIM_STRIDE, batch, token, tail, tail_mask)
    v_tail = affine(v_tail, weight, bias, tail, tail_mask, HAS_WEIGHT, HAS_BIAS)
    store_rows(y, row, hidden, v_tail * scale_tail + shift_tail, tail, tail_mask)

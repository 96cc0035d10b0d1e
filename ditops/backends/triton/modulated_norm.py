"""y = norm(v) * (1 + scale) + shift, where v = x, or v = residual + gate * x stored first as
residual_out (ops 1 and 2). A program normalises ROWS_PER_PROGRAM rows held in registers as a
head and a tail tile (row_math.py): every element is read once and written once."""

import triton
import triton.language as tl

from .row_math import affine, load_modulation, load_parameter, load_rows, normalize, row_tile, store_rows


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
    BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):
    head, head_mask, tail, tail_mask, row, batch, token = row_tile(rows, tokens, hidden, BLOCK, TAIL, ROWS_PER_PROGRAM)
    v = load_rows(x, batch, token, x_batch_stride, x_token_stride, head, head_mask)
    v_tail = load_rows(x, batch, token, x_batch_stride, x_token_stride, tail, tail_mask)
    scale_head = load_modulation(scale, batch, token, scale_batch_stride, scale_group_stride, scale_group_size,
                                 SCALE_DIM_STRIDE, head, head_mask)
    scale_tail = load_modulation(scale, batch, token, scale_batch_stride, scale_group_stride, scale_group_size,
                                 SCALE_DIM_STRIDE, tail, tail_mask)
    shift_head = load_modulation(shift, batch, token, shift_batch_stride, shift_group_stride, shift_group_size,
                                 SHIFT_DIM_STRIDE, head, head_mask)
    shift_tail = load_modulation(shift, batch, token, shift_batch_stride, shift_group_stride, shift_group_size,
                                 SHIFT_DIM_STRIDE, tail, tail_mask)
    weight_head = load_parameter(weight, head, head_mask, HAS_WEIGHT)
    weight_tail = load_parameter(weight, tail, tail_mask, HAS_WEIGHT)
    bias_head, bias_tail = load_parameter(bias, head, head_mask, HAS_BIAS), load_parameter(bias, tail, tail_mask, HAS_BIAS)
    if HAS_RESIDUAL:
        if HAS_GATE:
            v = v * load_modulation(gate, batch, token, gate_batch_stride, gate_group_stride, gate_group_size,
                                    GATE_DIM_STRIDE, head, head_mask)
            v_tail = v_tail * load_modulation(gate, batch, token, gate_batch_stride, gate_group_stride, gate_group_size,
                                              GATE_DIM_STRIDE, tail, tail_mask)
        v = load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, head, head_mask) + v
        v_tail = load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, tail, tail_mask) + v_tail
        # The norm reads the sum as stored, as the next layer will.
        v = v.to(residual_out.dtype.element_ty).to(tl.float32)
        v_tail = v_tail.to(residual_out.dtype.element_ty).to(tl.float32)
        store_rows(residual_out, row, hidden, v, head, head_mask)
        store_rows(residual_out, row, hidden, v_tail, tail, tail_mask)
    v, v_tail = normalize(v, v_tail, head_mask, tail_mask, hidden, eps, RMS)
    v = affine(v, weight_head, bias_head, HAS_WEIGHT, HAS_BIAS)
    v_tail = affine(v_tail, weight_tail, bias_tail, HAS_WEIGHT, HAS_BIAS)
    store_rows(y, row, hidden, v * (1.0 + scale_head) + shift_head, head, head_mask)
    store_rows(y, row, hidden, v_tail * (1.0 + scale_tail) + shift_tail, tail, tail_mask)

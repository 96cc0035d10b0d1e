"""out = x + act(gate) * norm(branch), stored; optionally y = norm2(out) * (1 + scale) on out as
stored (op 4, Z-Image's sandwich norm). act is identity or tanh. Rows are held as a head and a
tail tile (row_math.py)."""

import triton
import triton.language as tl

from .row_math import affine, load_modulation, load_parameter, load_rows, normalize, row_tile, store_rows


@triton.jit
def _tanh(v):
    # tanh(v) = 1 - 2 / (exp(2v) + 1): exact at both tails (exp overflows to inf, giving 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * v) + 1.0)


@triton.jit
def gated_add_norm_kernel(
    x, x_batch_stride, x_token_stride,
    branch, branch_batch_stride, branch_token_stride,
    gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE: tl.constexpr,
    scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE: tl.constexpr,
    weight, bias, weight2, bias2, out, y,
    rows, tokens, hidden, eps,
    RMS: tl.constexpr, TANH_GATE: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WEIGHT2: tl.constexpr, HAS_BIAS2: tl.constexpr,
    BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):
    head, head_mask, tail, tail_mask, row, batch, token = row_tile(rows, tokens, hidden, BLOCK, TAIL, ROWS_PER_PROGRAM)
    b = load_rows(branch, batch, token, branch_batch_stride, branch_token_stride, head, head_mask)
    b_tail = load_rows(branch, batch, token, branch_batch_stride, branch_token_stride, tail, tail_mask)
    x_head = load_rows(x, batch, token, x_batch_stride, x_token_stride, head, head_mask)
    x_tail = load_rows(x, batch, token, x_batch_stride, x_token_stride, tail, tail_mask)
    gate_head = load_modulation(gate, batch, token, gate_batch_stride, gate_group_stride, gate_group_size,
                                GATE_DIM_STRIDE, head, head_mask)
    gate_tail = load_modulation(gate, batch, token, gate_batch_stride, gate_group_stride, gate_group_size,
                                GATE_DIM_STRIDE, tail, tail_mask)
    weight_head = load_parameter(weight, head, head_mask, HAS_WEIGHT)
    weight_tail = load_parameter(weight, tail, tail_mask, HAS_WEIGHT)
    bias_head, bias_tail = load_parameter(bias, head, head_mask, HAS_BIAS), load_parameter(bias, tail, tail_mask, HAS_BIAS)
    if HAS_SCALE:
        scale_head = load_modulation(scale, batch, token, scale_batch_stride, scale_group_stride, scale_group_size,
                                     SCALE_DIM_STRIDE, head, head_mask)
        scale_tail = load_modulation(scale, batch, token, scale_batch_stride, scale_group_stride, scale_group_size,
                                     SCALE_DIM_STRIDE, tail, tail_mask)
        weight2_head = load_parameter(weight2, head, head_mask, HAS_WEIGHT2)
        weight2_tail = load_parameter(weight2, tail, tail_mask, HAS_WEIGHT2)
        bias2_head = load_parameter(bias2, head, head_mask, HAS_BIAS2)
        bias2_tail = load_parameter(bias2, tail, tail_mask, HAS_BIAS2)
    if TANH_GATE:
        gate_head, gate_tail = _tanh(gate_head), _tanh(gate_tail)
    b, b_tail = normalize(b, b_tail, head_mask, tail_mask, hidden, eps, RMS)
    # out is rounded as stored; the second norm reads it so.
    o = x_head + gate_head * affine(b, weight_head, bias_head, HAS_WEIGHT, HAS_BIAS)
    o_tail = x_tail + gate_tail * affine(b_tail, weight_tail, bias_tail, HAS_WEIGHT, HAS_BIAS)
    o, o_tail = o.to(out.dtype.element_ty).to(tl.float32), o_tail.to(out.dtype.element_ty).to(tl.float32)
    store_rows(out, row, hidden, o, head, head_mask)
    store_rows(out, row, hidden, o_tail, tail, tail_mask)
    if HAS_SCALE:
        o, o_tail = normalize(o, o_tail, head_mask, tail_mask, hidden, eps, RMS)
        o = affine(o, weight2_head, bias2_head, HAS_WEIGHT2, HAS_BIAS2)
        o_tail = affine(o_tail, weight2_tail, bias2_tail, HAS_WEIGHT2, HAS_BIAS2)
        store_rows(y, row, hidden, o * (1.0 + scale_head), head, head_mask)
        store_rows(y, row, hidden, o_tail * (1.0 + scale_tail), tail, tail_mask)

"""out = x + act(gate) * norm(branch), stored; optionally y = norm2(out) * (1 + scale) on out as
stored (op 4, Z-Image's sandwich norm). act is identity or tanh. Rows are held as a head and a
tail tile (row_math.py); with EARLY_LOADS every load of both tiles comes before the first store."""

import triton
import triton.language as tl

from .row_math import fold_affine, load_modulation, load_rows, normalize, row_tile, store_rows


@triton.jit
def _tanh(v):
    # tanh(v) = 1 - 2 / (exp(2v) + 1): exact at both tails (exp overflows to inf, giving 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * v) + 1.0)


@triton.jit
def _out_terms(x, x_batch_stride, x_token_stride,
               gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE: tl.constexpr,
               weight, bias, batch, token, columns, mask,
               TANH_GATE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(m, a) over one tile with out = n * m + a = x + act(gate) * affine(n)."""
    gate_row = load_modulation(gate, batch, token, gate_batch_stride, gate_group_stride, gate_group_size,
                               GATE_DIM_STRIDE, columns, mask)
    if TANH_GATE:
        gate_row = _tanh(gate_row)
    x_row = load_rows(x, batch, token, x_batch_stride, x_token_stride, columns, mask)
    return fold_affine(gate_row, x_row, weight, bias, columns, mask, HAS_WEIGHT, HAS_BIAS)


@triton.jit
def _y_terms(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE: tl.constexpr,
             weight2, bias2, batch, token, columns, mask, HAS_WEIGHT2: tl.constexpr, HAS_BIAS2: tl.constexpr):
    """(m, a) over one tile with y = n * m + a = affine2(n) * (1 + scale)."""
    scale_row = load_modulation(scale, batch, token, scale_batch_stride, scale_group_stride, scale_group_size,
                                SCALE_DIM_STRIDE, columns, mask)
    return fold_affine(1.0 + scale_row, 0.0, weight2, bias2, columns, mask, HAS_WEIGHT2, HAS_BIAS2)


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
    BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, EARLY_LOADS: tl.constexpr,
):
    head, head_mask, tail, tail_mask, row, batch, token = row_tile(rows, tokens, hidden, BLOCK, TAIL, ROWS_PER_PROGRAM)
    b = load_rows(branch, batch, token, branch_batch_stride, branch_token_stride, head, head_mask)
    b_tail = load_rows(branch, batch, token, branch_batch_stride, branch_token_stride, tail, tail_mask)
    if EARLY_LOADS:
        m, a = _out_terms(x, x_batch_stride, x_token_stride, gate, gate_batch_stride, gate_group_stride, gate_group_size,
                          GATE_DIM_STRIDE, weight, bias, batch, token, head, head_mask, TANH_GATE, HAS_WEIGHT, HAS_BIAS)
        m_tail, a_tail = _out_terms(x, x_batch_stride, x_token_stride, gate, gate_batch_stride, gate_group_stride,
                                    gate_group_size, GATE_DIM_STRIDE, weight, bias, batch, token, tail, tail_mask,
                                    TANH_GATE, HAS_WEIGHT, HAS_BIAS)
        if HAS_SCALE:
            m2, a2 = _y_terms(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                              weight2, bias2, batch, token, head, head_mask, HAS_WEIGHT2, HAS_BIAS2)
            m2_tail, a2_tail = _y_terms(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                                        weight2, bias2, batch, token, tail, tail_mask, HAS_WEIGHT2, HAS_BIAS2)
    b, b_tail = normalize(b, b_tail, head_mask, tail_mask, hidden, eps, RMS)
    if not EARLY_LOADS:
        m, a = _out_terms(x, x_batch_stride, x_token_stride, gate, gate_batch_stride, gate_group_stride, gate_group_size,
                          GATE_DIM_STRIDE, weight, bias, batch, token, head, head_mask, TANH_GATE, HAS_WEIGHT, HAS_BIAS)
    o = store_rows(out, row, hidden, b * m + a, head, head_mask)
    if not EARLY_LOADS:
        m_tail, a_tail = _out_terms(x, x_batch_stride, x_token_stride, gate, gate_batch_stride, gate_group_stride,
                                    gate_group_size, GATE_DIM_STRIDE, weight, bias, batch, token, tail, tail_mask,
                                    TANH_GATE, HAS_WEIGHT, HAS_BIAS)
    o_tail = store_rows(out, row, hidden, b_tail * m_tail + a_tail, tail, tail_mask)
    if HAS_SCALE:  # the second norm reads out as stored
        o, o_tail = normalize(o, o_tail, head_mask, tail_mask, hidden, eps, RMS)
        if not EARLY_LOADS:
            m2, a2 = _y_terms(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                              weight2, bias2, batch, token, head, head_mask, HAS_WEIGHT2, HAS_BIAS2)
        store_rows(y, row, hidden, o * m2 + a2, head, head_mask)
        if not EARLY_LOADS:
            m2_tail, a2_tail = _y_terms(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                                        weight2, bias2, batch, token, tail, tail_mask, HAS_WEIGHT2, HAS_BIAS2)
        store_rows(y, row, hidden, o_tail * m2_tail + a2_tail, tail, tail_mask)

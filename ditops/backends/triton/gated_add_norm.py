"""out = x + act(gate) * norm(branch), stored; optionally y = norm2(out) * (1 + scale) on out as
stored (op 4, Z-Image's sandwich norm), with QUANT as FP8 rows and their scales (its _fp8 form).
act is identity or tanh. Rows are held as a head and a tail tile (row_math.py); with EARLY_LOADS
every load of both tiles comes before the first store."""

import triton
import triton.language as tl

from .row_math import columns, fold_affine, load_modulation, load_rows, normalize, row_tile, store_quantized, store_rows


@triton.jit
def _tanh(v):
    # tanh(v) = 1 - 2 / (exp(2v) + 1): exact at both tails (exp overflows to inf, giving 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * v) + 1.0)


@triton.jit
def _gate_terms(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE: tl.constexpr,
                weight, bias, batch, token, columns, mask,
                TANH_GATE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(m, c) over one tile with out = n * m + (x + c) = x + act(gate) * affine(n)."""
    gate_row = load_modulation(gate, batch, token, gate_batch_stride, gate_group_stride, gate_group_size,
                               GATE_DIM_STRIDE, columns, mask)
    if TANH_GATE:
        gate_row = _tanh(gate_row)
    return fold_affine(gate_row, 0.0, weight, bias, columns, mask, HAS_WEIGHT, HAS_BIAS)


@triton.jit
def _y_terms(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE: tl.constexpr,
             weight2, bias2, batch, token, columns, mask, HAS_WEIGHT2: tl.constexpr, HAS_BIAS2: tl.constexpr):
    """(m, a) over one tile with y = n * m + a = affine2(n) * (1 + scale)."""
    scale_row = load_modulation(scale, batch, token, scale_batch_stride, scale_group_stride, scale_group_size,
                                SCALE_DIM_STRIDE, columns, mask)
    return fold_affine(1.0 + scale_row, 0.0, weight2, bias2, columns, mask, HAS_WEIGHT2, HAS_BIAS2)


@triton.jit
def _all_terms(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE: tl.constexpr,
               scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE: tl.constexpr,
               weight, bias, weight2, bias2, batch, token, head, head_mask, tail, tail_mask,
               TANH_GATE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_WEIGHT2: tl.constexpr, HAS_BIAS2: tl.constexpr):
    """_gate_terms and _y_terms over both tiles at once (zeros for y's where there is no scale)."""
    m, c = _gate_terms(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                       weight, bias, batch, token, head, head_mask, TANH_GATE, HAS_WEIGHT, HAS_BIAS)
    m_tail, c_tail = _gate_terms(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                                 weight, bias, batch, token, tail, tail_mask, TANH_GATE, HAS_WEIGHT, HAS_BIAS)
    m2, a2, m2_tail, a2_tail = 0.0, 0.0, 0.0, 0.0
    if HAS_SCALE:
        m2, a2 = _y_terms(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                          weight2, bias2, batch, token, head, head_mask, HAS_WEIGHT2, HAS_BIAS2)
        m2_tail, a2_tail = _y_terms(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                                    weight2, bias2, batch, token, tail, tail_mask, HAS_WEIGHT2, HAS_BIAS2)
    return m, c, m_tail, c_tail, m2, a2, m2_tail, a2_tail


@triton.jit
def gated_add_norm_kernel(
    x, x_batch_stride, x_token_stride,
    branch, branch_batch_stride, branch_token_stride,
    gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE: tl.constexpr,
    scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE: tl.constexpr,
    weight, bias, weight2, bias2, out, y, y_scale, static_scale,
    tokens, hidden, eps,
    QUANT: tl.constexpr, HAS_STATIC_SCALE: tl.constexpr, FP8_MAX: tl.constexpr,
    RMS: tl.constexpr, TANH_GATE: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_WEIGHT2: tl.constexpr, HAS_BIAS2: tl.constexpr,
    BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, EARLY_LOADS: tl.constexpr,
    HOIST: tl.constexpr, STAGES: tl.constexpr,
):
    batch = tl.program_id(1).to(tl.int64)
    if HOIST:  # gate and scale are the same for every token of the batch item: loaded once
        first = tl.zeros([1, 1], dtype=tl.int64)
        head, head_in, tail, tail_in = columns(hidden, BLOCK, TAIL)
        m, c, m_tail, c_tail, m2, a2, m2_tail, a2_tail = _all_terms(
            gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
            scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
            weight, bias, weight2, bias2, batch, first, head, head_in, tail, tail_in,
            TANH_GATE, HAS_SCALE, HAS_WEIGHT, HAS_BIAS, HAS_WEIGHT2, HAS_BIAS2)
    for block in tl.range(tl.program_id(0), tl.cdiv(tokens, ROWS_PER_PROGRAM), tl.num_programs(0), num_stages=STAGES):
        head, head_mask, tail, tail_mask, row, token, written = row_tile(block, batch, tokens, hidden, BLOCK, TAIL,
                                                                         ROWS_PER_PROGRAM)
        b = load_rows(branch, batch, token, branch_batch_stride, branch_token_stride, head, head_mask)
        b_tail = load_rows(branch, batch, token, branch_batch_stride, branch_token_stride, tail, tail_mask)
        if EARLY_LOADS or HOIST:
            x_row = load_rows(x, batch, token, x_batch_stride, x_token_stride, head, head_mask)
            x_tail = load_rows(x, batch, token, x_batch_stride, x_token_stride, tail, tail_mask)
        if EARLY_LOADS and not HOIST:
            m, c, m_tail, c_tail, m2, a2, m2_tail, a2_tail = _all_terms(
                gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                weight, bias, weight2, bias2, batch, token, head, head_mask, tail, tail_mask,
                TANH_GATE, HAS_SCALE, HAS_WEIGHT, HAS_BIAS, HAS_WEIGHT2, HAS_BIAS2)
        b, b_tail = normalize(b, b_tail, head_mask, tail_mask, hidden, eps, RMS)
        if not (EARLY_LOADS or HOIST):
            m, c = _gate_terms(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                               weight, bias, batch, token, head, head_mask, TANH_GATE, HAS_WEIGHT, HAS_BIAS)
            x_row = load_rows(x, batch, token, x_batch_stride, x_token_stride, head, head_mask)
        o = store_rows(out, row, hidden, b * m + (x_row + c), head, head_mask)
        if not (EARLY_LOADS or HOIST):
            m_tail, c_tail = _gate_terms(gate, gate_batch_stride, gate_group_stride, gate_group_size,
                                         GATE_DIM_STRIDE, weight, bias, batch, token, tail, tail_mask,
                                         TANH_GATE, HAS_WEIGHT, HAS_BIAS)
            x_tail = load_rows(x, batch, token, x_batch_stride, x_token_stride, tail, tail_mask)
        o_tail = store_rows(out, row, hidden, b_tail * m_tail + (x_tail + c_tail), tail, tail_mask)
        if HAS_SCALE:  # the second norm reads out as stored
            o, o_tail = normalize(o, o_tail, head_mask, tail_mask, hidden, eps, RMS)
            if not (EARLY_LOADS or HOIST):
                m2, a2 = _y_terms(scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                                  weight2, bias2, batch, token, head, head_mask, HAS_WEIGHT2, HAS_BIAS2)
            if not QUANT:
                store_rows(y, row, hidden, o * m2 + a2, head, head_mask)
            if not (EARLY_LOADS or HOIST):
                m2_tail, a2_tail = _y_terms(scale, scale_batch_stride, scale_group_stride, scale_group_size,
                                            SCALE_DIM_STRIDE, weight2, bias2, batch, token, tail, tail_mask,
                                            HAS_WEIGHT2, HAS_BIAS2)
            if QUANT:  # the row's amax needs both tiles before either is stored
                store_quantized(y, y_scale, static_scale, row, hidden, o * m2 + a2, o_tail * m2_tail + a2_tail, head,
                                head_mask, tail, tail_mask, written, FP8_MAX, HAS_STATIC_SCALE)
            else:
                store_rows(y, row, hidden, o_tail * m2_tail + a2_tail, tail, tail_mask)

"""y = norm(v) * (1 + scale) + shift, where v = x, or v = residual + gate * x stored first as
residual_out (ops 1 and 2); with QUANT, y as FP8 rows and their scales (their _fp8 forms). A
program normalises blocks of ROWS_PER_PROGRAM rows held in registers as a head and a tail tile
(row_math.py): every element is read once and written once. With EARLY_LOADS every load of both tiles comes before the first store; with HOIST (a
row loop, launch.row_grid) gate, scale and shift are loaded once, before the loop over blocks
(row_math.py says when and why). With TABLE the modulation tensors that are tables ([K, D] or
[B, K, D], docs/ops.md) are read at row index[b, s] of each row, loaded once per row and
clamped into [0, K), where other forms read at the token (load_modulation)."""

import triton
import triton.language as tl

from .row_math import columns, fold_affine, load_modulation, load_rows, normalize, row_tile, store_quantized, store_rows


@triton.jit
def _gate(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE: tl.constexpr,
          batch, token, columns, mask, HAS_GATE: tl.constexpr):
    """The residual gate over one tile; 1 where there is none."""
    gate_row = 1.0
    if HAS_GATE:
        gate_row = load_modulation(gate, batch, token, gate_batch_stride, gate_group_stride, gate_group_size,
                                   GATE_DIM_STRIDE, columns, mask)
    return gate_row


@triton.jit
def _terms(weight, bias,
           scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE: tl.constexpr,
           shift, shift_batch_stride, shift_group_stride, shift_group_size, SHIFT_DIM_STRIDE: tl.constexpr,
           batch, token, columns, mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(m, a) over one tile with y = n * m + a = affine(n) * (1 + scale) + shift."""
    scale_row = load_modulation(scale, batch, token, scale_batch_stride, scale_group_stride, scale_group_size,
                                SCALE_DIM_STRIDE, columns, mask)
    shift_row = load_modulation(shift, batch, token, shift_batch_stride, shift_group_stride, shift_group_size,
                                SHIFT_DIM_STRIDE, columns, mask)
    return fold_affine(1.0 + scale_row, shift_row, weight, bias, columns, mask, HAS_WEIGHT, HAS_BIAS)


@triton.jit
def modulated_norm_kernel(
    x, x_batch_stride, x_token_stride,
    residual, residual_batch_stride, residual_token_stride,
    gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE: tl.constexpr,
    scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE: tl.constexpr,
    shift, shift_batch_stride, shift_group_stride, shift_group_size, SHIFT_DIM_STRIDE: tl.constexpr,
    index, index_batch_stride, index_token_stride, table_rows,
    weight, bias, y, residual_out, y_scale, static_scale,
    tokens, hidden, eps,
    QUANT: tl.constexpr, HAS_STATIC_SCALE: tl.constexpr, FP8_MAX: tl.constexpr,
    RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_GATE: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, TABLE: tl.constexpr,
    BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, EARLY_LOADS: tl.constexpr,
    HOIST: tl.constexpr, STAGES: tl.constexpr, FOLD: tl.constexpr,
):
    batch = tl.program_id(1).to(tl.int64)
    if HOIST:  # gate, scale and shift are the same for every token of the batch item: loaded once
        first = tl.zeros([1, 1], dtype=tl.int64)
        head, head_in, tail, tail_in = columns(hidden, BLOCK, TAIL)
        gate_row = _gate(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                         batch, first, head, head_in, HAS_GATE)
        gate_tail = _gate(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                          batch, first, tail, tail_in, HAS_GATE)
        m, a = _terms(weight, bias, scale, scale_batch_stride, scale_group_stride, scale_group_size, SCALE_DIM_STRIDE,
                      shift, shift_batch_stride, shift_group_stride, shift_group_size, SHIFT_DIM_STRIDE,
                      batch, first, head, head_in, HAS_WEIGHT, HAS_BIAS)
        m_tail, a_tail = _terms(weight, bias, scale, scale_batch_stride, scale_group_stride, scale_group_size,
                                SCALE_DIM_STRIDE, shift, shift_batch_stride, shift_group_stride, shift_group_size,
                                SHIFT_DIM_STRIDE, batch, first, tail, tail_in, HAS_WEIGHT, HAS_BIAS)
    for block in tl.range(tl.program_id(0), tl.cdiv(tokens, ROWS_PER_PROGRAM), tl.num_programs(0), num_stages=STAGES):
        head, head_mask, tail, tail_mask, row, token, written = row_tile(block, batch, tokens, hidden, BLOCK, TAIL,
                                                                         ROWS_PER_PROGRAM)
        v = load_rows(x, batch, token, x_batch_stride, x_token_stride, head, head_mask)
        v_tail = load_rows(x, batch, token, x_batch_stride, x_token_stride, tail, tail_mask)
        group = token  # load_modulation's token; a table's row is the index value instead
        if TABLE:  # clamped, so that no index value reads outside the tables
            group = tl.load(index + batch * index_batch_stride + token * index_token_stride).to(tl.int64)
            group = tl.minimum(tl.maximum(group, 0), table_rows - 1)
        if HAS_RESIDUAL:
            previous = load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, head, head_mask)
            if not HOIST:
                gate_row = _gate(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                                 batch, group, head, head_mask, HAS_GATE)
            if EARLY_LOADS or HOIST:
                previous_tail = load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, tail,
                                          tail_mask)
                if not HOIST:
                    gate_tail = _gate(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                                      batch, group, tail, tail_mask, HAS_GATE)
        if EARLY_LOADS and not HOIST:
            m, a = _terms(weight, bias, scale, scale_batch_stride, scale_group_stride, scale_group_size,
                          SCALE_DIM_STRIDE, shift, shift_batch_stride, shift_group_stride, shift_group_size,
                          SHIFT_DIM_STRIDE, batch, group, head, head_mask, HAS_WEIGHT, HAS_BIAS)
            m_tail, a_tail = _terms(weight, bias, scale, scale_batch_stride, scale_group_stride, scale_group_size,
                                    SCALE_DIM_STRIDE, shift, shift_batch_stride, shift_group_stride, shift_group_size,
                                    SHIFT_DIM_STRIDE, batch, group, tail, tail_mask, HAS_WEIGHT, HAS_BIAS)
        if HAS_RESIDUAL:  # the sum is stored, and normalised as stored
            v = store_rows(residual_out, row, hidden, previous + v * gate_row, head, head_mask)
            if not (EARLY_LOADS or HOIST):
                previous_tail = load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, tail,
                                          tail_mask)
                gate_tail = _gate(gate, gate_batch_stride, gate_group_stride, gate_group_size, GATE_DIM_STRIDE,
                                  batch, group, tail, tail_mask, HAS_GATE)
            v_tail = store_rows(residual_out, row, hidden, previous_tail + v_tail * gate_tail, tail, tail_mask)
        v, v_tail = normalize(v, v_tail, head_mask, tail_mask, hidden, eps, RMS, FOLD)
        if not (EARLY_LOADS or HOIST):
            m, a = _terms(weight, bias, scale, scale_batch_stride, scale_group_stride, scale_group_size,
                          SCALE_DIM_STRIDE, shift, shift_batch_stride, shift_group_stride, shift_group_size,
                          SHIFT_DIM_STRIDE, batch, group, head, head_mask, HAS_WEIGHT, HAS_BIAS)
        out = v * m + a
        if not QUANT:
            store_rows(y, row, hidden, out, head, head_mask)
        if not (EARLY_LOADS or HOIST):
            m_tail, a_tail = _terms(weight, bias, scale, scale_batch_stride, scale_group_stride, scale_group_size,
                                    SCALE_DIM_STRIDE, shift, shift_batch_stride, shift_group_stride, shift_group_size,
                                    SHIFT_DIM_STRIDE, batch, group, tail, tail_mask, HAS_WEIGHT, HAS_BIAS)
        if QUANT:  # the row's amax needs both tiles before either is stored
            store_quantized(y, y_scale, static_scale, row, hidden, out, v_tail * m_tail + a_tail, head, head_mask, tail,
                            tail_mask, written, FP8_MAX, HAS_STATIC_SCALE, FOLD)
        else:
            store_rows(y, row, hidden, v_tail * m_tail + a_tail, tail, tail_mask)

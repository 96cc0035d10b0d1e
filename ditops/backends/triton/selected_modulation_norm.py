"""LayerNorm with a per-token choice between two [B, D] modulation sets (op 3, Qwen-Image-Edit):
set 1 where index[b, s] != 0, else set 0; the chosen gate is written out per token. With a
residual, residual_out = residual + residual_gate * x is stored first and normalised as stored.
With QUANT, y as FP8 rows and their scales (the _fp8 forms). Rows are held as a head and a tail
tile (row_math.py); with EARLY_LOADS every load of both tiles comes before the first store. A
row loads only its chosen set's modulation (_choose): loading both sets and choosing the values
read 72 KB of float32 vectors per row of D = 3072 from the caches, against 18 KB of memory
traffic, and made the kernel bound by cache reads; choosing the pointer first halves those
reads and gives the same bits."""

import triton
import triton.language as tl

from .row_math import fold_affine, load_rows, normalize, row_tile, store_quantized, store_rows


@triton.jit
def _choose(first, first_offset, second, second_offset, columns, mask, selected):
    """The selected set's row: one load from the chosen tensor where both have one dtype (the
    row's pointer is chosen), else both loaded and the values chosen."""
    if first.dtype == second.dtype:
        chosen = tl.where(selected, second + second_offset, first + first_offset)
        return tl.load(chosen + columns, mask=mask, other=0.0).to(tl.float32)
    chosen_first = tl.load(first + first_offset + columns, mask=mask, other=0.0).to(tl.float32)
    chosen_second = tl.load(second + second_offset + columns, mask=mask, other=0.0).to(tl.float32)
    return tl.where(selected, chosen_second, chosen_first)


@triton.jit
def _residual_inputs(residual, residual_batch_stride, residual_token_stride,
                     residual_gate, residual_gate_batch_stride, residual_gate_token_stride, batch, token, columns, mask):
    """(residual, residual_gate) over one tile."""
    return (load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, columns, mask),
            load_rows(residual_gate, batch, token, residual_gate_batch_stride, residual_gate_token_stride, columns, mask))


@triton.jit
def _terms(weight, bias, scale0, scale0_batch_stride, shift0, shift0_batch_stride, gate0, gate0_batch_stride,
           scale1, scale1_batch_stride, shift1, shift1_batch_stride, gate1, gate1_batch_stride,
           selected, batch, columns, mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(m, a, gate) over one tile with y = n * m + a = affine(n) * (1 + scale) + shift, all of
    the selected set."""
    scale_row = _choose(scale0, batch * scale0_batch_stride, scale1, batch * scale1_batch_stride, columns, mask, selected)
    shift_row = _choose(shift0, batch * shift0_batch_stride, shift1, batch * shift1_batch_stride, columns, mask, selected)
    gate_row = _choose(gate0, batch * gate0_batch_stride, gate1, batch * gate1_batch_stride, columns, mask, selected)
    m, a = fold_affine(1.0 + scale_row, shift_row, weight, bias, columns, mask, HAS_WEIGHT, HAS_BIAS)
    return m, a, gate_row


@triton.jit
def selected_modulation_norm_kernel(
    x, x_batch_stride, x_token_stride,
    residual, residual_batch_stride, residual_token_stride,
    residual_gate, residual_gate_batch_stride, residual_gate_token_stride,
    index, index_batch_stride, index_token_stride,
    scale0, scale0_batch_stride, shift0, shift0_batch_stride, gate0, gate0_batch_stride,
    scale1, scale1_batch_stride, shift1, shift1_batch_stride, gate1, gate1_batch_stride,
    weight, bias, y, residual_out, gate_out, y_scale, static_scale,
    tokens, hidden, eps,
    QUANT: tl.constexpr, HAS_STATIC_SCALE: tl.constexpr, FP8_MAX: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, EARLY_LOADS: tl.constexpr,
    FOLD: tl.constexpr,
):
    # One block per program: the modulation is chosen per token, so a program looping over
    # blocks (modulated_norm.py) would have nothing to keep from one block to the next.
    batch = tl.program_id(1).to(tl.int64)
    head, head_mask, tail, tail_mask, row, token, written = row_tile(tl.program_id(0), batch, tokens, hidden, BLOCK,
                                                                     TAIL, ROWS_PER_PROGRAM)
    v = load_rows(x, batch, token, x_batch_stride, x_token_stride, head, head_mask)
    v_tail = load_rows(x, batch, token, x_batch_stride, x_token_stride, tail, tail_mask)
    # a step past the last token reads the last one's index (row_tile) and stores nothing
    selected = tl.load(index + batch * index_batch_stride + token * index_token_stride) != 0
    if HAS_RESIDUAL:
        previous, gate_row = _residual_inputs(residual, residual_batch_stride, residual_token_stride, residual_gate,
                                              residual_gate_batch_stride, residual_gate_token_stride,
                                              batch, token, head, head_mask)
        if EARLY_LOADS:
            previous_tail, gate_tail = _residual_inputs(residual, residual_batch_stride, residual_token_stride,
                                                        residual_gate, residual_gate_batch_stride,
                                                        residual_gate_token_stride, batch, token, tail, tail_mask)
    if EARLY_LOADS:
        m, a, chosen_gate = _terms(
            weight, bias, scale0, scale0_batch_stride, shift0, shift0_batch_stride, gate0, gate0_batch_stride,
            scale1, scale1_batch_stride, shift1, shift1_batch_stride, gate1, gate1_batch_stride,
            selected, batch, head, head_mask, HAS_WEIGHT, HAS_BIAS)
        m_tail, a_tail, chosen_gate_tail = _terms(
            weight, bias, scale0, scale0_batch_stride, shift0, shift0_batch_stride, gate0, gate0_batch_stride,
            scale1, scale1_batch_stride, shift1, shift1_batch_stride, gate1, gate1_batch_stride,
            selected, batch, tail, tail_mask, HAS_WEIGHT, HAS_BIAS)
    if HAS_RESIDUAL:  # the sum is stored, and normalised as stored
        v = store_rows(residual_out, row, hidden, previous + gate_row * v, head, head_mask)
        if not EARLY_LOADS:
            previous_tail, gate_tail = _residual_inputs(residual, residual_batch_stride, residual_token_stride,
                                                        residual_gate, residual_gate_batch_stride,
                                                        residual_gate_token_stride, batch, token, tail, tail_mask)
        v_tail = store_rows(residual_out, row, hidden, previous_tail + gate_tail * v_tail, tail, tail_mask)
    v, v_tail = normalize(v, v_tail, head_mask, tail_mask, hidden, eps, False, FOLD)
    if not EARLY_LOADS:
        m, a, chosen_gate = _terms(
            weight, bias, scale0, scale0_batch_stride, shift0, shift0_batch_stride, gate0, gate0_batch_stride,
            scale1, scale1_batch_stride, shift1, shift1_batch_stride, gate1, gate1_batch_stride,
            selected, batch, head, head_mask, HAS_WEIGHT, HAS_BIAS)
    out = v * m + a
    if not QUANT:
        store_rows(y, row, hidden, out, head, head_mask)
    store_rows(gate_out, row, hidden, chosen_gate, head, head_mask)
    if not EARLY_LOADS:
        m_tail, a_tail, chosen_gate_tail = _terms(
            weight, bias, scale0, scale0_batch_stride, shift0, shift0_batch_stride, gate0, gate0_batch_stride,
            scale1, scale1_batch_stride, shift1, shift1_batch_stride, gate1, gate1_batch_stride,
            selected, batch, tail, tail_mask, HAS_WEIGHT, HAS_BIAS)
    if QUANT:  # the row's amax needs both tiles before either is stored
        store_quantized(y, y_scale, static_scale, row, hidden, out, v_tail * m_tail + a_tail, head, head_mask, tail,
                        tail_mask, written, FP8_MAX, HAS_STATIC_SCALE, FOLD)
    else:
        store_rows(y, row, hidden, v_tail * m_tail + a_tail, tail, tail_mask)
    store_rows(gate_out, row, hidden, chosen_gate_tail, tail, tail_mask)

"""LayerNorm with a per-token choice between two [B, D] modulation sets (op 3, Qwen-Image-Edit):
set 1 where index[b, s] != 0, else set 0; the chosen gate is written out per token. With a
residual, residual_out = residual + residual_gate * x is stored first and normalised as stored.
Both sets are [B, D]: loading both and selecting costs L2 hits, not memory traffic. Rows are
held as a head and a tail tile (row_math.py)."""

import triton
import triton.language as tl

from .row_math import affine, load_parameter, load_rows, normalize, row_tile, store_rows


@triton.jit
def _choose(first, first_offset, second, second_offset, columns, mask, selected):
    chosen_first = tl.load(first + first_offset + columns, mask=mask, other=0.0).to(tl.float32)
    chosen_second = tl.load(second + second_offset + columns, mask=mask, other=0.0).to(tl.float32)
    return tl.where(selected, chosen_second, chosen_first)


@triton.jit
def selected_modulation_norm_kernel(
    x, x_batch_stride, x_token_stride,
    residual, residual_batch_stride, residual_token_stride,
    residual_gate, residual_gate_batch_stride, residual_gate_token_stride,
    index, index_batch_stride, index_token_stride,
    scale0, scale0_batch_stride, shift0, shift0_batch_stride, gate0, gate0_batch_stride,
    scale1, scale1_batch_stride, shift1, shift1_batch_stride, gate1, gate1_batch_stride,
    weight, bias, y, residual_out, gate_out,
    rows, tokens, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):
    head, head_mask, tail, tail_mask, row, batch, token = row_tile(rows, tokens, hidden, BLOCK, TAIL, ROWS_PER_PROGRAM)
    v = load_rows(x, batch, token, x_batch_stride, x_token_stride, head, head_mask)
    v_tail = load_rows(x, batch, token, x_batch_stride, x_token_stride, tail, tail_mask)
    last_row = tl.minimum(row, rows - 1)  # a step past the last row reads a valid index and stores nothing
    selected = tl.load(index + (last_row // tokens) * index_batch_stride + (last_row % tokens) * index_token_stride) != 0
    offsets = (batch * scale0_batch_stride, batch * scale1_batch_stride, batch * shift0_batch_stride,
               batch * shift1_batch_stride, batch * gate0_batch_stride, batch * gate1_batch_stride)
    scale_head = _choose(scale0, offsets[0], scale1, offsets[1], head, head_mask, selected)
    scale_tail = _choose(scale0, offsets[0], scale1, offsets[1], tail, tail_mask, selected)
    shift_head = _choose(shift0, offsets[2], shift1, offsets[3], head, head_mask, selected)
    shift_tail = _choose(shift0, offsets[2], shift1, offsets[3], tail, tail_mask, selected)
    gate_head = _choose(gate0, offsets[4], gate1, offsets[5], head, head_mask, selected)
    gate_tail = _choose(gate0, offsets[4], gate1, offsets[5], tail, tail_mask, selected)
    weight_head = load_parameter(weight, head, head_mask, HAS_WEIGHT)
    weight_tail = load_parameter(weight, tail, tail_mask, HAS_WEIGHT)
    bias_head, bias_tail = load_parameter(bias, head, head_mask, HAS_BIAS), load_parameter(bias, tail, tail_mask, HAS_BIAS)
    if HAS_RESIDUAL:
        gate_rows = load_rows(residual_gate, batch, token, residual_gate_batch_stride, residual_gate_token_stride,
                              head, head_mask)
        gate_rows_tail = load_rows(residual_gate, batch, token, residual_gate_batch_stride, residual_gate_token_stride,
                                   tail, tail_mask)
        v = load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, head, head_mask) + gate_rows * v
        v_tail = (load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, tail, tail_mask)
                  + gate_rows_tail * v_tail)
        # The norm reads the sum as stored, as the next layer will.
        v = v.to(residual_out.dtype.element_ty).to(tl.float32)
        v_tail = v_tail.to(residual_out.dtype.element_ty).to(tl.float32)
        store_rows(residual_out, row, hidden, v, head, head_mask)
        store_rows(residual_out, row, hidden, v_tail, tail, tail_mask)
    v, v_tail = normalize(v, v_tail, head_mask, tail_mask, hidden, eps, False)
    v = affine(v, weight_head, bias_head, HAS_WEIGHT, HAS_BIAS)
    v_tail = affine(v_tail, weight_tail, bias_tail, HAS_WEIGHT, HAS_BIAS)
    store_rows(y, row, hidden, v * (1.0 + scale_head) + shift_head, head, head_mask)
    store_rows(y, row, hidden, v_tail * (1.0 + scale_tail) + shift_tail, tail, tail_mask)
    store_rows(gate_out, row, hidden, gate_head, head, head_mask)
    store_rows(gate_out, row, hidden, gate_tail, tail, tail_mask)

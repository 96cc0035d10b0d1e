"""LayerNorm with a per-token choice between two [B, D] modulation sets (op 3, Qwen-Image-Edit):
set 1 where index[b, s] != 0, else set 0; the chosen gate is written out per token. With a
residual, residual_out = residual + residual_gate * x is stored first and normalised as stored.
Both sets are [B, D]: loading both and selecting costs L2 hits, not memory traffic."""

import triton
import triton.language as tl

from .row_math import load_rows, normalize, row_tile


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
    BLOCK: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):
    columns, row, batch, token, mask = row_tile(rows, tokens, hidden, BLOCK, ROWS_PER_PROGRAM)
    v = load_rows(x, batch, token, x_batch_stride, x_token_stride, columns, mask)
    if HAS_RESIDUAL:
        gate_row = load_rows(residual_gate, batch, token, residual_gate_batch_stride, residual_gate_token_stride, columns, mask)
        previous = load_rows(residual, batch, token, residual_batch_stride, residual_token_stride, columns, mask)
        stored = (previous + gate_row * v).to(residual_out.dtype.element_ty)
        tl.store(residual_out + row * hidden + columns, stored, mask=mask)
        v = stored.to(tl.float32)
    last_row = tl.minimum(row, rows - 1)  # a step past the last row reads a valid index and stores nothing
    selected = tl.load(index + (last_row // tokens) * index_batch_stride + (last_row % tokens) * index_token_stride) != 0
    normalized = normalize(v, mask, hidden, eps, weight, bias, columns, False, HAS_WEIGHT, HAS_BIAS)
    scale_row = _choose(scale0, batch * scale0_batch_stride, scale1, batch * scale1_batch_stride, columns, mask, selected)
    shift_row = _choose(shift0, batch * shift0_batch_stride, shift1, batch * shift1_batch_stride, columns, mask, selected)
    tl.store(y + row * hidden + columns, (normalized * (1.0 + scale_row) + shift_row).to(y.dtype.element_ty), mask=mask)
    gate_row_out = _choose(gate0, batch * gate0_batch_stride, gate1, batch * gate1_batch_stride, columns, mask, selected)
    tl.store(gate_out + row * hidden + columns, gate_row_out.to(gate_out.dtype.element_ty), mask=mask)

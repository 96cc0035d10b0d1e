"""out = x + act(gate) * norm(branch), stored; optionally y = norm2(out) * (1 + scale) on out as
stored (op 4, Z-Image's sandwich norm). act is identity or tanh."""

import triton
import triton.language as tl

from .row_math import load_modulation, load_rows, normalize, row_tile


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
    BLOCK: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):
    columns, row, batch, token, mask = row_tile(rows, tokens, hidden, BLOCK, ROWS_PER_PROGRAM)
    branch_row = load_rows(branch, batch, token, branch_batch_stride, branch_token_stride, columns, mask)
    normalized = normalize(branch_row, mask, hidden, eps, weight, bias, columns, RMS, HAS_WEIGHT, HAS_BIAS)
    gate_row = load_modulation(gate, batch, token, gate_batch_stride, gate_group_stride, gate_group_size,
                               GATE_DIM_STRIDE, columns, mask)
    if TANH_GATE:
        gate_row = _tanh(gate_row)
    x_row = load_rows(x, batch, token, x_batch_stride, x_token_stride, columns, mask)
    stored = (x_row + gate_row * normalized).to(out.dtype.element_ty)
    tl.store(out + row * hidden + columns, stored, mask=mask)
    if HAS_SCALE:
        normalized2 = normalize(stored.to(tl.float32), mask, hidden, eps, weight2, bias2, columns,
                                RMS, HAS_WEIGHT2, HAS_BIAS2)
        scale_row = load_modulation(scale, batch, token, scale_batch_stride, scale_group_stride, scale_group_size,
                                    SCALE_DIM_STRIDE, columns, mask)
        tl.store(y + row * hidden + columns, (normalized2 * (1.0 + scale_row)).to(y.dtype.element_ty), mask=mask)

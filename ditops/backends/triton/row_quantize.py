"""y, y_scale = FP8 rows of act(x) and their scales (op quantize_fp8): a program holds blocks
of ROWS_PER_PROGRAM rows in registers as a head and a tail tile (row_math.py), applies the
activation, and stores each row quantised against its amax (row_math.row_scale): x is read
once, y and one scale per row written once. With a prefix (PREFIX), a row is
cat([prefix, act(x)]): the prefix has head and tail tiles of its own, so each tile reads one
tensor and the activation runs on x's columns alone; the amax covers both parts and neither
is copied first."""

import triton
import triton.language as tl

from .row_math import columns, load_rows, row_amax_bits, row_scale, row_tile, store_fp8


@triton.jit
def _gelu_tanh(v):
    """0.5 v (1 + tanh(z)) = v / (1 + exp(-2 z)), z = sqrt(2 / pi) (v + 0.044715 v^3), with
    exp(-2 z) = 2^(v (a v^2 + b)) (a and b hold -2 sqrt(2 / pi) (0.044715, 1) / ln 2) and 1 / d as
    rsqrt(d)^2 (d >= 1; within a few ulp): tanh has no portable Triton primitive, and against a
    natural exponential and an approximate division this is 7 fewer instructions a value, where
    the GELU rows of 8960-15360 values are compute-bound (launch settings: triton_launch.yaml).
    v = -Inf gives NaN, as the definition does."""
    root = tl.math.rsqrt(1.0 + tl.exp2(v * (v * v * -0.1029432395800235 - 2.302208198144325)))
    return v * root * root


@triton.jit
def _activated(x, x_batch_stride, x_token_stride, batch, token, columns, mask, GELU: tl.constexpr):
    """A tile of act(x) as float32."""
    v = load_rows(x, batch, token, x_batch_stride, x_token_stride, columns, mask)
    if GELU:
        v = _gelu_tanh(v)
    return v


@triton.jit
def row_quantize_kernel(
    x, x_batch_stride, x_token_stride, prefix, prefix_batch_stride, prefix_token_stride, prefix_width,
    y, y_scale, static_scale, tokens, hidden,
    GELU: tl.constexpr, PREFIX: tl.constexpr, HAS_STATIC_SCALE: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr, TAIL: tl.constexpr, PREFIX_BLOCK: tl.constexpr, PREFIX_TAIL: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
):
    """hidden: x's D; a row of y has prefix_width + D values (prefix_width 0 without PREFIX)."""
    batch = tl.program_id(1).to(tl.int64)
    head, head_mask, tail, tail_mask, row, token, written = row_tile(tl.program_id(0), batch, tokens, hidden, BLOCK,
                                                                     TAIL, ROWS_PER_PROGRAM)
    v = _activated(x, x_batch_stride, x_token_stride, batch, token, head, head_mask, GELU)
    v_tail = _activated(x, x_batch_stride, x_token_stride, batch, token, tail, tail_mask, GELU)
    bits = row_amax_bits(v, v_tail, False)
    width = prefix_width + hidden
    if PREFIX:
        p_head, p_head_mask, p_tail, p_tail_mask = columns(tl.where(written, prefix_width, 0), PREFIX_BLOCK, PREFIX_TAIL)
        p = load_rows(prefix, batch, token, prefix_batch_stride, prefix_token_stride, p_head, p_head_mask)
        p_tail_values = load_rows(prefix, batch, token, prefix_batch_stride, prefix_token_stride, p_tail, p_tail_mask)
        bits = tl.maximum(bits, row_amax_bits(p, p_tail_values, False))
    scale = row_scale(bits, static_scale, FP8_MAX, HAS_STATIC_SCALE)
    inverse = 1.0 / scale
    out = y + row * width + prefix_width
    store_fp8(out + head, v, inverse, head_mask, FP8_MAX)
    store_fp8(out + tail, v_tail, inverse, tail_mask, FP8_MAX)
    if PREFIX:
        store_fp8(y + row * width + p_head, p, inverse, p_head_mask, FP8_MAX)
        store_fp8(y + row * width + p_tail, p_tail_values, inverse, p_tail_mask, FP8_MAX)
    tl.store(y_scale + row, scale, mask=written)

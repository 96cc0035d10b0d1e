"""y, y_scale = FP8 rows of act(x) and their scales (op quantize_fp8): a program holds blocks
of ROWS_PER_PROGRAM rows in registers as a head and a tail tile (row_math.py), applies the
activation, and stores each row quantised against its amax (row_math.store_quantized): x is
read once, y and one scale per row written once. With a prefix (PREFIX), a row is
cat([prefix, act(x)]): the tiles span its P + D columns, each column read from the one tensor
that holds it, so the amax covers both parts and neither is copied first."""

import triton
import triton.language as tl

from .row_math import load_rows, row_tile, store_quantized


@triton.jit
def _gelu_tanh(v):
    """0.5 v (1 + tanh(z)) = v / (1 + exp(-2 z)), z = sqrt(2 / pi) (v + 0.044715 v^3): tanh has
    no portable Triton primitive. The division is the approximate one (tl.fdiv, within 2 ulp):
    an IEEE division per value made the 12288-wide MLP rows compute-bound."""
    return tl.fdiv(v, 1.0 + tl.exp(-1.5957691216057308 * (v + 0.044715 * v * v * v)))


@triton.jit
def _tile(x, x_batch_stride, x_token_stride, prefix, prefix_batch_stride, prefix_token_stride, prefix_width, batch,
          token, columns, mask, GELU: tl.constexpr, PREFIX: tl.constexpr):
    """A tile of the rows cat([prefix, act(x)]) as float32: columns below prefix_width from the
    prefix as they are, the others from x (column - prefix_width) through the activation."""
    if PREFIX:
        v = load_rows(x, batch, token, x_batch_stride, x_token_stride, columns - prefix_width,
                      mask & (columns >= prefix_width))
    else:
        v = load_rows(x, batch, token, x_batch_stride, x_token_stride, columns, mask)
    if GELU:
        v = _gelu_tanh(v)
    if PREFIX:
        in_prefix = columns < prefix_width
        v = tl.where(in_prefix, load_rows(prefix, batch, token, prefix_batch_stride, prefix_token_stride, columns,
                                          mask & in_prefix), v)
    return v


@triton.jit
def row_quantize_kernel(
    x, x_batch_stride, x_token_stride, prefix, prefix_batch_stride, prefix_token_stride, prefix_width,
    y, y_scale, static_scale, tokens, hidden,
    GELU: tl.constexpr, PREFIX: tl.constexpr, HAS_STATIC_SCALE: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr,
):
    batch = tl.program_id(1).to(tl.int64)
    head, head_mask, tail, tail_mask, row, token, written = row_tile(tl.program_id(0), batch, tokens, hidden, BLOCK,
                                                                     TAIL, ROWS_PER_PROGRAM)
    v = _tile(x, x_batch_stride, x_token_stride, prefix, prefix_batch_stride, prefix_token_stride, prefix_width, batch,
              token, head, head_mask, GELU, PREFIX)
    v_tail = _tile(x, x_batch_stride, x_token_stride, prefix, prefix_batch_stride, prefix_token_stride, prefix_width,
                   batch, token, tail, tail_mask, GELU, PREFIX)
    store_quantized(y, y_scale, static_scale, row, hidden, v, v_tail, head, head_mask, tail, tail_mask, written, FP8_MAX,
                    HAS_STATIC_SCALE)

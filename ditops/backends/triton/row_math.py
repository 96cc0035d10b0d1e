"""Pieces shared by the row kernels. The grid is (programs per batch item, batch items); a
program loops over blocks of ROWS tokens of its batch item (row_tile), one block when the
grid has one program per block. A block holds ROWS rows (one token's D values each) in
registers, as two tiles: the head, columns [0, BLOCK) with BLOCK the largest power of two not
above D, and the tail, columns [BLOCK, BLOCK + TAIL) masked at D. One tile padded to the next
power of two would spend up to 37% of its registers and arithmetic on masked columns (D = 5120
in 8192); in a one-off LayerNorm + modulation experiment on an H200 (S = 32760-118800) the
two-tile form reached 98-99% of a same-size copy at D = 1536, 3072 and 5120 where the padded
tile reached 82-95% (each at its best num_warps). Rows of one program share their modulation
vectors when they belong to one batch item, so those loads hit L1 instead of going to L2.

Activations are read once and outputs written once, so their accesses ask the cache to evict
them first and keep the modulation vectors, which every row reads.

What is applied after the norm (elementwise weight and bias, modulation, gate, the other
input of an add) is loaded as one multiplier and one addend per element (fold_affine). A
program finishes its tiles in turn: late loads (the default) load them after the norm's
reduction, tile by tile, and keep few values live, which long calls need for rows in flight
(issuing every load first cost 7-52% at S = 4096-118800 on an H200). Calls of few rows
(EARLY_LOADS, below a row count in the launch table) are one wave of programs waiting on
memory latency: there every load of both tiles is issued before the first store, so the
round trips overlap (H100, S = 128, D = 3072: norm_scale_shift 2.94 -> 2.56 us with the
modulation loads moved alone). Both orders compute the same operations, so results match
bit for bit and a row's result does not depend on how many rows its call has.

A row loop (launch.row_grid: few programs, each over many blocks) keeps the modulation a
kernel loads once in registers (HOIST) and lets Triton pipeline the loop's loads through
shared memory (num_stages), so the next blocks' rows are in flight while one is reduced:
the bytes in flight a program of registers alone cannot hold. Same operations per row."""

import triton
import triton.language as tl


@triton.jit
def columns(hidden, BLOCK: tl.constexpr, TAIL: tl.constexpr):
    """The head columns [1, BLOCK] and tail columns [1, TAIL] of a row, each with its mask at D."""
    head = tl.arange(0, BLOCK)[None, :]
    tail = BLOCK + tl.arange(0, TAIL)[None, :]
    return head, head < hidden, tail, tail < hidden


@triton.jit
def row_tile(block, batch, tokens, hidden, BLOCK: tl.constexpr, TAIL: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
    """Rows of block ``block`` of batch item ``batch`` (ROWS_PER_PROGRAM tokens): (head columns,
    head mask, tail columns, tail mask, output row, token, written); rows, tokens and written
    (the row is one of the call's) are [ROWS, 1], masks [ROWS, columns]."""
    token = (block * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)[:, None]).to(tl.int64)  # tokens < 2**31
    written = token < tokens
    limit = tl.where(written, hidden, 0)  # tokens past the last one touch nothing
    head = tl.arange(0, BLOCK)[None, :]
    tail = BLOCK + tl.arange(0, TAIL)[None, :]
    addressed = tl.minimum(token, tokens - 1)  # and address the last one, so one unmasked load per row stays in bounds
    return head, head < limit, tail, tail < limit, batch * tokens + token, addressed, written


@triton.jit
def load_rows(pointer, batch, token, batch_stride, token_stride, columns, mask):
    """Rows (batch, token) of an activation whose last dimension has stride 1, as float32."""
    return tl.load(pointer + batch * batch_stride + token * token_stride + columns, mask=mask, other=0.0,
                   eviction_policy="evict_first").to(tl.float32)


@triton.jit
def store_rows(pointer, row, hidden, values, columns, mask):
    """Rows of a new contiguous [rows, D] output, rounded once to its dtype; returns them as
    stored, in float32 (a norm that follows reads a sum as stored, as the next layer will)."""
    stored = values.to(pointer.dtype.element_ty)
    tl.store(pointer + row * hidden + columns, stored, mask=mask, eviction_policy="evict_first")
    return stored.to(tl.float32)


@triton.jit
def load_modulation(pointer, batch, token, batch_stride, group_stride, group_size, DIM_STRIDE: tl.constexpr, columns,
                    mask):
    """The modulation vectors of rows (batch, token) ([ROWS, 1] each), as a float32 tile.

    Every form of docs/ops.md is one addressing rule: a scalar has all strides 0, a [D] vector only
    DIM_STRIDE, a per-batch vector a batch_stride, a per-token one a group_stride with
    group_size 1, and a per-frame one a group_stride with group_size = S // F tokens. A table
    read through a modulation_index is a group_stride with group_size 1, and ``token`` is then
    the row's index value (modulated_norm.py).
    DIM_STRIDE is a constexpr so that a value shared by all columns (a scalar: 0) is one load
    per row, broadcast: read per column, it cost a scalar-modulated RMSNorm at D = 1536 a
    third of its bandwidth on an H200 (52% of copy against 86% with vectors)."""
    offset = batch * batch_stride + (token // group_size) * group_stride
    if DIM_STRIDE == 0:
        values = tl.load(pointer + offset)  # [ROWS, 1]
    else:
        values = tl.load(pointer + offset + columns * DIM_STRIDE, mask=mask, other=0.0)
    return values.to(tl.float32)


@triton.jit
def _folded(head, tail):
    """head [ROWS, BLOCK] as [ROWS, BLOCK // TAIL, TAIL] (TAIL <= BLOCK, both powers of two)."""
    return tl.reshape(head, [head.shape[0], head.shape[1] // tail.shape[1], tail.shape[1]])


@triton.jit
def row_sum(head, tail, FOLD: tl.constexpr):
    """Each row's sum over its head and tail tiles, [ROWS, 1]. FOLD: the head's columns j, j +
    TAIL, ... are added into the tail's column j first, so that a row is one reduction across
    threads, not one per tile (each a round of lane exchanges and, with several warps, barriers);
    the sum's order differs, so the launch table chooses it by D and device (launch.py)."""
    if FOLD:
        return tl.sum(tl.sum(_folded(head, tail), axis=1) + tail, axis=1)[:, None]
    return (tl.sum(head, axis=1) + tl.sum(tail, axis=1))[:, None]


@triton.jit
def normalize(head, tail, head_mask, tail_mask, hidden, eps, RMS: tl.constexpr, FOLD: tl.constexpr = False):
    """LayerNorm (biased variance) or RMSNorm of each float32 row held as head and tail (zeros
    where masked), before any affine; FOLD: row_sum's. eps is cast to float32: Inductor passes
    a Python float as float64 (Triton's own launch as float32), which made every value after it
    float64 and the kernel much slower inside compiled graphs."""
    eps = tl.cast(eps, tl.float32)  # not eps.to: where Inductor analyses the kernel, eps is a Python float
    if RMS:
        inverse = tl.rsqrt(row_sum(head * head, tail * tail, FOLD) / hidden + eps)
    else:
        mean = row_sum(head, tail, FOLD) / hidden
        head = tl.where(head_mask, head - mean, 0.0)
        tail = tl.where(tail_mask, tail - mean, 0.0)
        inverse = tl.rsqrt(row_sum(head * head, tail * tail, FOLD) / hidden + eps)
    return head * inverse, tail * inverse


@triton.jit
def fold_affine(multiplier, addend, weight, bias, columns, mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """(m, a) with (n * weight + bias) * multiplier + addend = n * m + a: the norm's optional
    elementwise weight and bias folded into what is applied after it, over the columns of one
    tile, so each output is one multiply-add of the normalised value."""
    if HAS_BIAS:
        addend = tl.load(bias + columns, mask=mask, other=0.0).to(tl.float32) * multiplier + addend
    if HAS_WEIGHT:
        multiplier = tl.load(weight + columns, mask=mask, other=0.0).to(tl.float32) * multiplier
    return multiplier, addend


@triton.jit
def _saturate(values, FP8_MAX: tl.constexpr):
    """values clamped to +-FP8_MAX, NaN kept (Triton's min and max drop it; tl.clamp's
    propagate_nan keeps it, one instruction a value on sm_90 against a compare and select per
    bound)."""
    return tl.clamp(values, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def amax_bits(values):
    """The bits of each row's largest magnitude in a float32 tile, [ROWS, 1] int32. A
    magnitude's bits order as its value, with Inf above every finite value and NaN above Inf:
    one integer max finds the amax and whether the row is finite (Triton's max drops NaN)."""
    return tl.max(values.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)[:, None]


@triton.jit
def row_amax_bits(head, tail, FOLD: tl.constexpr):
    """amax_bits of rows held as head and tail tiles; FOLD: folded as row_sum's (a maximum's
    order does not change it)."""
    if FOLD:
        head = tl.max(_folded(head.to(tl.int32, bitcast=True) & 0x7FFFFFFF, tail), axis=1)
        return tl.max(tl.maximum(head, tail.to(tl.int32, bitcast=True) & 0x7FFFFFFF), axis=1)[:, None]
    return tl.maximum(amax_bits(head), amax_bits(tail))


@triton.jit
def row_scale(bits, static_scale, FP8_MAX: tl.constexpr, HAS_STATIC_SCALE: tl.constexpr):
    """The float32 scale of rows whose amax_bits are ``bits`` (backends/reference's
    _quantize_rows is the definition): dynamic, the amax over FP8_MAX, floored at
    1e-12 / FP8_MAX, and NaN for a row holding NaN or Inf; or the one static scale."""
    if HAS_STATIC_SCALE:
        return tl.zeros_like(bits).to(tl.float32) + tl.load(static_scale).to(tl.float32)
    amax = bits.to(tl.float32, bitcast=True)
    return tl.where(bits >= 0x7F800000, float("nan"), tl.maximum(amax, 1e-12) / FP8_MAX)


@triton.jit
def store_fp8(pointer, values, inverse, mask, FP8_MAX: tl.constexpr):
    """A tile stored as FP8 values of its scale's ``inverse``, beyond +-FP8_MAX saturating (NaN
    stays NaN)."""
    tl.store(pointer, _saturate(values * inverse, FP8_MAX).to(pointer.dtype.element_ty), mask=mask,
             eviction_policy="evict_first")


@triton.jit
def store_quantized(y, y_scale, static_scale, row, hidden, values, values_tail, head, head_mask, tail, tail_mask,
                    written, FP8_MAX: tl.constexpr, HAS_STATIC_SCALE: tl.constexpr, FOLD: tl.constexpr = False):
    """Rows held as head and tail (zeros where masked), stored as FP8 values with one float32
    scale per row (row_scale) where ``written`` (row_tile's: the call's rows); FOLD: row_sum's."""
    scale = row_scale(row_amax_bits(values, values_tail, FOLD), static_scale, FP8_MAX, HAS_STATIC_SCALE)
    inverse = 1.0 / scale  # one division per row: an IEEE division per value made the kernel compute-bound
    store_fp8(y + row * hidden + head, values, inverse, head_mask, FP8_MAX)
    store_fp8(y + row * hidden + tail, values_tail, inverse, tail_mask, FP8_MAX)
    tl.store(y_scale + row, scale, mask=written)

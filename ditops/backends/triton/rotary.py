"""RoPE on q and k, optionally after an RMSNorm of each head (ops 5 and 6).

The results go to q_out and k_out: q and k themselves in eager (in place), new tensors in a
compiled graph, whose functional node lets Inductor drop the copies around an in-place op.

One program per token: it reads the token's cos/sin row once and applies it to every q and
k head, Q_BLOCK_HEADS (K_BLOCK_HEADS) heads at a time as a [heads, Dh] tile: q and k have
their own head block, so GQA's few k heads do not pass through a tile sized for q's many.
Such a program loads k only after storing q (the compiler cannot tell that they do not
overlap): two memory round trips in a row. A short call is one wave of programs waiting on
them, so there (SPLIT, launch.rotary_launch) a token gets two programs, one for q and one
for k, on a grid of (tokens, 2). The same operations either way: the same bits.
A head is loaded as its rotated pairs (x1, x2) and, with partial rotary, the dims [R, Dh)
after them, so each element is read once and written once. Interleaved pairs (2j, 2j+1)
are loaded as one contiguous tile and split, so the loads stay wide; NeoX pairs
(j, j + R/2) are two contiguous half loads. The pairs are a head tile (HALF_HEAD, the largest
power of two not above R/2) and a tail tile (HALF_TAIL, 0 where R/2 is a power of two), as
the row kernels' head and tail: at Dh 80 and 96 a single power-of-two tile left 37.5% and
25% of its lanes as padding (launch.rotary_launch has the measurements). Calls of a middle
token range store q_out and k_out with evict_first (STORE_EVICTION, a cache hint: the same
bits); the launch table says where and why.
With TOKEN_NORM (qk_norm_rope_'s norm_over="token") the RMS runs over all heads of a token:
the launch puts a tensor's heads in one block, so the loop makes one pass and the sum of the
block's squares is the token's. LAYER (norm="layer") subtracts the mean first, from the values
held (the masked lanes stay zero, so the squares count only real values), and adds the biases
after the weights.
A cache with a row per head (HEAD_CACHE: [P, H, R], [B, P, H, R]; LTX-2's tables) is read per
head block, a [heads, pairs] tile of cos and sin beside the head tile, through the cache's batch,
position and head strides (a batch stride of 0: one table for every item). A shared [P, R] cache
keeps its one [1, pairs] load per token, broadcast over the heads: a head stride of 0 would make
it the same code path, but one that loads each head block's rows again."""

import triton
import triton.language as tl


@triton.jit
def _load_pairs(row, head_mask, first, half, rotary_dim, WIDTH: tl.constexpr, INTERLEAVED: tl.constexpr):
    """x1 and x2 of the pairs [first, first + WIDTH) of each head row, in float32."""
    pair = first + tl.arange(0, WIDTH)[None, :]
    if INTERLEAVED:
        both = 2 * first + tl.arange(0, 2 * WIDTH)[None, :]
        tile = tl.load(row + both, mask=head_mask & (both < rotary_dim), other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(tile, (tile.shape[0], WIDTH, 2)))
    else:
        mask = head_mask & (pair < half)
        x1 = tl.load(row + pair, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(row + half + pair, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _cos_sin(cache_row, mask, first, half, WIDTH: tl.constexpr):
    """The cos and sin of the pairs [first, first + WIDTH) at a position, in float32 (cache_row:
    one row, or a row per head where mask masks the heads past the last)."""
    pair = first + tl.arange(0, WIDTH)[None, :]
    in_pair = mask & (pair < half)
    cos = tl.load(cache_row + pair, mask=in_pair, other=0.0).to(tl.float32)
    sin = tl.load(cache_row + half + pair, mask=in_pair, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def _pair_params(params, mask, first, half, WIDTH: tl.constexpr, INTERLEAVED: tl.constexpr, PER_HEAD: tl.constexpr):
    """A norm weight's or bias's values at the dims of x1 and x2 of the pairs [first, first +
    WIDTH), in float32 (params: one [Dh] row, or with PER_HEAD a row per head where mask masks
    the heads past the last). Interleaved rows per head load as _load_pairs loads the heads,
    one contiguous tile split: as two loads of every other value (element-wide gathers) they
    cost the token-norm kernel more than the heads' own loads (H200, bf16: Wan2.1-14B 5377 ->
    1443 us, LTX-2 280 -> 62). One [Dh] row keeps the two loads: split, it was 12% slower on
    Z-Image's per-head rows (H30 Dh128)."""
    if INTERLEAVED and PER_HEAD:
        return _load_pairs(params, mask, first, half, 2 * half, WIDTH, INTERLEAVED)
    pair = first + tl.arange(0, WIDTH)[None, :]
    if INTERLEAVED:
        first_index, second_index = 2 * pair, 2 * pair + 1
    else:
        first_index, second_index = pair, half + pair
    in_pair = mask & (pair < half)
    return (tl.load(params + first_index, mask=in_pair, other=0.0).to(tl.float32),
            tl.load(params + second_index, mask=in_pair, other=0.0).to(tl.float32))


@triton.jit
def _center_pairs(x1, x2, mean, head_mask, first, half, WIDTH: tl.constexpr):
    """x1 and x2 less their norm's mean, zero where masked (a LayerNorm's squares then count
    only real values)."""
    pair = first + tl.arange(0, WIDTH)[None, :]
    mask = head_mask & (pair < half)
    return tl.where(mask, x1 - mean, 0.0), tl.where(mask, x2 - mean, 0.0)


@triton.jit
def _store_pairs(out, head_mask, x1, x2, cos, sin, first, half, rotary_dim, WIDTH: tl.constexpr, INTERLEAVED: tl.constexpr,
                 EVICTION: tl.constexpr):
    """The pairs rotated by their cos/sin, stored where _load_pairs read them."""
    out1 = (x1 * cos - x2 * sin).to(out.dtype.element_ty)
    out2 = (x2 * cos + x1 * sin).to(out.dtype.element_ty)
    pair = first + tl.arange(0, WIDTH)[None, :]
    if INTERLEAVED:
        both = 2 * first + tl.arange(0, 2 * WIDTH)[None, :]
        tile = tl.reshape(tl.join(out1, out2), (out1.shape[0], 2 * WIDTH))
        tl.store(out + both, tile, mask=head_mask & (both < rotary_dim), eviction_policy=EVICTION)
    else:
        mask = head_mask & (pair < half)
        tl.store(out + pair, out1, mask=mask, eviction_policy=EVICTION)
        tl.store(out + half + pair, out2, mask=mask, eviction_policy=EVICTION)


@triton.jit
def _rotate_heads(
    base, target, head_stride, heads, weight, bias, cos_h, sin_h, cos_t, sin_t, cache_row, cache_head_stride,
    head_size, rotary_dim, eps,
    NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, HALF_HEAD: tl.constexpr, HALF_TAIL: tl.constexpr, BLOCK_REST: tl.constexpr,
    EVICTION: tl.constexpr, TOKEN_NORM: tl.constexpr, LAYER: tl.constexpr, HAS_BIAS: tl.constexpr,
    HEAD_CACHE: tl.constexpr,
):
    """TOKEN_NORM: one norm over all the token's heads, which the launch puts in one block (one
    pass of the loop below), with a weight (and bias) row per head; else one per head, one [Dh]
    weight (and bias). HEAD_CACHE: each head block's cos/sin from its rows at cache_row (cos_h ...
    sin_t unused), else the token's (cos_h, sin_h: the pairs' head tile; cos_t, sin_t: their tail)."""
    half = rotary_dim // 2
    rest = rotary_dim + tl.arange(0, BLOCK_REST)[None, :]
    for first_head in range(0, heads, BLOCK_HEADS):
        head = first_head + tl.arange(0, BLOCK_HEADS)[:, None]
        head_mask = head < heads
        row = base + head * head_stride
        out = target + head * head_stride
        rest_mask = head_mask & (rest < head_size)
        head_cos, head_sin, tail_cos, tail_sin = cos_h, sin_h, cos_t, sin_t
        if HEAD_CACHE:
            head_rows = cache_row + head * cache_head_stride
            head_cos, head_sin = _cos_sin(head_rows, head_mask, 0, half, HALF_HEAD)
            if HALF_TAIL > 0:
                tail_cos, tail_sin = _cos_sin(head_rows, head_mask, HALF_HEAD, half, HALF_TAIL)
        a1, a2 = _load_pairs(row, head_mask, 0, half, rotary_dim, HALF_HEAD, INTERLEAVED)
        if HALF_TAIL > 0:
            b1, b2 = _load_pairs(row, head_mask, HALF_HEAD, half, rotary_dim, HALF_TAIL, INTERLEAVED)
        if NORM:
            tail = tl.load(row + rest, mask=rest_mask, other=0.0).to(tl.float32)
            if LAYER:
                sums = tl.sum(a1, axis=1) + tl.sum(a2, axis=1) + tl.sum(tail, axis=1)
                if HALF_TAIL > 0:
                    sums += tl.sum(b1, axis=1) + tl.sum(b2, axis=1)
                if TOKEN_NORM:
                    mean = tl.sum(sums, axis=0) / (heads * head_size)
                else:
                    mean = (sums / head_size)[:, None]
                a1, a2 = _center_pairs(a1, a2, mean, head_mask, 0, half, HALF_HEAD)
                if HALF_TAIL > 0:
                    b1, b2 = _center_pairs(b1, b2, mean, head_mask, HALF_HEAD, half, HALF_TAIL)
                tail = tl.where(rest_mask, tail - mean, 0.0)
            squares = tl.sum(a1 * a1, axis=1) + tl.sum(a2 * a2, axis=1)
            if HALF_TAIL > 0:
                squares += tl.sum(b1 * b1, axis=1) + tl.sum(b2 * b2, axis=1)
            squares += tl.sum(tail * tail, axis=1)
            head_weight, head_bias, weight_mask = weight, bias, True
            if TOKEN_NORM:  # masked heads hold zeros: they add nothing
                inverse_rms = tl.rsqrt(tl.sum(squares, axis=0) / (heads * head_size) + eps)
                weight_mask = head_mask
                if HAS_WEIGHT:  # an absent weight or bias is None: no address to offset
                    head_weight = weight + head * head_size
                if HAS_BIAS:
                    head_bias = bias + head * head_size
            else:
                inverse_rms = tl.rsqrt(squares / head_size + eps)[:, None]
            a1, a2, tail = a1 * inverse_rms, a2 * inverse_rms, tail * inverse_rms
            if HALF_TAIL > 0:
                b1, b2 = b1 * inverse_rms, b2 * inverse_rms
            if HAS_WEIGHT:
                w1, w2 = _pair_params(head_weight, weight_mask, 0, half, HALF_HEAD, INTERLEAVED, TOKEN_NORM)
                a1, a2 = a1 * w1, a2 * w2
                if HALF_TAIL > 0:
                    w1, w2 = _pair_params(head_weight, weight_mask, HALF_HEAD, half, HALF_TAIL, INTERLEAVED, TOKEN_NORM)
                    b1, b2 = b1 * w1, b2 * w2
                tail = tail * tl.load(head_weight + rest, mask=weight_mask & (rest < head_size), other=0.0).to(tl.float32)
            if HAS_BIAS:
                c1, c2 = _pair_params(head_bias, weight_mask, 0, half, HALF_HEAD, INTERLEAVED, TOKEN_NORM)
                a1, a2 = a1 + c1, a2 + c2
                if HALF_TAIL > 0:
                    c1, c2 = _pair_params(head_bias, weight_mask, HALF_HEAD, half, HALF_TAIL, INTERLEAVED, TOKEN_NORM)
                    b1, b2 = b1 + c1, b2 + c2
                tail = tail + tl.load(head_bias + rest, mask=weight_mask & (rest < head_size), other=0.0).to(tl.float32)
            tl.store(out + rest, tail.to(target.dtype.element_ty), mask=rest_mask, eviction_policy=EVICTION)
        _store_pairs(out, head_mask, a1, a2, head_cos, head_sin, 0, half, rotary_dim, HALF_HEAD, INTERLEAVED, EVICTION)
        if HALF_TAIL > 0:
            _store_pairs(out, head_mask, b1, b2, tail_cos, tail_sin, HALF_HEAD, half, rotary_dim, HALF_TAIL, INTERLEAVED,
                         EVICTION)


@triton.jit
def rotary_kernel(
    q, q_batch_stride, q_token_stride, q_heads,
    k, k_batch_stride, k_token_stride, k_heads,
    q_out, q_out_batch_stride, q_out_token_stride,
    k_out, k_out_batch_stride, k_out_token_stride,
    q_weight, k_weight, q_bias, k_bias,
    cache, cache_batch_stride, cache_row_stride, cache_head_stride,
    positions, positions_batch_stride, positions_token_stride, position_offset,
    tokens, head_size, rotary_dim, eps,
    NORM: tl.constexpr, TOKEN_NORM: tl.constexpr, HAS_Q_WEIGHT: tl.constexpr, HAS_K_WEIGHT: tl.constexpr,
    LAYER: tl.constexpr, HAS_Q_BIAS: tl.constexpr, HAS_K_BIAS: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_K: tl.constexpr, HAS_POSITIONS: tl.constexpr, HEAD_CACHE: tl.constexpr,
    Q_BLOCK_HEADS: tl.constexpr, K_BLOCK_HEADS: tl.constexpr, HALF_HEAD: tl.constexpr, HALF_TAIL: tl.constexpr,
    BLOCK_REST: tl.constexpr, SPLIT: tl.constexpr, STORE_EVICTION: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)
    batch, token = program // tokens, program % tokens
    eps = tl.cast(eps, tl.float32)  # also where Inductor passes it as float64 (row_math.normalize says why)
    if HAS_POSITIONS:
        position = tl.load(positions + batch * positions_batch_stride + token * positions_token_stride).to(tl.int64)
    else:
        position = token + position_offset
    half = rotary_dim // 2
    cache_row = cache + position * cache_row_stride
    if HEAD_CACHE:  # _rotate_heads loads each head block's rows
        cache_row += batch * cache_batch_stride
        cos_h, sin_h, cos_t, sin_t = 0.0, 0.0, 0.0, 0.0
    else:
        cos_h, sin_h = _cos_sin(cache_row, True, 0, half, HALF_HEAD)
        cos_t, sin_t = cos_h, sin_h
        if HALF_TAIL > 0:
            cos_t, sin_t = _cos_sin(cache_row, True, HALF_HEAD, half, HALF_TAIL)
    q_row = q + batch * q_batch_stride + token * q_token_stride
    q_target = q_out + batch * q_out_batch_stride + token * q_out_token_stride
    if HAS_K:
        k_row = k + batch * k_batch_stride + token * k_token_stride
        k_target = k_out + batch * k_out_batch_stride + token * k_out_token_stride
    if SPLIT:  # (tokens, 2) programs; the launch code splits only calls with k
        if tl.program_id(1) == 0:
            _rotate_heads(q_row, q_target, head_size, q_heads, q_weight, q_bias, cos_h, sin_h, cos_t, sin_t, cache_row,
                          cache_head_stride, head_size, rotary_dim, eps, NORM, HAS_Q_WEIGHT, INTERLEAVED, Q_BLOCK_HEADS,
                          HALF_HEAD, HALF_TAIL, BLOCK_REST, STORE_EVICTION, TOKEN_NORM, LAYER, HAS_Q_BIAS, HEAD_CACHE)
        else:
            _rotate_heads(k_row, k_target, head_size, k_heads, k_weight, k_bias, cos_h, sin_h, cos_t, sin_t, cache_row,
                          cache_head_stride, head_size, rotary_dim, eps, NORM, HAS_K_WEIGHT, INTERLEAVED, K_BLOCK_HEADS,
                          HALF_HEAD, HALF_TAIL, BLOCK_REST, STORE_EVICTION, TOKEN_NORM, LAYER, HAS_K_BIAS, HEAD_CACHE)
    else:
        _rotate_heads(q_row, q_target, head_size, q_heads, q_weight, q_bias, cos_h, sin_h, cos_t, sin_t, cache_row,
                      cache_head_stride, head_size, rotary_dim, eps, NORM, HAS_Q_WEIGHT, INTERLEAVED, Q_BLOCK_HEADS,
                      HALF_HEAD, HALF_TAIL, BLOCK_REST, STORE_EVICTION, TOKEN_NORM, LAYER, HAS_Q_BIAS, HEAD_CACHE)
        if HAS_K:
            _rotate_heads(k_row, k_target, head_size, k_heads, k_weight, k_bias, cos_h, sin_h, cos_t, sin_t, cache_row,
                          cache_head_stride, head_size, rotary_dim, eps, NORM, HAS_K_WEIGHT, INTERLEAVED, K_BLOCK_HEADS,
                          HALF_HEAD, HALF_TAIL, BLOCK_REST, STORE_EVICTION, TOKEN_NORM, LAYER, HAS_K_BIAS, HEAD_CACHE)

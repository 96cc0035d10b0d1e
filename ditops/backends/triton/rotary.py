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
(j, j + R/2) are two contiguous half loads."""

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    base, target, head_stride, heads, weight, cos, sin, head_size, rotary_dim, eps,
    NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):
    half = rotary_dim // 2
    pair = tl.arange(0, BLOCK_HALF)[None, :]
    rest = rotary_dim + tl.arange(0, BLOCK_REST)[None, :]
    for first_head in range(0, heads, BLOCK_HEADS):
        head = first_head + tl.arange(0, BLOCK_HEADS)[:, None]
        row = base + head * head_stride
        out = target + head * head_stride
        pair_mask = (head < heads) & (pair < half)
        rest_mask = (head < heads) & (rest < head_size)
        if INTERLEAVED:
            both = tl.arange(0, 2 * BLOCK_HALF)[None, :]
            tile = tl.load(row + both, mask=(head < heads) & (both < rotary_dim), other=0.0).to(tl.float32)
            x1, x2 = tl.split(tl.reshape(tile, (BLOCK_HEADS, BLOCK_HALF, 2)))
            first_index, second_index = 2 * pair, 2 * pair + 1
        else:
            x1 = tl.load(row + pair, mask=pair_mask, other=0.0).to(tl.float32)
            x2 = tl.load(row + half + pair, mask=pair_mask, other=0.0).to(tl.float32)
            first_index, second_index = pair, half + pair
        if NORM:
            tail = tl.load(row + rest, mask=rest_mask, other=0.0).to(tl.float32)
            squares = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(tail * tail, axis=1)
            inverse_rms = tl.rsqrt(squares / head_size + eps)[:, None]
            x1, x2, tail = x1 * inverse_rms, x2 * inverse_rms, tail * inverse_rms
            if HAS_WEIGHT:
                in_pair = pair < half
                x1 = x1 * tl.load(weight + first_index, mask=in_pair, other=0.0).to(tl.float32)
                x2 = x2 * tl.load(weight + second_index, mask=in_pair, other=0.0).to(tl.float32)
                tail = tail * tl.load(weight + rest, mask=rest < head_size, other=0.0).to(tl.float32)
            tl.store(out + rest, tail.to(target.dtype.element_ty), mask=rest_mask)
        out1 = (x1 * cos - x2 * sin).to(target.dtype.element_ty)
        out2 = (x2 * cos + x1 * sin).to(target.dtype.element_ty)
        if INTERLEAVED:
            both = tl.arange(0, 2 * BLOCK_HALF)[None, :]
            tile = tl.reshape(tl.join(out1, out2), (BLOCK_HEADS, 2 * BLOCK_HALF))
            tl.store(out + both, tile, mask=(head < heads) & (both < rotary_dim))
        else:
            tl.store(out + pair, out1, mask=pair_mask)
            tl.store(out + half + pair, out2, mask=pair_mask)


@triton.jit
def rotary_kernel(
    q, q_batch_stride, q_token_stride, q_heads,
    k, k_batch_stride, k_token_stride, k_heads,
    q_out, q_out_batch_stride, q_out_token_stride,
    k_out, k_out_batch_stride, k_out_token_stride,
    q_weight, k_weight,
    cache, cache_row_stride,
    positions, positions_batch_stride, positions_token_stride, position_offset,
    tokens, head_size, rotary_dim, eps,
    NORM: tl.constexpr, HAS_Q_WEIGHT: tl.constexpr, HAS_K_WEIGHT: tl.constexpr,
    INTERLEAVED: tl.constexpr, HAS_K: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    Q_BLOCK_HEADS: tl.constexpr, K_BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
    SPLIT: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)
    batch, token = program // tokens, program % tokens
    eps = tl.cast(eps, tl.float32)  # also where Inductor passes it as float64 (row_math.normalize says why)
    if HAS_POSITIONS:
        position = tl.load(positions + batch * positions_batch_stride + token * positions_token_stride).to(tl.int64)
    else:
        position = token + position_offset
    pair = tl.arange(0, BLOCK_HALF)[None, :]
    half = rotary_dim // 2
    cache_row = cache + position * cache_row_stride
    cos = tl.load(cache_row + pair, mask=pair < half, other=0.0).to(tl.float32)
    sin = tl.load(cache_row + half + pair, mask=pair < half, other=0.0).to(tl.float32)
    q_row = q + batch * q_batch_stride + token * q_token_stride
    q_target = q_out + batch * q_out_batch_stride + token * q_out_token_stride
    if HAS_K:
        k_row = k + batch * k_batch_stride + token * k_token_stride
        k_target = k_out + batch * k_out_batch_stride + token * k_out_token_stride
    if SPLIT:  # (tokens, 2) programs; the launch code splits only calls with k
        if tl.program_id(1) == 0:
            _rotate_heads(q_row, q_target, head_size, q_heads, q_weight, cos, sin, head_size, rotary_dim, eps, NORM,
                          HAS_Q_WEIGHT, INTERLEAVED, Q_BLOCK_HEADS, BLOCK_HALF, BLOCK_REST)
        else:
            _rotate_heads(k_row, k_target, head_size, k_heads, k_weight, cos, sin, head_size, rotary_dim, eps, NORM,
                          HAS_K_WEIGHT, INTERLEAVED, K_BLOCK_HEADS, BLOCK_HALF, BLOCK_REST)
    else:
        _rotate_heads(q_row, q_target, head_size, q_heads, q_weight, cos, sin, head_size, rotary_dim, eps, NORM,
                      HAS_Q_WEIGHT, INTERLEAVED, Q_BLOCK_HEADS, BLOCK_HALF, BLOCK_REST)
        if HAS_K:
            _rotate_heads(k_row, k_target, head_size, k_heads, k_weight, cos, sin, head_size, rotary_dim, eps, NORM,
                          HAS_K_WEIGHT, INTERLEAVED, K_BLOCK_HEADS, BLOCK_HALF, BLOCK_REST)

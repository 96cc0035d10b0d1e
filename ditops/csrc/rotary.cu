// Ops 5 and 6, in place: per token and head, optionally RMSNorm or LayerNorm over the head
// (q_weight or k_weight; LayerNorm also q_bias or k_bias), then RoPE on the first R dims;
// `rotary_token_norm` at the end: qk_norm_rope_'s norm_over="token", one norm over all heads
// of a token.
//
// A head is held by HEAD_THREADS consecutive lanes, each holding whole rotated pairs (see
// `kLaneChunks` below): one chunk of 8 values a lane for interleaved pairs (at least Dh / 8
// lanes), two for NeoX pairs (at least Dh / 16), so no lane exchanges values but for the
// norm's sums; lanes past Dh idle. A head never straddles a 32-lane segment: a segment holds
// 32 / HEAD_THREADS heads' lanes, its slots. The launch code picks the widest HEAD_THREADS
// that packs as many heads per segment as the fewest lanes would, so few instances serve
// every Dh at no cost in lanes. A slot takes up to ITEMS heads of one token
// and one tensor, loaded together: a token (a row of the B * S) has ceil(Hq / ITEMS) q slots
// then ceil(Hk / ITEMS) k slots, consecutive in the grid (they may straddle blocks, and a block
// holds several tokens when heads are few), and slot j of a tensor takes its heads j,
// j + slots, ... So each token costs one memory round trip, and a thread, which keeps the same
// columns of one token and one tensor, loads its cos/sin (with a cos/sin row per head, each of
// its heads') and norm weight once. Calls in the launch table's streaming_stores token range
// take the instance that stores q and k with the streaming cache hint: the same bits.
#include "memory.cuh"
#include "reductions.cuh"

// q or k: tokens of heads [B, S, H, Dh], heads and dims contiguous.
struct Heads {
    void* data;
    long long batch_stride;
    long long token_stride;
};

// A norm weight or bias ([Dh], or [H * Dh] for the token norm) of any dtype, or nothing
// (data == nullptr).
struct Weight {
    const void* data;
    long long dtype;
};

// cos/sin rows of R values (R/2 cos then R/2 sin), float32 or 16-bit: one per position, or with
// HEAD_CACHE (a kernel's template flag) one per position and head, of one table or of a table per
// batch item (batch_stride 0: one table for every item). Strides in elements.
struct CosSinCache {
    const void* data;
    long long dtype;
    long long row_stride;
    long long batch_stride;
    long long head_stride;
};

// The row of a position (and, with HEAD_CACHE, of a batch item's table and a head).
template <bool HEAD_CACHE>
__device__ inline const void* cache_row(const CosSinCache& cache, long long batch, long long position, long long head) {
    long long offset = position * cache.row_stride;
    if constexpr (HEAD_CACHE) offset += batch * cache.batch_stride + head * cache.head_stride;
    return static_cast<const char*>(cache.data) + offset * (cache.dtype == kFloat32 ? 4 : 2);
}

// The 4 interleaved pairs (v[2p], v[2p + 1]) of a chunk rotated by (c[p], s[p]).
__device__ inline void rotate_interleaved(float (&v)[kChunk], const float (&c)[kChunk], const float (&s)[kChunk]) {
#pragma unroll
    for (int p = 0; p < kChunk / 2; ++p) {
        const float even = v[2 * p], odd = v[2 * p + 1];
        v[2 * p] = even * c[p] - odd * s[p];
        v[2 * p + 1] = odd * c[p] + even * s[p];
    }
}

// NeoX: pair e is (a[e], b[e]), the two halves of the rotated dims.
__device__ inline void rotate_neox(float (&a)[kChunk], float (&b)[kChunk], const float (&c)[kChunk],
                                   const float (&s)[kChunk]) {
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
        const float x = a[e], y = b[e];
        a[e] = x * c[e] - y * s[e];
        b[e] = y * c[e] + x * s[e];
    }
}

// STREAMING: q and k stored with the streaming cache hint (a template flag: chosen at run time
// per store, it made the float16 instances spill on sm_90). MIN_BLOCKS: the launch table's.
// LAYER: LayerNorm rather than RMSNorm (qk_norm_rope_'s norm="layer"; `norm` is then set), a
// template flag so that the RMSNorm and RoPE-only calls keep their code and registers: its
// means and biases are held beside the weights. HEAD_CACHE: a cos/sin row per head, so a thread
// loads one per item (else one for all its heads); a flag for the same reason.
template <typename T, bool INTERLEAVED, int HEAD_THREADS, int BLOCK, int ITEMS, bool STREAMING, int MIN_BLOCKS, bool LAYER,
          bool HEAD_CACHE>
__global__ void LAUNCH_BOUNDS(BLOCK, MIN_BLOCKS) rotary(
    Heads q, Heads k, Weight q_weight, Weight k_weight, Weight q_bias, Weight k_bias, CosSinCache cache, Integers positions,
    long long q_heads, long long k_heads, long long tokens, Divisor by_tokens, Divisor by_token_slots, long long rows,
    long long head_size, long long rotary_dim, long long position_offset, float eps, long long norm) {
    constexpr int kSegmentHeads = kSegment / HEAD_THREADS;
    static_assert(kSegmentHeads >= 1 && BLOCK % kSegment == 0, "whole heads in whole segments");
    const int segment_lane = threadIdx.x % kSegment, member = segment_lane % HEAD_THREADS;

    // This thread's slot, token and tensor. 32-bit: the launch code keeps every slot of the grid
    // below 2^31 (as Divisor requires), and 64-bit division is slow.
    const unsigned q_slots = static_cast<unsigned>((q_heads + ITEMS - 1) / ITEMS);
    const unsigned token_slots = q_slots + static_cast<unsigned>((k_heads + ITEMS - 1) / ITEMS);
    const unsigned slot = blockIdx.x * (BLOCK / kSegment * kSegmentHeads) + threadIdx.x / kSegment * kSegmentHeads
                          + segment_lane / HEAD_THREADS;
    const unsigned row = by_token_slots.divide(slot), token_slot = slot - row * token_slots;
    const unsigned batch = by_tokens.divide(row), token = row - batch * static_cast<unsigned>(tokens);
    const bool in_q = token_slot < q_slots;
    const Heads tensor = in_q ? q : k;
    const long long heads = in_q ? q_heads : k_heads;
    const unsigned first_head = in_q ? token_slot : token_slot - q_slots, slots = in_q ? q_slots : token_slots - q_slots;

    // A lane's chunks of a head (kLaneChunks of them, A at column a and B at column b) hold
    // whole rotated pairs, so no lane needs another's values. Interleaved pairs (2j, 2j + 1)
    // lie inside a chunk: lane m holds chunk A = dims 8m .. 8m + 7. NeoX pairs (j, j + R/2) lie
    // R/2 apart: lane m < R/16 holds x[j] in A and x[j + R/2] in B for its 8 pairs
    // j = 8m .. 8m + 7, and the lanes after it hold the dims [R, Dh) in two runs of chunks, A
    // lane by lane and B as far on again, so that each load of the warp is contiguous. R is a
    // multiple of 16 (the registry's rotary_dim_multiple_of).
    constexpr int kLaneChunks = INTERLEAVED ? 1 : 2;
    const int half = static_cast<int>(rotary_dim / 2);
    const int pair_lanes = INTERLEAVED ? 0 : half / kChunk, first = INTERLEAVED ? 0 : static_cast<int>(rotary_dim);
    const bool neox_pair = member < pair_lanes;
    const int a = neox_pair ? member * kChunk : first + (member - pair_lanes) * kChunk;
    const int column[2] = {a, neox_pair ? half + a : a + (HEAD_THREADS - pair_lanes) * kChunk};
    const bool rotated = neox_pair || (INTERLEAVED && a < rotary_dim);
    // Lanes past the segment's last whole head or past Dh, and slots past the last token, touch
    // no memory (they hold zeros, which add nothing to a head's sum).
    const bool valid = segment_lane < kSegmentHeads * HEAD_THREADS && a < head_size && row < rows;
    const bool has[2] = {valid, valid && column[1] < head_size};

    // The loads first: they need no position, cos/sin or weight. Chunks stay as loaded (16-byte
    // words of T, half the registers of float for 16-bit data) until their head's turn.
    constexpr int kWords = ChunkWords<T>::count;
    T* const token_heads = static_cast<T*>(tensor.data) + batch * tensor.batch_stride + token * tensor.token_stride;
    uint4 words[ITEMS][kLaneChunks][kWords];
    bool stored[ITEMS];
#pragma unroll
    for (int item = 0; item < ITEMS; ++item) {
        const unsigned head = first_head + item * slots;
        stored[item] = valid && head < heads;
        const uint4* const head_words = reinterpret_cast<const uint4*>(token_heads + head * head_size);
#pragma unroll
        for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
            for (int w = 0; w < kWords; ++w)  // coherent loads: this kernel writes q and k
                words[item][j][w] = stored[item] && has[j] ? head_words[column[j] / kChunk * kWords + w] : make_uint4(0, 0, 0, 0);
        }
    }

    // cos and sin of this lane's pairs: NeoX's 8 (a .. a + 7), or the 4 interleaved pairs of A
    // (a / 2 ..); the same for every head, or with HEAD_CACHE each item's head's own.
    constexpr int kCacheRows = HEAD_CACHE ? ITEMS : 1;
    float c[kCacheRows][kChunk] = {}, s[kCacheRows][kChunk] = {};
    if (valid && rotated) {
        const long long position = positions.data ? load_integer(positions, batch, token) : position_offset + token;
#pragma unroll
        for (int r = 0; r < kCacheRows; ++r) {
            if (HEAD_CACHE && !stored[r]) continue;  // no such head: no such cache row
            const void* cos_row = cache_row<HEAD_CACHE>(cache, batch, position, first_head + r * slots);
            if constexpr (INTERLEAVED) {
                load_quad_of_dtype(cos_row, cache.dtype, a / 2, c[r]);
                load_quad_of_dtype(cos_row, cache.dtype, half + a / 2, s[r]);
            } else {
                load_chunk_of_dtype(cos_row, cache.dtype, a, c[r]);
                load_chunk_of_dtype(cos_row, cache.dtype, half + a, s[r]);
            }
        }
    }
    // The tensor's norm weight of each chunk, or ones where it has none (x * 1 is exact), and with
    // LAYER its bias, or -0 where it has none (x + -0 is x, also for x = -0, which + 0 makes +0).
    const Weight weight = in_q ? q_weight : k_weight, bias = in_q ? q_bias : k_bias;
    float w[kLaneChunks][kChunk], b[kLaneChunks][kChunk];
#pragma unroll
    for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) w[j][e] = 1.0f, b[j][e] = -0.0f;
        if (norm && has[j] && weight.data) load_chunk_of_dtype(weight.data, weight.dtype, column[j], w[j]);
        if (LAYER && has[j] && bias.data) load_chunk_of_dtype(bias.data, bias.dtype, column[j], b[j]);
    }

    // The norm: the sums of squares of this thread's heads reduced together (lane_group_sums:
    // their lane exchanges overlap), then each head normalised in its turn below. LayerNorm
    // first reduces the sums for the means, then squares the values less their mean.
    float mean[ITEMS] = {}, inverse_rms[ITEMS];
    if (norm) {
        if constexpr (LAYER) {
#pragma unroll
            for (int item = 0; item < ITEMS; ++item) {
#pragma unroll
                for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
                    for (int e = 0; e < kChunk; ++e) mean[item] += word_element<T>(words[item][j], e);
                }
            }
            lane_group_sums<HEAD_THREADS>(mean, member);
#pragma unroll
            for (int item = 0; item < ITEMS; ++item) mean[item] /= head_size;
        }
#pragma unroll
        for (int item = 0; item < ITEMS; ++item) {
            inverse_rms[item] = 0.0f;
#pragma unroll
            for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
                for (int e = 0; e < kChunk; ++e) {
                    float value = word_element<T>(words[item][j], e);
                    // chunks past Dh (and idle lanes) hold zeros, which less the mean would add mean^2
                    if constexpr (LAYER) value = has[j] ? value - mean[item] : 0.0f;
                    inverse_rms[item] += value * value;
                }
            }
        }
        lane_group_sums<HEAD_THREADS>(inverse_rms, member);
        // x / Dh as x * (1 / Dh) where that is exact (Dh a power of two, so HEAD_THREADS too): the
        // same bits, one division a thread rather than ITEMS
        if ((HEAD_THREADS & (HEAD_THREADS - 1)) == 0 && (head_size & (head_size - 1)) == 0) {
            const float inverse_head_size = 1.0f / static_cast<float>(head_size);
#pragma unroll
            for (int item = 0; item < ITEMS; ++item) inverse_rms[item] = rsqrtf(inverse_rms[item] * inverse_head_size + eps);
        } else {
#pragma unroll
            for (int item = 0; item < ITEMS; ++item) inverse_rms[item] = rsqrtf(inverse_rms[item] / head_size + eps);
        }
    }

#pragma unroll
    for (int item = 0; item < ITEMS; ++item) {
        float v[kLaneChunks][kChunk];
#pragma unroll
        for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
            for (int e = 0; e < kChunk; ++e) {
                v[j][e] = word_element<T>(words[item][j], e);
                if constexpr (LAYER) v[j][e] = (v[j][e] - mean[item]) * inverse_rms[item] * w[j][e] + b[j][e];
                else if (norm) v[j][e] = v[j][e] * inverse_rms[item] * w[j][e];
            }
        }
        const int r = HEAD_CACHE ? item : 0;
        if constexpr (INTERLEAVED) {
            if (rotated) rotate_interleaved(v[0], c[r], s[r]);
        } else if (neox_pair) {
            rotate_neox(v[0], v[1], c[r], s[r]);
        }
        if (stored[item]) {
            T* const head_values = token_heads + (first_head + item * slots) * head_size;
#pragma unroll
            for (int j = 0; j < kLaneChunks; ++j)
                if (has[j]) store_chunk<STREAMING>(head_values + column[j], v[j]);
        }
    }
}

// qk_norm_rope_ with norm_over="token": one RMSNorm (LAYER: LayerNorm) over all H * Dh values
// of a token's q (or k), weights and biases [H * Dh], then RoPE per head. A block per token and
// tensor (grid: B * S, 2; y 0 is q, 1 is k), whose BLOCK threads reduce the token's sums
// together (group_sum). Unit u of the block (thread u % BLOCK, item u / BLOCK) is lane u %
// head_units of head u / head_units, its chunks laid out as a lane of the per-head kernel above
// (one chunk interleaved, two NeoX), so BLOCK * ITEMS * 8 >= H * Dh (the launch table's classes,
// the registry's max_hidden_size). The chunks stay as loaded until the sums are known; cos/sin,
// the weight and the bias are read after them. LAYER is a compile-time flag, as in the per-head
// kernel: as a run-time one, the LayerNorm pass and the bias loads took the RMSNorm calls' kernel
// from 98 to 122 registers (bfloat16, NeoX, 64 threads x 3 items, sm_90). HEAD_CACHE: each unit
// reads its head's cos/sin row.
template <typename T, bool INTERLEAVED, int BLOCK, int ITEMS, bool LAYER, bool HEAD_CACHE>
__global__ void LAUNCH_BOUNDS(BLOCK, 1) rotary_token_norm(
    Heads q, Heads k, Weight q_weight, Weight k_weight, Weight q_bias, Weight k_bias, CosSinCache cache,
    Integers positions, long long q_heads, long long k_heads, long long tokens, long long head_size,
    long long rotary_dim, long long position_offset, float eps) {
    const bool in_q = blockIdx.y == 0;
    const long long row = blockIdx.x, batch = row / tokens, token = row - batch * tokens;
    const Heads tensor = in_q ? q : k;
    const long long heads = in_q ? q_heads : k_heads;
    constexpr int kLaneChunks = INTERLEAVED ? 1 : 2;
    const int half = static_cast<int>(rotary_dim / 2);
    const int head_units = static_cast<int>((head_size + kLaneChunks * kChunk - 1) / (kLaneChunks * kChunk));
    const int pair_lanes = INTERLEAVED ? 0 : half / kChunk, first = INTERLEAVED ? 0 : static_cast<int>(rotary_dim);

    constexpr int kWords = ChunkWords<T>::count;
    T* const token_heads = static_cast<T*>(tensor.data) + batch * tensor.batch_stride + token * tensor.token_stride;
    uint4 words[ITEMS][kLaneChunks][kWords];
    int head[ITEMS], column[ITEMS][2];
    bool has[ITEMS][2];
    float sum = 0.0f, squares = 0.0f;
#pragma unroll
    for (int item = 0; item < ITEMS; ++item) {
        const int unit = item * BLOCK + static_cast<int>(threadIdx.x);
        head[item] = unit / head_units;
        const int member = unit - head[item] * head_units;
        const bool neox_pair = member < pair_lanes;
        const int a = neox_pair ? member * kChunk : first + (member - pair_lanes) * kChunk;
        column[item][0] = a;
        column[item][1] = neox_pair ? half + a : a + (head_units - pair_lanes) * kChunk;
        has[item][0] = head[item] < heads && a < head_size;
        has[item][1] = has[item][0] && column[item][1] < head_size;
        const uint4* const head_words = reinterpret_cast<const uint4*>(token_heads + head[item] * head_size);
#pragma unroll
        for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
            for (int w = 0; w < kWords; ++w)  // coherent loads: this kernel writes q and k
                words[item][j][w] = has[item][j] ? head_words[column[item][j] / kChunk * kWords + w] : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int e = 0; e < kChunk; ++e) {
                const float value = word_element<T>(words[item][j], e);
                if constexpr (LAYER) sum += value;
                else squares += value * value;
            }
        }
    }
    // LayerNorm: the mean, then the squares of the values less it, over the chunks that hold
    // values (the others hold zeros, which less the mean would add mean^2).
    const float count = static_cast<float>(heads * head_size);
    float mean = 0.0f;
    if constexpr (LAYER) {
        mean = group_sum<BLOCK, BLOCK>(sum) / count;
#pragma unroll
        for (int item = 0; item < ITEMS; ++item) {
#pragma unroll
            for (int j = 0; j < kLaneChunks; ++j) {
                if (!has[item][j]) continue;
#pragma unroll
                for (int e = 0; e < kChunk; ++e) {
                    const float centred = word_element<T>(words[item][j], e) - mean;
                    squares += centred * centred;
                }
            }
        }
    }
    const float inverse_rms = rsqrtf(group_sum<BLOCK, BLOCK>(squares) / count + eps);

    const long long position = positions.data ? load_integer(positions, batch, token) : position_offset + token;
    const Weight weight = in_q ? q_weight : k_weight, bias = in_q ? q_bias : k_bias;
#pragma unroll
    for (int item = 0; item < ITEMS; ++item) {
        if (!has[item][0]) continue;
        const void* cos_row = cache_row<HEAD_CACHE>(cache, batch, position, head[item]);
        const int a = column[item][0];
        const bool neox_pair = !INTERLEAVED && a < half;
        float c[kChunk] = {}, s[kChunk] = {};
        if constexpr (INTERLEAVED) {
            if (a < rotary_dim) {
                load_quad_of_dtype(cos_row, cache.dtype, a / 2, c);
                load_quad_of_dtype(cos_row, cache.dtype, half + a / 2, s);
            }
        } else if (neox_pair) {
            load_chunk_of_dtype(cos_row, cache.dtype, a, c);
            load_chunk_of_dtype(cos_row, cache.dtype, half + a, s);
        }
        float v[kLaneChunks][kChunk];
#pragma unroll
        for (int j = 0; j < kLaneChunks; ++j) {
            float w[kChunk], b[kChunk];
#pragma unroll
            for (int e = 0; e < kChunk; ++e) w[e] = 1.0f, b[e] = -0.0f;  // none: x * 1 and x + -0 are x (+ 0 is not, for -0)
            if (has[item][j] && weight.data) load_chunk_of_dtype(weight.data, weight.dtype, head[item] * head_size + column[item][j], w);
            if (LAYER && has[item][j] && bias.data) load_chunk_of_dtype(bias.data, bias.dtype, head[item] * head_size + column[item][j], b);
#pragma unroll
            for (int e = 0; e < kChunk; ++e) {
                const float value = word_element<T>(words[item][j], e);
                if constexpr (LAYER) v[j][e] = (value - mean) * inverse_rms * w[e] + b[e];
                else v[j][e] = value * inverse_rms * w[e];
            }
        }
        if constexpr (INTERLEAVED) {
            if (a < rotary_dim) rotate_interleaved(v[0], c, s);
        } else if (neox_pair) {
            rotate_neox(v[0], v[1], c, s);
        }
        T* const head_values = token_heads + head[item] * head_size;
#pragma unroll
        for (int j = 0; j < kLaneChunks; ++j)
            if (has[item][j]) store_chunk(head_values + column[item][j], v[j]);
    }
}

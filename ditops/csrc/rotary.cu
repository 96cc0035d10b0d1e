// Ops 5 and 6, in place: per token and head, optionally RMSNorm over the head (q_weight or
// k_weight), then RoPE on the first R dims. A head belongs to HEAD_THREADS consecutive threads,
// each holding one chunk of 8 values; q heads come first, then k heads (GQA/MQA: any counts).
#include "memory.cuh"
#include "reductions.cuh"

// q or k: tokens of heads [B, S, H, Dh], heads and dims contiguous.
struct Heads {
    void* data;
    long long batch_stride;
    long long token_stride;
};

// A [Dh] RMSNorm weight of any dtype, or nothing (data == nullptr).
struct Weight {
    const void* data;
    long long dtype;
};

struct CosSinCache {
    const void* data;
    long long dtype;
    long long row_stride;
};

template <typename T, int HEAD_THREADS, int BLOCK>
__global__ void __launch_bounds__(BLOCK) rotary(
    Heads q, Heads k, Weight q_weight, Weight k_weight, CosSinCache cache, Integers positions,
    long long q_heads, long long k_heads, long long tokens, long long head_size, long long rotary_dim,
    long long position_offset, float eps, long long norm, long long interleaved) {
    static_assert(HEAD_THREADS <= kWarpSize, "NeoX pairs are exchanged between lanes of one warp");
    const int batch = blockIdx.x / static_cast<int>(tokens), token = blockIdx.x - batch * static_cast<int>(tokens);
    const long long head = static_cast<long long>(blockIdx.y) * (BLOCK / HEAD_THREADS) + threadIdx.x / HEAD_THREADS;
    const int lane = threadIdx.x % HEAD_THREADS;
    const long long column = static_cast<long long>(lane) * kChunk;
    const bool is_q = head < q_heads;
    const bool valid = head < q_heads + k_heads && column < head_size;
    // chosen field by field: selecting a kernel parameter by reference copies it to local memory
    T* values = static_cast<T*>(is_q ? q.data : k.data) + batch * (is_q ? q.batch_stride : k.batch_stride)
                + token * (is_q ? q.token_stride : k.token_stride) + (is_q ? head : head - q_heads) * head_size + column;

    float v[kChunk] = {};
    if (valid) load_chunk(values, v);
    if (norm) {
        float squares = 0.0f;
#pragma unroll
        for (int e = 0; e < kChunk; ++e) squares += v[e] * v[e];
        const float inverse_rms = rsqrtf(group_sum<HEAD_THREADS, BLOCK>(squares) / head_size + eps);
        const void* weight = is_q ? q_weight.data : k_weight.data;
        float w[kChunk];
        if (valid && weight) load_chunk_of_dtype(weight, is_q ? q_weight.dtype : k_weight.dtype, column, w);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) v[e] *= valid && weight ? inverse_rms * w[e] : inverse_rms;
    }

    const long long position = positions.data ? load_integer(positions, batch, token) : position_offset + token;
    const long long half = rotary_dim / 2;
    const void* cos_row = static_cast<const char*>(cache.data)
                          + position * cache.row_stride * (cache.dtype == kFloat32 ? 4 : 2);
    if (interleaved) {
        // pairs (2j, 2j + 1) lie inside one chunk
        if (valid && column < rotary_dim) {
#pragma unroll
            for (int e = 0; e < kChunk; e += 2) {
                const long long pair = (column + e) / 2;
                const float c = load_of_dtype(cos_row, cache.dtype, pair), s = load_of_dtype(cos_row, cache.dtype, half + pair);
                const float first = v[e], second = v[e + 1];
                v[e] = first * c - second * s;
                v[e + 1] = second * c + first * s;
            }
        }
    } else {
        // pair (j, j + R/2): the chunk `half / kChunk` lanes away in the same head holds the partner
        const int partner_distance = static_cast<int>(half / kChunk);
        const bool first_half = column < half, second_half = !first_half && column < rotary_dim;
        const int warp_lane = threadIdx.x % kWarpSize;
        const int source = first_half ? warp_lane + partner_distance : second_half ? warp_lane - partner_distance : warp_lane;
        float partner[kChunk];
#pragma unroll
        for (int e = 0; e < kChunk; ++e) partner[e] = shuffle(v[e], source);  // every lane takes part
        if (valid && (first_half || second_half)) {
            float c[kChunk], s[kChunk];
            const long long pair = first_half ? column : column - half;
            load_chunk_of_dtype(cos_row, cache.dtype, pair, c);
            load_chunk_of_dtype(cos_row, cache.dtype, half + pair, s);
#pragma unroll
            for (int e = 0; e < kChunk; ++e) {
                v[e] = first_half ? v[e] * c[e] - partner[e] * s[e] : v[e] * c[e] + partner[e] * s[e];
            }
        }
    }
    if (valid) store_chunk(values, v);
}

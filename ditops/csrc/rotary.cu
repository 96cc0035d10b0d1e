// Ops 5 and 6, in place: per token and head, optionally RMSNorm over the head (q_weight or
// k_weight), then RoPE on the first R dims. One block per token takes all its heads, q heads
// first, then k heads (GQA/MQA: any counts). A head belongs to HEAD_THREADS consecutive
// threads, one chunk of 8 values each; a thread keeps its column for every head it touches,
// so it loads its cos/sin and norm weights once per token. Each pass loads ITEMS heads per
// thread before working on any, to keep several loads in flight.
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

template <typename T, int HEAD_THREADS, int BLOCK, int ITEMS>
__global__ void __launch_bounds__(BLOCK) rotary(
    Heads q, Heads k, Weight q_weight, Weight k_weight, CosSinCache cache, Integers positions,
    long long q_heads, long long k_heads, long long tokens, long long head_size, long long rotary_dim,
    long long position_offset, float eps, long long norm, long long interleaved) {
    static_assert(HEAD_THREADS <= kWarpSize, "NeoX pairs are exchanged between lanes of one warp");
    constexpr int kGroups = BLOCK / HEAD_THREADS;  // heads worked on at once
    const int batch = blockIdx.x / static_cast<int>(tokens), token = blockIdx.x - batch * static_cast<int>(tokens);
    const int group = threadIdx.x / HEAD_THREADS, lane = threadIdx.x % HEAD_THREADS;
    const long long column = static_cast<long long>(lane) * kChunk;
    const bool in_head = column < head_size;
    const long long half = rotary_dim / 2;

    // This thread's cos and sin: for interleaved pairs (column/2 + e/2), for NeoX pairs
    // (column mod R/2 + e), the same for every head.
    const long long position = positions.data ? load_integer(positions, batch, token) : position_offset + token;
    const void* cos_row = static_cast<const char*>(cache.data) + position * cache.row_stride * (cache.dtype == kFloat32 ? 4 : 2);
    const bool first_half = interleaved ? column < rotary_dim : column < half;
    const bool second_half = !interleaved && !first_half && column < rotary_dim;
    float c[kChunk] = {}, s[kChunk] = {};
    if (in_head && interleaved && first_half) {
#pragma unroll
        for (int e = 0; e < kChunk; e += 2) {
            c[e] = load_of_dtype(cos_row, cache.dtype, (column + e) / 2);
            s[e] = load_of_dtype(cos_row, cache.dtype, half + (column + e) / 2);
        }
    } else if (in_head && (first_half || second_half)) {
        const long long pair = first_half ? column : column - half;
        load_chunk_of_dtype(cos_row, cache.dtype, pair, c);
        load_chunk_of_dtype(cos_row, cache.dtype, half + pair, s);
    }
    float q_w[kChunk], k_w[kChunk];
    if (norm && in_head && q_weight.data) load_chunk_of_dtype(q_weight.data, q_weight.dtype, column, q_w);
    if (norm && in_head && k_weight.data) load_chunk_of_dtype(k_weight.data, k_weight.dtype, column, k_w);

    const long long heads = q_heads + k_heads;
    T* q_token = static_cast<T*>(q.data) + batch * q.batch_stride + token * q.token_stride + column;
    T* k_token = static_cast<T*>(k.data) + batch * k.batch_stride + token * k.token_stride + column;
    for (long long first = 0; first < heads; first += kGroups * ITEMS) {  // the same passes for every thread
        float v[ITEMS][kChunk];
        T* where[ITEMS];
        bool valid[ITEMS], is_q[ITEMS];
#pragma unroll
        for (int item = 0; item < ITEMS; ++item) {
            const long long head = first + item * kGroups + group;
            is_q[item] = head < q_heads;
            valid[item] = in_head && head < heads;
            where[item] = is_q[item] ? q_token + head * head_size : k_token + (head - q_heads) * head_size;
            if (valid[item]) load_written_chunk(where[item], v[item]);
            else {
#pragma unroll
                for (int e = 0; e < kChunk; ++e) v[item][e] = 0.0f;
            }
        }
#pragma unroll
        for (int item = 0; item < ITEMS; ++item) {
            if (norm) {
                float squares = 0.0f;
#pragma unroll
                for (int e = 0; e < kChunk; ++e) squares += v[item][e] * v[item][e];
                const float inverse_rms = rsqrtf(group_sum<HEAD_THREADS, BLOCK>(squares) / head_size + eps);
                const bool weighted = is_q[item] ? q_weight.data != nullptr : k_weight.data != nullptr;
#pragma unroll
                for (int e = 0; e < kChunk; ++e)
                    v[item][e] *= weighted ? inverse_rms * (is_q[item] ? q_w[e] : k_w[e]) : inverse_rms;
            }
            if (interleaved) {
                if (first_half) {  // pairs (2j, 2j + 1) lie inside one chunk
#pragma unroll
                    for (int e = 0; e < kChunk; e += 2) {
                        const float even = v[item][e], odd = v[item][e + 1];
                        v[item][e] = even * c[e] - odd * s[e];
                        v[item][e + 1] = odd * c[e] + even * s[e];
                    }
                }
            } else {
                // pair (j, j + R/2): the chunk R/2 / kChunk lanes away in the same head holds the partner
                const int distance = static_cast<int>(half / kChunk);
                const int warp_lane = threadIdx.x % kWarpSize;
                const int source = first_half ? warp_lane + distance : second_half ? warp_lane - distance : warp_lane;
                float partner[kChunk];
#pragma unroll
                for (int e = 0; e < kChunk; ++e) partner[e] = shuffle(v[item][e], source);  // every lane takes part
#pragma unroll
                for (int e = 0; e < kChunk; ++e) {
                    if (first_half) v[item][e] = v[item][e] * c[e] - partner[e] * s[e];
                    else if (second_half) v[item][e] = v[item][e] * c[e] + partner[e] * s[e];
                }
            }
            if (valid[item]) store_chunk(where[item], v[item]);
        }
    }
}

// Ops 5 and 6, in place: per token and head, optionally RMSNorm over the head (q_weight or
// k_weight), then RoPE on the first R dims.
//
// A head is held by HEAD_THREADS >= Dh / 8 consecutive lanes, one chunk of 8 values each (lanes
// past Dh idle), and never straddles a 32-lane segment (NeoX partners are exchanged by lane
// shuffles): a segment holds 32 / HEAD_THREADS heads' lanes, its slots. The launch code picks
// the widest HEAD_THREADS that packs as many heads per segment as Dh / 8 lanes would, so few
// instances serve every Dh at no cost in lanes. A slot takes up to ITEMS heads of one token
// and one tensor, loaded together: a token (a row of the B * S) has ceil(Hq / ITEMS) q slots
// then ceil(Hk / ITEMS) k slots, consecutive in the grid (they may straddle blocks, and a block
// holds several tokens when heads are few), and slot j of a tensor takes its heads j,
// j + slots, ... So each token costs one memory round trip, and a thread, which keeps one
// column of one token and one tensor, loads its cos/sin and norm weight once. Calls in the
// launch table's streaming_stores token range take the instance that stores q and k with the
// streaming cache hint: the same bits.
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

// STREAMING: q and k stored with the streaming cache hint (a template flag: chosen at run time
// per store, it made the float16 instances spill on sm_90). MIN_BLOCKS: the launch table's.
template <typename T, int HEAD_THREADS, int BLOCK, int ITEMS, bool STREAMING, int MIN_BLOCKS>
__global__ void LAUNCH_BOUNDS(BLOCK, MIN_BLOCKS) rotary(
    Heads q, Heads k, Weight q_weight, Weight k_weight, CosSinCache cache, Integers positions,
    long long q_heads, long long k_heads, long long tokens, Divisor by_tokens, Divisor by_token_slots, long long rows,
    long long head_size, long long rotary_dim, long long position_offset, float eps, long long norm, long long interleaved) {
    constexpr int kSegmentHeads = kSegment / HEAD_THREADS;
    static_assert(kSegmentHeads >= 1 && BLOCK % kSegment == 0, "whole heads in whole segments");
    const int segment_lane = threadIdx.x % kSegment, member = segment_lane % HEAD_THREADS;
    const int column = member * kChunk;

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
    // Lanes past the segment's last whole head or past Dh, and slots past the last token, touch
    // no memory (they hold zeros, which add nothing to a head's sum).
    const bool valid = segment_lane < kSegmentHeads * HEAD_THREADS && column < head_size && row < rows;

    // The loads first: they need no position, cos/sin or weight. Chunks stay as loaded (16-byte
    // words of T, half the registers of float for 16-bit data) until their head's turn.
    constexpr int kWords = ChunkWords<T>::count;
    T* const token_heads = static_cast<T*>(tensor.data) + batch * tensor.batch_stride + token * tensor.token_stride + column;
    uint4 words[ITEMS][kWords];
    bool stored[ITEMS];
#pragma unroll
    for (int item = 0; item < ITEMS; ++item) {
        const unsigned head = first_head + item * slots;
        stored[item] = valid && head < heads;
#pragma unroll
        for (int w = 0; w < kWords; ++w)  // coherent loads: this kernel writes q and k
            words[item][w] = stored[item] ? reinterpret_cast<const uint4*>(token_heads + head * head_size)[w] : make_uint4(0, 0, 0, 0);
    }

    // cos and sin of this thread's pairs, the same for every head: interleaved pairs
    // (column + e, column + e + 1) take index (column + e) / 2; NeoX pairs (j, j + R/2) take
    // j = column mod R/2, and the first half's sin is negated so both halves add partner * s.
    const int half = static_cast<int>(rotary_dim / 2);
    const bool rotated = column < rotary_dim, first_half = column < half;
    float c[kChunk] = {}, s[kChunk] = {};
    if (valid && rotated) {
        const long long position = positions.data ? load_integer(positions, batch, token) : position_offset + token;
        const void* cos_row = static_cast<const char*>(cache.data) + position * cache.row_stride * (cache.dtype == kFloat32 ? 4 : 2);
        if (interleaved) {
#pragma unroll
            for (int e = 0; e < kChunk; e += 2) {
                c[e] = load_of_dtype(cos_row, cache.dtype, (column + e) / 2);
                s[e] = load_of_dtype(cos_row, cache.dtype, half + (column + e) / 2);
            }
        } else {
            const int pair = first_half ? column : column - half;
            load_chunk_of_dtype(cos_row, cache.dtype, pair, c);
            load_chunk_of_dtype(cos_row, cache.dtype, half + pair, s);
#pragma unroll
            for (int e = 0; e < kChunk; ++e) s[e] = first_half ? -s[e] : s[e];
        }
    }
    // The tensor's norm weight, or ones where it has none (x * 1 is exact).
    const Weight weight = in_q ? q_weight : k_weight;
    float w[kChunk];
    if (norm && valid && weight.data) {
        load_chunk_of_dtype(weight.data, weight.dtype, column, w);
    } else {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) w[e] = 1.0f;
    }

    // The norm: the sums of squares of this thread's heads reduced together (lane_group_sums:
    // their lane exchanges overlap), then each head normalised in its turn below.
    float inverse_rms[ITEMS];
    if (norm) {
#pragma unroll
        for (int item = 0; item < ITEMS; ++item) {
            inverse_rms[item] = 0.0f;
#pragma unroll
            for (int e = 0; e < kChunk; ++e) {
                const float value = word_element<T>(words[item], e);
                inverse_rms[item] += value * value;
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

    // The NeoX partner chunk lies R/2 / 8 lanes away in the same head.
    const int lane = threadIdx.x % kWarpSize, distance = half / kChunk;
    const int partner_lane = !rotated ? lane : first_half ? lane + distance : lane - distance;
#pragma unroll
    for (int item = 0; item < ITEMS; ++item) {
        float v[kChunk];
#pragma unroll
        for (int e = 0; e < kChunk; ++e) v[e] = word_element<T>(words[item], e);
        if (norm) {
#pragma unroll
            for (int e = 0; e < kChunk; ++e) v[e] = v[e] * inverse_rms[item] * w[e];
        }
        if (interleaved) {
            if (rotated) {  // pairs (2j, 2j + 1) lie inside one chunk
#pragma unroll
                for (int e = 0; e < kChunk; e += 2) {
                    const float even = v[e], odd = v[e + 1];
                    v[e] = even * c[e] - odd * s[e];
                    v[e + 1] = odd * c[e] + even * s[e];
                }
            }
        } else {
            float partner[kChunk];
#pragma unroll
            for (int e = 0; e < kChunk; ++e) partner[e] = shuffle(v[e], partner_lane);  // every lane takes part
            if (rotated) {
#pragma unroll
                for (int e = 0; e < kChunk; ++e) v[e] = v[e] * c[e] + partner[e] * s[e];
            }
        }
        if (stored[item]) store_chunk<STREAMING>(token_heads + (first_head + item * slots) * head_size, v);
    }
}

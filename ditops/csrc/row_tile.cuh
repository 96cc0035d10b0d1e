// What the row kernels share: which row a thread works on, the row held in registers, and its
// norm. A row (one token's D values) belongs to ROW_THREADS consecutive threads of a
// BLOCK-thread block; thread `lane` holds chunk i at columns (lane + i * ROW_THREADS) * kChunk,
// so that a group's accesses to a row are contiguous. The launch code picks ROW_THREADS,
// CHUNKS and BLOCK per size class with ROW_THREADS * CHUNKS * kChunk >= D. P is the dtype of
// weights and modulation; AFFINE (a kernel's template flag) whether the call has a weight or bias.
#pragma once
#include "memory.cuh"
#include "reductions.cuh"

struct RowPosition {
    long long row;
    int batch, token;  // 32-bit: the launch code keeps B * S below 2^31, and 64-bit division is slow
    int lane;
    bool valid;  // false for the padding rows of the last block: they load zeros and store nothing
    int chunks;  // chunks of the row this thread holds, its first ones (none in padding rows)

    template <int ROW_THREADS, int BLOCK, int CHUNKS>
    __device__ static RowPosition of_thread(long long rows, long long tokens, long long hidden) {
        RowPosition at;
        at.row = static_cast<long long>(blockIdx.x) * (BLOCK / ROW_THREADS) + threadIdx.x / ROW_THREADS;
        at.valid = at.row < rows;
        const unsigned row32 = static_cast<unsigned>(at.row);
        at.batch = static_cast<int>(row32 / static_cast<unsigned>(tokens));
        at.token = static_cast<int>(row32 - static_cast<unsigned>(at.batch) * static_cast<unsigned>(tokens));
        at.lane = threadIdx.x % ROW_THREADS;
        // chunk i is held while (lane + i * ROW_THREADS) * kChunk < D: counted once, so that a
        // chunk's test is one comparison
        const int beyond = static_cast<int>(hidden / kChunk) - at.lane;
        at.chunks = !at.valid || beyond <= 0 ? 0 : min(CHUNKS, (beyond + ROW_THREADS - 1) / ROW_THREADS);
        return at;
    }

    template <int ROW_THREADS>
    __device__ long long column(int chunk) const { return (lane + static_cast<long long>(chunk) * ROW_THREADS) * kChunk; }

    __device__ bool holds(int chunk) const { return chunk < chunks; }
};

// This thread's chunks of a row, kept as stored (16-byte words of T), not as float: half the
// registers for 16-bit data, so more rows fit on an SM and more loads are in flight.
template <typename T, int ROW_THREADS, int CHUNKS>
struct Row {
    static constexpr int kWords = ChunkWords<T>::count;
    uint4 words[CHUNKS][kWords];

    // Row `at` of `rows` (zeros past D and in padding rows). STREAMING (here and in store): with
    // the streaming cache hint (portability.cuh).
    template <bool STREAMING = false>
    __device__ void load(const Rows& rows, const RowPosition& at) {
        const T* source = static_cast<const T*>(rows.data) + at.batch * rows.batch_stride + at.token * rows.token_stride;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
#pragma unroll
            for (int w = 0; w < kWords; ++w) {
                words[i][w] = at.holds(i)
                                  ? load_hinted<STREAMING>(reinterpret_cast<const uint4*>(source + at.column<ROW_THREADS>(i) + w * (16 / sizeof(T))))
                                  : make_uint4(0, 0, 0, 0);
            }
        }
    }

    // Row `at` of cat([first, second], -1), first holding its `split` columns (a multiple of
    // kChunk, so that a chunk lies in one of the two): quantize_fp8's prefix and x.
    __device__ void load_joined(const Rows& first, const Rows& second, long long split, const RowPosition& at) {
        const T* first_row = static_cast<const T*>(first.data) + at.batch * first.batch_stride + at.token * first.token_stride;
        const T* second_row = static_cast<const T*>(second.data) + at.batch * second.batch_stride + at.token * second.token_stride;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            const long long column = at.column<ROW_THREADS>(i);
            const T* source = column < split ? first_row + column : second_row + (column - split);
#pragma unroll
            for (int w = 0; w < kWords; ++w) {
                words[i][w] = at.holds(i) ? load_hinted<false>(reinterpret_cast<const uint4*>(source + w * (16 / sizeof(T))))
                                          : make_uint4(0, 0, 0, 0);
            }
        }
    }

    __device__ void get(int i, float (&values)[kChunk]) const {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) values[e] = word_element<T>(words[i], e);
    }

    // Rounds values to T: later reads see exactly what a store of this chunk writes.
    __device__ void set(int i, const float (&values)[kChunk]) {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) set_word_element<T>(words[i], e, values[e]);
    }

    template <bool STREAMING = false>
    __device__ void store(T* row_out, const RowPosition& at, int i) const {
#pragma unroll
        for (int w = 0; w < kWords; ++w)
            store_hinted<STREAMING>(reinterpret_cast<uint4*>(row_out + at.column<ROW_THREADS>(i) + w * (16 / sizeof(T))), words[i][w]);
    }
};

// This thread's chunks of one row's per-column vector: a modulation (scale, shift, gate) or a
// norm's weight or bias. 16-bit vectors are loaded for every chunk at once, before the chunks
// are computed: loaded chunk by chunk, each load waits for the store of the chunk before it
// (the compiler does not move a load above a store it cannot prove disjoint), one cache round
// trip per chunk in series after the reduction (H100, `ditops bench`, D = 3072: preloading the
// modulation made the S = 128 latency rows 5-24% faster, residual Qwen-Image 10% and residual
// select Qwen-Image-Edit 15%; the weight and bias, add_gate_norm(_scale)'s latency rows 13% and
// 27%). Float vectors double those registers, which cost more than the round
// trips (Wan2.1-14B's float modulation: 34% slower), so they are still loaded where used; so
// are the vectors of rows wider than 8192 (512-thread blocks leave a thread 128 registers,
// which the select kernel's five preloaded vectors overflow with float activations).
// A kernel's weight and bias are absent at compile time where the call has none (AFFINE,
// ditops/backends/compiled.py says why). data == nullptr: absent.
template <typename P, int ROW_THREADS, int CHUNKS, bool PRELOAD = sizeof(P) == 2 && ROW_THREADS <= 256>
struct RowVector {
    static constexpr int kWords = ChunkWords<P>::count;
    uint4 words[PRELOAD ? CHUNKS : 1][kWords];
    const P* lane_data;  // this thread's first chunk; chunk i is i * ROW_THREADS * kChunk further
    float value;         // the one value of a scalar modulation
    bool present, scalar;

    __device__ RowVector(const ModulationRow<P>& m, const RowPosition& at) : RowVector(m.data, m.scalar, at) {}

    // A norm's weight or bias: a [D] vector, or nullptr.
    __device__ RowVector(const P* data, const RowPosition& at) : RowVector(data, false, at) {}

    __device__ RowVector(const P* data, bool scalar, const RowPosition& at)
        : lane_data(data ? data + at.column<ROW_THREADS>(0) : nullptr), value(0.0f), present(data != nullptr), scalar(scalar) {
        if (present && scalar) value = to_float(*data);
        if constexpr (PRELOAD) {
            uint4 same[kWords];  // a scalar's value in every element (zeros where absent): get() selects nothing
            broadcast_words<P>(value, same);
#pragma unroll
            for (int i = 0; i < CHUNKS; ++i) {
#pragma unroll
                for (int w = 0; w < kWords; ++w) {
                    words[i][w] = present && !scalar && at.holds(i)
                                      ? load_read_only(reinterpret_cast<const uint4*>(lane_data + i * ROW_THREADS * kChunk) + w)
                                      : same[w];
                }
            }
        }
    }

    // Chunk i (zeros where absent); only for chunks this thread holds.
    __device__ void get(int i, float (&values)[kChunk]) const {
        if constexpr (PRELOAD) {
#pragma unroll
            for (int e = 0; e < kChunk; ++e) values[e] = word_element<P>(words[i], e);
        } else if (scalar || !present) {
#pragma unroll
            for (int e = 0; e < kChunk; ++e) values[e] = value;
        } else {
            load_chunk(lane_data + i * ROW_THREADS * kChunk, values);
        }
    }
};

// row = residual + gate * row (gate absent: 1), rounded to T as stored into residual_out: the
// norm that follows reads the sum as stored (ops 2 and 3).
template <typename P, typename T, int ROW_THREADS, int CHUNKS>
__device__ inline void add_residual(Row<T, ROW_THREADS, CHUNKS>& row, const Rows& residual, const ModulationRow<P>& gate_row,
                                    const RowPosition& at, long long hidden, T* residual_out) {
    Row<T, ROW_THREADS, CHUNKS> previous;
    previous.load(residual, at);
    const RowVector<P, ROW_THREADS, CHUNKS> gate(gate_row, at);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        if (!at.holds(i)) continue;
        float v[kChunk], r[kChunk], g[kChunk];
        row.get(i, v);
        previous.get(i, r);
        gate.get(i, g);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) v[e] = r[e] + (gate.present ? g[e] * v[e] : v[e]);
        row.set(i, v);
        row.store(residual_out + at.row * hidden, at, i);
    }
}

struct RowStatistics {
    float mean;  // 0 for RMSNorm
    float inverse_deviation;
};

// LayerNorm (mean, then the biased variance of the centered values: two passes over the
// registers) or RMSNorm statistics of the row.
template <int BLOCK, typename T, int ROW_THREADS, int CHUNKS>
__device__ inline RowStatistics row_statistics(const Row<T, ROW_THREADS, CHUNKS>& row, const RowPosition& at,
                                               long long hidden, float eps, bool rms) {
    float mean = 0.0f;
    if (!rms) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            float v[kChunk];
            row.get(i, v);
#pragma unroll
            for (int e = 0; e < kChunk; ++e) sum += v[e];
        }
        mean = group_sum<ROW_THREADS, BLOCK>(sum) / hidden;
    }
    float squares = 0.0f;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        if (!at.holds(i)) continue;
        float v[kChunk];
        row.get(i, v);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) squares += (v[e] - mean) * (v[e] - mean);
    }
    return {mean, rsqrtf(group_sum<ROW_THREADS, BLOCK>(squares) / hidden + eps)};
}

// Chunk i of the normalised row, with the optional affine.
template <typename P, typename T, int ROW_THREADS, int CHUNKS>
__device__ inline void normalized_chunk(const Row<T, ROW_THREADS, CHUNKS>& row, int i, const RowStatistics& statistics,
                                        const RowVector<P, ROW_THREADS, CHUNKS>& weight, const RowVector<P, ROW_THREADS, CHUNKS>& bias,
                                        float (&values)[kChunk]) {
    row.get(i, values);
    float w[kChunk], b[kChunk];
    weight.get(i, w);
    bias.get(i, b);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) {
        float n = (values[e] - statistics.mean) * statistics.inverse_deviation;
        if (weight.present) n *= w[e];
        if (bias.present) n += b[e];
        values[e] = n;
    }
}

// A row's dynamic scale for FP8 format F from its amax: max(amax, 1e-12) / F::kMax, NaN for a
// row holding NaN or Inf (amax NaN or Inf), so that all its values are NaN.
template <typename F>
__device__ inline float dynamic_row_scale(float amax) {
    constexpr float kLargest = 3.40282347e38f;  // FLT_MAX: NaN and Inf are not at or below it
    return amax <= kLargest ? fmaxf(amax, 1e-12f) / F::kMax : __uint_as_float(0x7fc00000u);
}

// A row's values on their way to FP8 format F (the *_fp8 ops): kept as float until the row's
// amax is known, then stored as F's codes with one float32 scale per row, y ~= codes * scale.
// backends/reference's _quantize_rows is the definition. As the Triton kernels'
// row_math.store_quantized, one division per row and the values times its inverse; here both
// divisions are IEEE (Triton's are div.full.f32, within 2 ulp), so the scale is the reference's
// bit for bit, and a code may differ from Triton's where a value lies at a rounding boundary.
template <typename F, int ROW_THREADS, int CHUNKS>
struct QuantizedRow {
    float values[CHUNKS][kChunk];

    __device__ void set(int i, const float (&chunk)[kChunk]) {
#pragma unroll
        for (int e = 0; e < kChunk; ++e) values[i][e] = chunk[e];
    }

    // Dynamic (static_scale == nullptr): dynamic_row_scale; static: *static_scale. Values beyond
    // +-F::kMax saturate (fp8_pair_bits). Every thread of the block must call this (group_magnitude_max).
    template <int BLOCK>
    __device__ void store(F* y, float* y_scale, const float* static_scale, const RowPosition& at, long long hidden) const {
        float scale;
        if (static_scale) {
            scale = *static_scale;
        } else {
            float amax = 0.0f;
#pragma unroll
            for (int i = 0; i < CHUNKS; ++i) {
                if (!at.holds(i)) continue;
#pragma unroll
                for (int e = 0; e < kChunk; ++e) amax = magnitude_max(amax, values[i][e]);
            }
            amax = group_magnitude_max<ROW_THREADS, BLOCK>(amax);
            scale = dynamic_row_scale<F>(amax);
        }
        const float inverse = 1.0f / scale;  // one division per row: an IEEE division per value costs more
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            if (!at.holds(i)) continue;
            float scaled[kChunk];
#pragma unroll
            for (int e = 0; e < kChunk; ++e) scaled[e] = values[i][e] * inverse;
            store_fp8_chunk(y + at.row * hidden + at.column<ROW_THREADS>(i), scaled);
        }
        if (at.valid && at.lane == 0) y_scale[at.row] = scale;
    }
};

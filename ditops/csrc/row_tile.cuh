// What the row kernels share: which row a thread works on, and the norm of a row held in
// registers. A row (one token's D values) belongs to ROW_THREADS consecutive threads of a
// BLOCK-thread block; thread `lane` holds chunk i at columns (lane + i * ROW_THREADS) * kChunk,
// so that a group's accesses to a row are contiguous. The launch code picks ROW_THREADS,
// CHUNKS and BLOCK per size class; P is the dtype of weights and modulation with ROW_THREADS * CHUNKS * kChunk >= D.
#pragma once
#include "memory.cuh"
#include "reductions.cuh"

struct RowPosition {
    long long row;
    int batch, token;  // 32-bit: the launch code keeps B * S below 2^31, and 64-bit division is slow
    int lane;
    bool valid;  // false for the padding rows of the last block: they load zeros and store nothing

    template <int ROW_THREADS, int BLOCK>
    __device__ static RowPosition of_thread(long long rows, long long tokens) {
        RowPosition at;
        at.row = static_cast<long long>(blockIdx.x) * (BLOCK / ROW_THREADS) + threadIdx.x / ROW_THREADS;
        at.valid = at.row < rows;
        at.batch = static_cast<int>(at.row / tokens);
        at.token = static_cast<int>(at.row - static_cast<long long>(at.batch) * tokens);
        at.lane = threadIdx.x % ROW_THREADS;
        return at;
    }

    template <int ROW_THREADS>
    __device__ long long column(int chunk) const { return (lane + static_cast<long long>(chunk) * ROW_THREADS) * kChunk; }
};

template <typename T>
__device__ inline const T* row_pointer(const Rows& rows, const RowPosition& at) {
    return static_cast<const T*>(rows.data) + at.batch * rows.batch_stride + at.token * rows.token_stride;
}

// The row of `rows` at `at` into v as float, zeros past D.
template <typename T, int ROW_THREADS, int CHUNKS>
__device__ inline void load_row(const Rows& rows, const RowPosition& at, long long hidden, float (&v)[CHUNKS][kChunk]) {
    const T* source = row_pointer<T>(rows, at);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const long long column = at.column<ROW_THREADS>(i);
        if (at.valid && column < hidden) {
            load_chunk(source + column, v[i]);
        } else {
#pragma unroll
            for (int e = 0; e < kChunk; ++e) v[i][e] = 0.0f;
        }
    }
}

// LayerNorm (mean and biased variance, two passes over the registers) or RMSNorm of the row
// in v, then the optional affine; entries past D stay zero.
template <typename P, int ROW_THREADS, int CHUNKS, int BLOCK>
__device__ inline void normalize_row(float (&v)[CHUNKS][kChunk], const RowPosition& at, long long hidden, float eps,
                                     bool rms, const P* weight, const P* bias) {
    float mean = 0.0f;
    if (!rms) {
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i)
#pragma unroll
            for (int e = 0; e < kChunk; ++e) sum += v[i][e];
        mean = group_sum<ROW_THREADS, BLOCK>(sum) / hidden;
    }
    float squares = 0.0f;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        if (at.column<ROW_THREADS>(i) < hidden) {
#pragma unroll
            for (int e = 0; e < kChunk; ++e) squares += (v[i][e] - mean) * (v[i][e] - mean);
        }
    }
    const float inverse_deviation = rsqrtf(group_sum<ROW_THREADS, BLOCK>(squares) / hidden + eps);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const long long column = at.column<ROW_THREADS>(i);
        if (!(at.valid && column < hidden)) continue;
        float w[kChunk], b[kChunk];
        if (weight) load_chunk(weight + column, w);
        if (bias) load_chunk(bias + column, b);
#pragma unroll
        for (int e = 0; e < kChunk; ++e) {
            float n = (v[i][e] - mean) * inverse_deviation;
            if (weight) n *= w[e];
            if (bias) n += b[e];
            v[i][e] = n;
        }
    }
}

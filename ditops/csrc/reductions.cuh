// Sums and maxima over the GROUP consecutive threads that hold one row (or one head). Every
// thread of the group gets the result, combined in a fixed order so results never depend on
// timing.
#pragma once
#include "portability.cuh"

struct Sum {
    __device__ float operator()(float a, float b) const { return a + b; }
};
// max(|a|, |b|) compared by their bits, which for magnitudes are ordered as the numbers, with
// NaN above Inf: a NaN is kept (fmaxf would drop it), in two integer instructions a value.
__device__ inline float magnitude_max(float a, float b) {
    return __uint_as_float(max(__float_as_uint(a) & 0x7fffffffu, __float_as_uint(b) & 0x7fffffffu));
}
struct MagnitudeMax {
    __device__ float operator()(float a, float b) const { return magnitude_max(a, b); }
};

// Groups no wider than a warp reduce with lane exchanges alone; wider groups also combine their
// warps' partial results through shared memory, so every thread of the block must call this.
template <int GROUP, int BLOCK, typename Op>
__device__ inline float group_reduce(float value, Op op) {
    static_assert(GROUP > kWarpSize ? GROUP % kWarpSize == 0 : (GROUP & (GROUP - 1)) == 0,
                  "a group is a power of two within a warp, or whole warps");
    static_assert(BLOCK % GROUP == 0, "a block holds whole groups: a partial one would read past `partial`");
    constexpr int lanes = GROUP < kWarpSize ? GROUP : kWarpSize;
#pragma unroll
    for (int mask = lanes / 2; mask > 0; mask /= 2) value = op(value, shuffle_xor(value, mask));
    if constexpr (GROUP > kWarpSize) {
        constexpr int warps_per_group = GROUP / kWarpSize;
        __shared__ float partial[BLOCK / kWarpSize];
        const int warp = threadIdx.x / kWarpSize;
        if (threadIdx.x % kWarpSize == 0) partial[warp] = value;
        __syncthreads();
        const int first = warp - warp % warps_per_group;
        value = partial[first];
#pragma unroll
        for (int w = 1; w < warps_per_group; ++w) value = op(value, partial[first + w]);
        __syncthreads();  // the next call writes partial again
    }
    return value;
}

template <int GROUP, int BLOCK>
__device__ inline float group_sum(float value) { return group_reduce<GROUP, BLOCK>(value, Sum()); }

template <int GROUP, int BLOCK>
__device__ inline float group_magnitude_max(float value) { return group_reduce<GROUP, BLOCK>(value, MagnitudeMax()); }

// Groups of any width up to a warp, starting at any lane (the rotary kernel's heads of Dh / 8
// lanes): a fixed tree into the group's first lane, which every lane then reads, so all get
// the identical sum. N sums at once, step by step, so that their lane exchanges overlap
// rather than wait on each other (a thread's ITEMS heads). member: this lane's place in its
// group. Every lane of the warp must call this.
template <int GROUP, int N>
__device__ inline void lane_group_sums(float (&values)[N], int member) {
    static_assert(GROUP <= kWarpSize, "a group within one warp");
    const int lane = threadIdx.x % kWarpSize;
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        if (offset >= GROUP) continue;
        float others[N];
#pragma unroll
        for (int i = 0; i < N; ++i) others[i] = shuffle(values[i], lane + offset);  // past the group (or the warp): read, not added
#pragma unroll
        for (int i = 0; i < N; ++i) values[i] += member + offset < GROUP ? others[i] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) values[i] = shuffle(values[i], lane - member);
}

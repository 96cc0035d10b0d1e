// How kernels read and write memory: 16-byte vector accesses of kChunk elements, and the
// views the Python launch code passes (ditops/backends/compiled.py packs them).
#pragma once
#include "portability.cuh"

// Elements a thread moves per access: 16 bytes of 16-bit data, two 16-byte accesses of float.
// Callers guarantee 16-byte aligned addresses (the registry's alignment constraint).
constexpr int kChunk = 8;

// Only for data no thread of the kernel writes (every input but the in-place q and k).
template <typename T>
__device__ inline void load_chunk(const T* source, float (&values)[kChunk]) {
    constexpr int per_access = 16 / sizeof(T);
#pragma unroll
    for (int part = 0; part < kChunk / per_access; ++part) {
        const uint4 raw = load_read_only(reinterpret_cast<const uint4*>(source + part * per_access));
        const T* elements = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < per_access; ++i) values[part * per_access + i] = to_float(elements[i]);
    }
}

// For data this kernel also writes (the in-place q and k): a plain, coherent load.
template <typename T>
__device__ inline void load_written_chunk(const T* source, float (&values)[kChunk]) {
    constexpr int per_access = 16 / sizeof(T);
#pragma unroll
    for (int part = 0; part < kChunk / per_access; ++part) {
        const uint4 raw = *reinterpret_cast<const uint4*>(source + part * per_access);
        const T* elements = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < per_access; ++i) values[part * per_access + i] = to_float(elements[i]);
    }
}

template <typename T>
__device__ inline void store_chunk(T* target, const float (&values)[kChunk]) {
    constexpr int per_access = 16 / sizeof(T);
#pragma unroll
    for (int part = 0; part < kChunk / per_access; ++part) {
        uint4 raw;
        T* elements = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int i = 0; i < per_access; ++i) elements[i] = from_float<T>(values[part * per_access + i]);
        *reinterpret_cast<uint4*>(target + part * per_access) = raw;
    }
}

// The run-time dtype of a tensor whose dtype is not a template argument (the rotary kernel's
// weights and cos/sin cache: real models mix them, and a head needs only a few values).
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

__device__ inline void load_chunk_of_dtype(const void* data, long long dtype, long long offset, float (&values)[kChunk]) {
    if (dtype == kFloat32) load_chunk(static_cast<const float*>(data) + offset, values);
    else if (dtype == kFloat16) load_chunk(static_cast<const float16*>(data) + offset, values);
    else load_chunk(static_cast<const bfloat16*>(data) + offset, values);
}

__device__ inline float load_of_dtype(const void* data, long long dtype, long long offset) {
    if (dtype == kFloat32) return static_cast<const float*>(data)[offset];
    if (dtype == kFloat16) return to_float(static_cast<const float16*>(data)[offset]);
    return to_float(static_cast<const bfloat16*>(data)[offset]);
}

// Rows of an activation [B, S, D] (or [N, D] as B = 1) whose last dimension has stride 1.
struct Rows {
    const void* data;
    long long batch_stride;
    long long token_stride;
};

// A modulation tensor (of the kernel's parameter dtype P) in any form of OPS.md, as one addressing rule: a scalar has every
// stride 0, a [D] vector only dim_stride, a per-batch vector a batch_stride, a per-token one
// a group_stride with group_size 1, a per-frame one a group_stride with group_size = S / F.
// dim_stride is 0 (one value for the whole row) or 1. data == nullptr: absent.
struct Modulation {
    const void* data;
    long long batch_stride;
    long long group_stride;
    long long group_size;
    long long dim_stride;
};

// One row's modulation vector: found once per row (the division by group_size is costly),
// then read chunk by chunk. data == nullptr: the tensor is absent.
template <typename P>
struct ModulationRow {
    const P* data;
    bool scalar;  // one value for the whole row

    __device__ ModulationRow(const Modulation& m, int batch, int token)
        : data(m.data ? static_cast<const P*>(m.data) + batch * m.batch_stride
                            + static_cast<long long>(token / static_cast<int>(m.group_size)) * m.group_stride
                      : nullptr),
          scalar(m.dim_stride == 0) {}

    __device__ void load(long long column, float (&values)[kChunk]) const {
        if (scalar) {
            const float value = to_float(*data);
#pragma unroll
            for (int i = 0; i < kChunk; ++i) values[i] = value;
        } else {
            load_chunk(data + column, values);
        }
    }
};

// An integer tensor [B, S] (or [T], batch_stride 0) of any integer or bool dtype, read as
// long long: positions and selection indices.
struct Integers {
    const void* data;
    long long element_size;
    long long batch_stride;
    long long token_stride;
};

__device__ inline long long load_integer(const Integers& view, long long batch, long long token) {
    const long long offset = batch * view.batch_stride + token * view.token_stride;
    switch (view.element_size) {
        case 1: return static_cast<const unsigned char*>(view.data)[offset];
        case 2: return static_cast<const short*>(view.data)[offset];
        case 4: return static_cast<const int*>(view.data)[offset];
        default: return static_cast<const long long*>(view.data)[offset];
    }
}

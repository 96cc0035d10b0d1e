// How kernels read and write memory: 16-byte vector accesses of kChunk elements, and the
// views the Python launch code passes (ditops/backends/compiled.py packs them).
#pragma once
#include "portability.cuh"

// Elements a thread moves per access: 16 bytes of 16-bit data, two 16-byte accesses of float.
// Callers guarantee 16-byte aligned addresses (the registry's alignment constraint).
constexpr int kChunk = 8;

// A chunk of kChunk elements of T as 16-byte words, and its elements as float.
template <typename T>
struct ChunkWords {
    static constexpr int count = kChunk * sizeof(T) / 16;
};

__device__ inline unsigned word_component(const uint4& word, int c) {
    return c == 0 ? word.x : c == 1 ? word.y : c == 2 ? word.z : word.w;
}

__device__ inline void set_word_component(uint4& word, int c, unsigned value) {
    if (c == 0) word.x = value;
    else if (c == 1) word.y = value;
    else if (c == 2) word.z = value;
    else word.w = value;
}

template <typename T, int WORDS>
__device__ inline float word_element(const uint4 (&words)[WORDS], int e) {
    constexpr int per_word = 16 / sizeof(T), per_component = 4 / sizeof(T), bits = 8 * sizeof(T);
    const unsigned component = word_component(words[e / per_word], (e % per_word) / per_component);
    return bits_to_float<T>(per_component == 1 ? component : (component >> (bits * (e % per_component))) & 0xffffu);
}

// Rounds value to T (to nearest even) into element e.
template <typename T, int WORDS>
__device__ inline void set_word_element(uint4 (&words)[WORDS], int e, float value) {
    constexpr int per_word = 16 / sizeof(T), per_component = 4 / sizeof(T), bits = 8 * sizeof(T);
    const int c = (e % per_word) / per_component;
    const unsigned element = float_to_bits<T>(value);
    if (per_component == 1) {
        set_word_component(words[e / per_word], c, element);
    } else {
        const int shift = bits * (e % per_component);
        const unsigned kept = word_component(words[e / per_word], c) & ~(0xffffu << shift);
        set_word_component(words[e / per_word], c, kept | (element << shift));
    }
}

// Words of which every element of T reads as value (a value T holds exactly).
template <typename T, int WORDS>
__device__ inline void broadcast_words(float value, uint4 (&words)[WORDS]) {
    unsigned component = float_to_bits<T>(value);
    if constexpr (sizeof(T) == 2) component |= component << 16;
#pragma unroll
    for (int w = 0; w < WORDS; ++w) words[w] = make_uint4(component, component, component, component);
}

// Only for data no thread of the kernel writes (every input but the in-place q and k).
template <typename T>
__device__ inline void load_chunk(const T* source, float (&values)[kChunk]) {
    uint4 words[ChunkWords<T>::count];
#pragma unroll
    for (int w = 0; w < ChunkWords<T>::count; ++w) words[w] = load_read_only(reinterpret_cast<const uint4*>(source) + w);
#pragma unroll
    for (int e = 0; e < kChunk; ++e) values[e] = word_element<T>(words, e);
}

// STREAMING: with the streaming cache hint (the same bits either way).
template <bool STREAMING = false, typename T>
__device__ inline void store_chunk(T* target, const float (&values)[kChunk]) {
    uint4 words[ChunkWords<T>::count];
#pragma unroll
    for (int e = 0; e < kChunk; ++e) set_word_element<T>(words, e, values[e]);
#pragma unroll
    for (int w = 0; w < ChunkWords<T>::count; ++w) store_hinted<STREAMING>(reinterpret_cast<uint4*>(target) + w, words[w]);
}

// A chunk as FP8 codes of format F (fp8.cuh), one 8-byte store: FP8 rows are 8-byte aligned
// where their 16-bit or float inputs are 16-byte aligned. Two words, not an array (as above).
template <typename F>
__device__ inline void store_fp8_chunk(F* target, const float (&values)[kChunk]) {
    const unsigned low = fp8_pair_bits<F>(values[0], values[1]) | fp8_pair_bits<F>(values[2], values[3]) << 16;
    const unsigned high = fp8_pair_bits<F>(values[4], values[5]) | fp8_pair_bits<F>(values[6], values[7]) << 16;
    *reinterpret_cast<uint2*>(target) = make_uint2(low, high);
}

// The run-time dtype of a tensor whose dtype is not a template argument (the rotary kernel's
// weights and cos/sin cache: real models mix them, and a head needs only a few values).
enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

__device__ inline void load_chunk_of_dtype(const void* data, long long dtype, long long offset, float (&values)[kChunk]) {
    if (dtype == kFloat32) load_chunk(static_cast<const float*>(data) + offset, values);
    else if (dtype == kFloat16) load_chunk(static_cast<const float16*>(data) + offset, values);
    else load_chunk(static_cast<const bfloat16*>(data) + offset, values);
}

// Four values of a run-time dtype at offset (16 bytes of float, 8 of 16-bit data, that aligned):
// the rotary kernel's cos or sin of four interleaved pairs.
__device__ inline void load_quad_of_dtype(const void* data, long long dtype, long long offset, float* values) {
    if (dtype == kFloat32) {
        const uint4 word = load_read_only(reinterpret_cast<const uint4*>(static_cast<const float*>(data) + offset));
        values[0] = __uint_as_float(word.x), values[1] = __uint_as_float(word.y);
        values[2] = __uint_as_float(word.z), values[3] = __uint_as_float(word.w);
    } else {
        const uint2 word = load_read_only(reinterpret_cast<const uint2*>(static_cast<const unsigned short*>(data) + offset));
        const unsigned halves[4] = {word.x & 0xffffu, word.x >> 16, word.y & 0xffffu, word.y >> 16};
#pragma unroll
        for (int i = 0; i < 4; ++i) values[i] = dtype == kFloat16 ? bits_to_float<float16>(halves[i]) : bits_to_float<bfloat16>(halves[i]);
    }
}

// Rows of an activation [B, S, D] (or [N, D] as B = 1) whose last dimension has stride 1.
struct Rows {
    const void* data;
    long long batch_stride;
    long long token_stride;
};

// A modulation tensor (of the kernel's parameter dtype P) in any form of docs/ops.md, as one addressing rule: a scalar has every
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
// then read chunk by chunk (RowVector in row_tile.cuh). data == nullptr: the tensor is absent.
template <typename P>
struct ModulationRow {
    const P* data;
    bool scalar;  // one value for the whole row

    __device__ ModulationRow(const Modulation& m, int batch, int token)
        : data(m.data ? static_cast<const P*>(m.data) + batch * m.batch_stride + group_offset(m, token) : nullptr),
          scalar(m.dim_stride == 0) {}

    // The division only where the modulation varies over tokens (a branch, not a select: the
    // compiler may not compute a division it cannot prove safe): it is some 25 instructions,
    // two to six a row, in kernels that issue about 900 a row.
    __device__ static long long group_offset(const Modulation& m, int token) {
        if (m.group_stride == 0) return 0;
        return static_cast<long long>(token / static_cast<int>(m.group_size)) * m.group_stride;
    }
};

// Division by a number d fixed for the launch, of values below 2^31 (slots, rows), as a multiply
// and shifts (Granlund and Montgomery): with shift = ceil(log2 d) and multiplier = ceil(2^(31 +
// shift) / d), below 2^32, the high word of 2 * value * multiplier shifted right by shift is the
// exact quotient for every such value, in three 32-bit instructions where a division is some
// 20. ditops/backends/compiled.py (`divisor`) computes both.
struct Divisor {
    long long multiplier;
    long long shift;

    __device__ unsigned divide(unsigned value) const {
        return __umulhi(value << 1, static_cast<unsigned>(multiplier)) >> static_cast<unsigned>(shift);
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

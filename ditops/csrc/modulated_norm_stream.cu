// Op 1's FP8 form, y = norm(x) * (1 + scale) + shift as FP8 rows and their scales, for calls
// whose modulation is one vector per batch item (FLUX, Wan, HunyuanVideo, Qwen-Image): the same
// results as modulated_norm.cu's FP8 instances within the format's rounding, on a persistent grid
// that streams rows. A row belongs to ROW_WARPS warps; a block holds GROUPS such row groups, all of
// batch item blockIdx.y, each looping over that item's tokens. (1 + scale) and shift are turned
// into float once per block (in registers, or in shared memory where they would not fit), and
// each thread copies its chunks of the group's next STAGES - 1 rows into shared memory (cp.async)
// while it computes one: the loads stay in flight across the row's reductions, which bound the
// one-row-a-group kernel on the H200 (compiled_launch.yaml: modulated_norm_stream).
// NVIDIA only (cp.async, named barriers: portability.cuh): the launch table has no AMD entries.
#include "row_tile.cuh"

// Sums and magnitude maxima over a row group's threads, the same bits in every thread: within
// each warp, then the warps' partial results in a fixed order, exchanged through shared memory
// under the group's own barrier (the other groups of the block run on). Slots 0 (mean), 1
// (variance) and 2 (amax): a warp writes slot 0 of its next row only after every warp of the
// group passed this row's slot-1 barrier, so after each read slot 0.
template <int ROW_WARPS>
struct GroupReduce {
    float* partial;  // [3][ROW_WARPS] of this group
    int warp, barrier;

    __device__ float across_warps(float value, int slot) const {
        if (threadIdx.x % kWarpSize == 0) partial[slot * ROW_WARPS + warp] = value;
        named_barrier(barrier, ROW_WARPS * kWarpSize);
        return partial[slot * ROW_WARPS];
    }

    __device__ float sum(float value, int slot) const {
#pragma unroll
        for (int mask = kWarpSize / 2; mask > 0; mask /= 2) value += shuffle_xor(value, mask);
        if constexpr (ROW_WARPS > 1) {
            value = across_warps(value, slot);
#pragma unroll
            for (int w = 1; w < ROW_WARPS; ++w) value += partial[slot * ROW_WARPS + w];
        }
        return value;
    }

    // Of magnitudes (>= 0, or NaN): compared as unsigned bits, NaN above Inf.
    __device__ float magnitude_max(float value) const {
        value = __uint_as_float(warp_max(__float_as_uint(value)));
        if constexpr (ROW_WARPS > 1) {
            value = across_warps(value, 2);
#pragma unroll
            for (int w = 1; w < ROW_WARPS; ++w) value = magnitude_max_nan(value, partial[2 * ROW_WARPS + w]);
        }
        return value;
    }
};

// This thread's (1 + scale) and shift as float, chunk by chunk. In registers, or staged by the
// block in shared memory ([4][chunks] float4: each chunk's two halves of (1 + scale), then of
// shift, so that the reads of consecutive threads are 16 bytes apart) and read for every row.
template <typename P, int ROW_THREADS, int CHUNKS, bool IN_REGISTERS>
struct HoistedModulation {
    static constexpr int kRowChunks = ROW_THREADS * CHUNKS;
    float factor[IN_REGISTERS ? CHUNKS : 1][kChunk], offset[IN_REGISTERS ? CHUNKS : 1][kChunk];
    const float4* staged;
    int lane;

    // A vector's chunk (its one value everywhere for a scalar modulation).
    __device__ static void chunk_of(const ModulationRow<P>& m, long long column, float (&values)[kChunk]) {
        if (m.scalar) {
            const float value = to_float(*m.data);
#pragma unroll
            for (int e = 0; e < kChunk; ++e) values[e] = value;
        } else {
            load_chunk(m.data + column, values);
        }
    }

    // Every thread of the block constructs this (the staging ends in a block barrier).
    __device__ HoistedModulation(const ModulationRow<P>& scale, const ModulationRow<P>& shift, int lane_, long long hidden,
                                 float4* shared)
        : staged(shared), lane(lane_) {
        if constexpr (IN_REGISTERS) {
#pragma unroll
            for (int i = 0; i < CHUNKS; ++i) {
                const long long column = (lane + static_cast<long long>(i) * ROW_THREADS) * kChunk;
#pragma unroll
                for (int e = 0; e < kChunk; ++e) factor[i][e] = offset[i][e] = 0.0f;  // past D: never used
                if (column < hidden) {
                    chunk_of(scale, column, factor[i]);
                    chunk_of(shift, column, offset[i]);
                }
#pragma unroll
                for (int e = 0; e < kChunk; ++e) {
                    factor[i][e] += 1.0f;
                    // opaque: else the compiler keeps the 16-bit words and converts them for every row
                    asm volatile("" : "+f"(factor[i][e]), "+f"(offset[i][e]));
                }
            }
        } else {
            for (int j = threadIdx.x; j < kRowChunks && j * kChunk < hidden; j += blockDim.x) {
                float s[kChunk], t[kChunk];
                chunk_of(scale, static_cast<long long>(j) * kChunk, s);
                chunk_of(shift, static_cast<long long>(j) * kChunk, t);
                shared[j] = make_float4(1.0f + s[0], 1.0f + s[1], 1.0f + s[2], 1.0f + s[3]);
                shared[kRowChunks + j] = make_float4(1.0f + s[4], 1.0f + s[5], 1.0f + s[6], 1.0f + s[7]);
                shared[2 * kRowChunks + j] = make_float4(t[0], t[1], t[2], t[3]);
                shared[3 * kRowChunks + j] = make_float4(t[4], t[5], t[6], t[7]);
            }
            __syncthreads();
        }
    }

    __device__ void get(int i, float (&f)[kChunk], float (&o)[kChunk]) const {
        if constexpr (IN_REGISTERS) {
#pragma unroll
            for (int e = 0; e < kChunk; ++e) f[e] = factor[i][e], o[e] = offset[i][e];
        } else {
            const int j = lane + i * ROW_THREADS;
            const float4 f0 = load_shared_volatile(staged + j), f1 = load_shared_volatile(staged + kRowChunks + j);
            const float4 o0 = load_shared_volatile(staged + 2 * kRowChunks + j), o1 = load_shared_volatile(staged + 3 * kRowChunks + j);
            f[0] = f0.x, f[1] = f0.y, f[2] = f0.z, f[3] = f0.w, f[4] = f1.x, f[5] = f1.y, f[6] = f1.z, f[7] = f1.w;
            o[0] = o0.x, o[1] = o0.y, o[2] = o0.z, o[3] = o0.w, o[4] = o1.x, o[5] = o1.y, o[6] = o1.z, o[7] = o1.w;
        }
    }
};

// Dynamic shared memory: the hoisted modulation where it is not in registers, then the rows' ring
// ([GROUPS][STAGES][ROW_THREADS * CHUNKS] chunks). ditops/backends/compiled.py sizes it alike.
// WHOLE: D is ROW_THREADS * CHUNKS * kChunk, a constant, and every thread holds all its chunks:
// without a test per chunk (a branch each, which keeps the compiler from interleaving the chunks'
// arithmetic). RMS: RMSNorm, else LayerNorm. A branch in the row loop costs its scheduling (a
// run-time RMS flag and static-scale test: 4% on HunyuanVideo's rows, H200), so RMS is a template
// flag and a static scale is chosen per row by a select. Rows and tokens are 32-bit: the launch
// code keeps B * S below 2^31.
template <typename T, typename P, typename Y, bool RMS, int ROW_WARPS, int GROUPS, int CHUNKS, int STAGES,
          bool MODULATION_IN_REGISTERS, bool WHOLE, int MIN_BLOCKS>
__global__ void LAUNCH_BOUNDS(ROW_WARPS * kWarpSize * GROUPS, MIN_BLOCKS) modulated_norm_stream(
    Rows x, Modulation scale, Modulation shift, Y* __restrict__ y, float* __restrict__ y_scale,
    const float* __restrict__ static_scale, float eps, long long tokens, long long hidden) {
    static_assert(sizeof(T) == 2 && sizeof(Y) == 1, "16-bit rows to FP8 rows");
    static_assert(GROUPS <= 15 && STAGES >= 2, "a named barrier per group (16 per block, 0 is __syncthreads)");
    constexpr int ROW_THREADS = ROW_WARPS * kWarpSize, kRowChunks = ROW_THREADS * CHUNKS;
    extern __shared__ uint4 shared[];
    __shared__ float partials[GROUPS][3][ROW_WARPS];
    const int group = threadIdx.x / ROW_THREADS, lane = threadIdx.x % ROW_THREADS, batch = blockIdx.y;
    const GroupReduce<ROW_WARPS> reduce{&partials[group][0][0], lane / kWarpSize, 1 + group};
    uint4* ring = shared + (MODULATION_IN_REGISTERS ? 0 : 4 * kRowChunks) + group * STAGES * kRowChunks;
    const int width = WHOLE ? kRowChunks * kChunk : static_cast<int>(hidden), count = static_cast<int>(tokens);
    const int beyond = width / kChunk - lane;  // chunk i is held while i * ROW_THREADS < beyond
    const int held = WHOLE ? CHUNKS : beyond <= 0 ? 0 : min(CHUNKS, (beyond + ROW_THREADS - 1) / ROW_THREADS);
    const T* rows = static_cast<const T*>(x.data) + batch * x.batch_stride;
    // a call of fewer rows than groups spreads them over the blocks, a row each, not the groups of a few
    const int first = group * gridDim.x + blockIdx.x, step = gridDim.x * GROUPS;

    // Slot s % STAGES holds the group's s-th row. Each thread copies exactly the chunks it reads,
    // so its own wait is all the ordering needed; a slot is refilled an iteration after it was read.
    auto fill = [&](int slot, int token) {
        if (token < count) {
            const T* source = rows + token * x.token_stride + lane * kChunk;
#pragma unroll
            for (int i = 0; i < CHUNKS; ++i)
                if (i < held) copy_async_16(ring + slot * kRowChunks + lane + i * ROW_THREADS, source + i * ROW_THREADS * kChunk);
        }
        copy_async_commit();  // empty groups past the last row keep the count regular
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) fill(s, first + s * step);
    // after the first rows' copies are issued, so that the two loads overlap
    const HoistedModulation<P, ROW_THREADS, CHUNKS, MODULATION_IN_REGISTERS> modulation(
        ModulationRow<P>(scale, batch, 0), ModulationRow<P>(shift, batch, 0), lane, hidden, reinterpret_cast<float4*>(shared));
    const float fixed_scale = static_scale ? *static_scale : 0.0f;
    int slot = 0;
    for (int token = first; token < count; token += step) {
        copy_async_wait<STAGES - 2>();
        float v[CHUNKS][kChunk];  // x, then x - mean, then y
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            uint4 word[1] = {i < held ? ring[slot * kRowChunks + lane + i * ROW_THREADS] : make_uint4(0, 0, 0, 0)};
#pragma unroll
            for (int e = 0; e < kChunk; ++e) v[i][e] = word_element<T>(word, e);
        }
        fill(slot == 0 ? STAGES - 1 : slot - 1, token + (STAGES - 1) * step);
        slot = slot == STAGES - 1 ? 0 : slot + 1;

        float mean = 0.0f;
        if constexpr (!RMS) {
            float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int i = 0; i < CHUNKS; ++i)
#pragma unroll
                for (int e = 0; e < kChunk; ++e) sums[e % 4] += v[i][e];
            mean = reduce.sum((sums[0] + sums[1]) + (sums[2] + sums[3]), 0) / width;
        }
        float squares[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            if (i >= held) continue;
#pragma unroll
            for (int e = 0; e < kChunk; ++e) {
                v[i][e] -= mean;
                squares[e % 4] += v[i][e] * v[i][e];
            }
        }
        const float inverse_deviation = rsqrtf(reduce.sum((squares[0] + squares[1]) + (squares[2] + squares[3]), 1) / width + eps);
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            if (i >= held) continue;
            float f[kChunk], o[kChunk];
            modulation.get(i, f, o);
#pragma unroll
            for (int e = 0; e < kChunk; ++e) {
                v[i][e] = v[i][e] * inverse_deviation * f[e] + o[e];
                amax = magnitude_max_nan(amax, v[i][e]);
            }
        }
        amax = reduce.magnitude_max(amax);
        const float dynamic = dynamic_row_scale<Y>(amax);  // as QuantizedRow::store: the reference's scale bit for bit
        const float row_scale = static_scale ? fixed_scale : dynamic;
        const float inverse = 1.0f / row_scale;
        const int row = batch * count + token;
        Y* out = y + static_cast<long long>(row) * width + lane * kChunk;
#pragma unroll
        for (int i = 0; i < CHUNKS; ++i) {
            if (i >= held) continue;
            float scaled[kChunk];
#pragma unroll
            for (int e = 0; e < kChunk; ++e) scaled[e] = v[i][e] * inverse;
            store_fp8_chunk(out + i * ROW_THREADS * kChunk, scaled);
        }
        if (lane == 0) y_scale[row] = row_scale;
    }
    copy_async_wait<0>();  // no copy outlives the block
}
